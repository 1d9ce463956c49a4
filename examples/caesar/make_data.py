"""Writes this example's dataset: Caesar-shifted letter strings, one JSON object per line.

    python examples/caesar/make_data.py          # data/train.jsonl (4,000 rows), data/validation.jsonl (200)

Each row: `question` (the prompt the model reads, "rot2:hello="), `answer` (the shifted text,
"jgnnq"), and two fields of its own that the reward reads (`word`, `shift`). Validation words
never appear in training. Deterministic: the same files every time.
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path


def row(rng: random.Random) -> dict:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))
    shift = rng.randint(1, 3)
    shifted = "".join(chr((ord(c) - 97 + shift) % 26 + 97) for c in word)
    return {"question": f"rot{shift}:{word}=", "answer": shifted, "word": word, "shift": shift}


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(17)
    val = [row(rng) for _ in range(200)]
    seen = {r["word"] for r in val}
    train = []
    while len(train) < 4000:
        r = row(rng)
        if r["word"] not in seen:
            train.append(r)
    for name, rows in (("train", train), ("validation", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / name}.jsonl ({len(rows)} rows)")


if __name__ == "__main__":
    main()
