"""Writes this example's data as verl's data preprocessing writes it: Parquet, one row a problem.

    python examples/verl-arith/make_data.py      # data/train.parquet (187 rows), data/validation.parquet (100)

Each row has verl's columns (verl docs, "Prepare Data for Post-Training"):
- `data_source`: the dataset's name, which verl (and this example's reward) receives first;
- `prompt`: the chat messages, here one user message, rendered with the model's own chat template;
- `ability`: the kind of task;
- `reward_model`: `{"style": "rule", "ground_truth": "10"}`, the gold answer as text;
- `extra_info`: `{"split", "index", "expression"}`, handed to the reward as it is.

Training holds every problem `a + b` and `a - b` (a >= b) with operands 0..10: 187 rows.
Validation holds 100 problems with one operand in 11..20, none of them in training.
Deterministic: the same files every time.
"""
from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "laminar/arith-words"
INSTRUCTION = "Answer with just the number."


def row(a: int, op: str, b: int, split: str, index: int) -> dict:
    expression = f"{a} {op} {b}"
    value = a + b if op == "+" else a - b
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"What is {expression}? {INSTRUCTION}"}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(value)},
            "extra_info": {"split": split, "index": index, "expression": expression}}


def problems(lo: int, hi: int) -> list[tuple[int, str, int]]:
    """Every a + b and a - b (a >= b: no negative answers) with operands in lo..hi."""
    return ([(a, "+", b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
            + [(a, "-", b) for a in range(lo, hi + 1) for b in range(lo, a + 1)])


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(23)
    train = problems(0, 10)
    rng.shuffle(train)
    seen = set(train)
    unseen = [p for p in problems(0, 20) if p not in seen]  # one operand or both above 10
    rng.shuffle(unseen)
    for split, items in (("train", train), ("validation", unseen[:100])):
        rows = [row(a, op, b, split, i) for i, (a, op, b) in enumerate(items)]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        print(f"wrote {out / split}.parquet ({len(rows)} rows)")


if __name__ == "__main__":
    main()
