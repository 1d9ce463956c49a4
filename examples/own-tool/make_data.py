r"""Writes this example's data: the task's rows and the warm-up's demonstrations.

    python examples/own-tool/make_data.py

- data/train.jsonl (2,000 rows) and data/validation.jsonl (100): `{"question": "How many units of
  SKU 40127 are in stock?", "answer": "417", "sku": "40127"}`, the answer the tool's count;
- data/demos.jsonl (400 conversations, `warmup.data`): the system prompt the config sets, the
  question, the assistant's call in the Hermes format, the tool's result, the answer:

    {"messages": [{"role": "system", "content": "You answer questions about the warehouse. ..."},
                  {"role": "user", "content": "How many units of SKU 40127 are in stock?"},
                  {"role": "assistant",
                   "content": "<tool_call>{\"name\": \"stock\", \"arguments\": {\"sku\": \"40127\"}}</tool_call>"},
                  {"role": "tool", "content": "{\"sku\": \"40127\", \"units\": 417}"},
                  {"role": "assistant", "content": "417"}]}

SKUs are random 5-digit codes, each used once: validation SKUs appear neither in training nor in
the demonstrations. Deterministic: the same files every time.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tools import stock, units  # noqa: E402  - the tool itself answers the rows and the demonstrations

SYSTEM = "You answer questions about the warehouse. Call the stock tool to look up a SKU."  # config.yaml's


def question(sku: str) -> str:
    return f"How many units of SKU {sku} are in stock?"


def demo(sku: str) -> dict:
    call = json.dumps({"name": "stock", "arguments": {"sku": sku}})
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question(sku)},
                         {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                         {"role": "tool", "content": stock(sku)},
                         {"role": "assistant", "content": str(units(sku))}]}


def main() -> None:
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    skus = [f"{n:05d}" for n in random.Random(29).sample(range(100_000), 2500)]  # distinct
    row = lambda s: {"question": question(s), "answer": str(units(s)), "sku": s}  # noqa: E731
    files = {"validation": [row(s) for s in skus[:100]], "train": [row(s) for s in skus[100:2100]],
             "demos": [demo(s) for s in skus[2100:]]}
    for name, rows in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out / name}.jsonl ({len(rows)} rows)")


if __name__ == "__main__":
    main()
