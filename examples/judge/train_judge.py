"""Train the example's judge: a small label model (task.reward.judge, kind: label) that answers Y or
N to "is this response the reference answer?" (the config's template shows it the row's answer and
the response: "1284|1248?"), taught by rule on responses made
here: the right answer, near misses of the kinds a policy makes (a digit changed, two swapped,
one dropped or added, the digits unreversed, a right answer cut short, the digits shuffled) and
far misses of the right length (one digit repeated, any digits: what a policy trained on a judge
that saw only near misses learned to write, "9999" for "rev:4821="). Half right, half wrong.

The judge never sees the rule at RL time: the campaign trains on its P(Y) alone, and the rule
(`exact`) is only logged beside it. Its accuracy on held-out pairs is printed (and written with
the weights), so what the policy learns from is a stated, imperfect model.

    .venv/bin/python examples/judge/train_judge.py --out runs/judge-example/judge.pt   # ~4.5 min on 2 cores (0.964 held out)
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from laminar_hpc.config import load_config
from laminar_hpc.judge.verdicts import render
from laminar_hpc.model.factory import build_model, build_tokenizer

HERE = Path(__file__).resolve().parent


def near_miss(answer: str, digits: str, rng: random.Random) -> str:
    """A wrong response close to `answer` (never equal to it)."""
    for _ in range(20):
        kind = rng.randrange(9)
        a = list(answer)
        i = rng.randrange(len(a))
        if kind == 0:
            a[i] = rng.choice("0123456789")
        elif kind == 1 and len(a) > 1:
            j = min(i + 1, len(a) - 1) if i + 1 < len(a) else i - 1
            a[i], a[j] = a[j], a[i]
        elif kind == 2 and len(a) > 1:
            del a[i]
        elif kind == 3:
            a.insert(i, rng.choice("0123456789"))
        elif kind == 4:
            a = list(digits)
        elif kind == 5 and len(a) > 1:
            a = a[:rng.randrange(1, len(a))]
        elif kind == 6:  # far misses a policy falls into once it games a judge that saw only near ones
            a = [rng.choice("0123456789")] * len(a)  # one digit repeated ("9999"), the right length
        elif kind == 7:
            a = [rng.choice("0123456789") for _ in a]  # any digits of the right length
        elif len(a) > 1:
            rng.shuffle(a)  # the right digits in another order
        if "".join(a) != answer:
            return "".join(a)
    return answer + "0"


def example(rng: random.Random, min_len: int, max_len: int) -> tuple[str, str, str, bool]:
    """(prompt, response, reference answer, right) for a random reversal problem, as the builtin
    task writes it."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
    answer = digits[::-1]
    right = rng.random() < 0.5
    return f"rev:{digits}=", answer if right else near_miss(answer, digits, rng), answer, right


def batch(rows, tok, template: str, yes: int, no: int):
    ids = [tok.encode(render(template, problem=p, response=r, answer=a)) for p, r, a, _ in rows]
    width = max(len(x) for x in ids)
    x = torch.zeros(len(ids), width, dtype=torch.long)
    for k, row in enumerate(ids):
        x[k, :len(row)] = torch.tensor(row)
    last = torch.tensor([len(row) - 1 for row in ids])
    target = torch.tensor([yes if right else no for *_, right in rows])
    return x, last, target


def accuracy(model, rows, tok, template, yes, no) -> float:
    with torch.no_grad():
        x, last, target = batch(rows, tok, template, yes, no)
        logits = model(x)[torch.arange(len(rows)), last]
        said = torch.where(logits[:, yes] > logits[:, no], yes, no)
    return float((said == target).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(HERE / "config.yaml"))
    ap.add_argument("--out", type=Path, default=Path("runs/judge-example/judge.pt"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)  # not the campaign's: the judge's own data
    a = ap.parse_args()
    cfg = load_config(a.config)
    judge, task = cfg.task.reward.judge, cfg.task
    torch.manual_seed(a.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = build_tokenizer(judge.model)
    yes, no = (tok.encode(label)[0] for label in judge.labels)  # {"Y": 1.0, "N": 0.0}: in that order
    model = build_model(judge.model, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    # a short warm-up, then cosine to 0: a constant 1e-3 made the loss climb back after ~1,500 steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / a.steps)))
    rng = random.Random(a.seed)
    held_out = [example(random.Random(f"held-out:{k}"), task.min_len, task.max_len) for k in range(2000)]
    t0 = time.monotonic()
    for step in range(1, a.steps + 1):
        x, last, target = batch([example(rng, task.min_len, task.max_len) for _ in range(128)],
                                tok, judge.template, yes, no)
        loss = torch.nn.functional.cross_entropy(model(x)[torch.arange(len(target)), last], target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 250 == 0:
            acc = accuracy(model.eval(), held_out, tok, judge.template, yes, no)
            model.train()
            print(f"step {step}: loss {loss.item():.3f}, held-out accuracy {acc:.3f}", flush=True)
    acc = accuracy(model.eval(), held_out, tok, judge.template, yes, no)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), a.out)
    a.out.with_suffix(".json").write_text(json.dumps({"held_out_accuracy": acc, "steps": a.steps, "seed": a.seed,
                                                      "train_s": round(time.monotonic() - t0, 1)}) + "\n")
    print(f"judge: held-out accuracy {acc:.3f} on {len(held_out)} pairs (half right, half near misses); "
          f"weights in {a.out}")


if __name__ == "__main__":
    main()
