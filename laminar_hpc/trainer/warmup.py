"""Supervised warm-up on the task format, so RL starts from a policy it can improve.

Trains on (prompt, answer) pairs whose answer digits are replaced at random with probability
`label_noise`: the model learns the format and the rough skill, but its samples stay noisy.
Every `eval_every` steps it decodes a held-out batch greedily; warm-up ends once that greedy
reward reaches `target_greedy_reward` (or after `max_steps`). RL then has to turn a policy
that *can* solve the task into one that reliably *does* when sampling.
"""
from __future__ import annotations

import random
import time
from typing import Callable

import torch

from laminar_hpc.model.llama import Transformer, token_logprobs
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.rollout.engine import SeqRequest, TorchEngine
from laminar_hpc.tasks import encode_prompt

WARMUP_OFFSET = 1 << 40  # problem indices used by warm-up: disjoint from RL's (which start at 0)
EVAL_OFFSET = 1 << 41


def noisy(answer: str, p: float, rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") if c.isdigit() and rng.random() < p else c for c in answer)


def greedy_reward(model: Transformer, task, tok, n: int, max_new_tokens: int) -> float:
    engine = TorchEngine(model.args, tok.eos_id, max_batch=n, temperature=0.0)
    layout = WeightLayout.from_model(model)
    buf = bytearray(layout.nbytes)
    layout.pack(model, memoryview(buf))
    engine.load_weights(0, memoryview(buf), layout)
    problems = [task.problem(EVAL_OFFSET + i) for i in range(n)]
    reqs = [SeqRequest(str(i), encode_prompt(tok, p), max_new_tokens) for i, p in enumerate(problems)]
    engine.add(reqs)
    while engine.num_active():
        engine.step()
    total = 0.0
    for p, r in zip(problems, reqs):
        total += task.reward(tok.decode([t for t in r.tokens if t != tok.eos_id]), p)
    return total / n


def run_warmup(model: Transformer, task, tok, cfg, seed: int, max_new_tokens: int,
               report: Callable[[dict], None], should_stop: Callable[[], bool] = lambda: False) -> dict:
    """Returns {'steps', 'greedy_reward', 'seconds'}; `report` gets one dict per evaluation.
    Ends early (incomplete) when `should_stop()` turns true."""
    w = cfg
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.0)
    rng = random.Random(seed)
    t0 = time.monotonic()
    score, step = 0.0, 0
    for step in range(1, w.max_steps + 1):
        if should_stop():
            break
        probs = [task.problem(WARMUP_OFFSET + (step - 1) * w.batch_size + i) for i in range(w.batch_size)]
        seqs, starts = [], []
        for p in probs:
            prompt = encode_prompt(tok, p)
            answer = tok.encode(noisy(p.answer, w.label_noise, rng))[: max_new_tokens - 1]
            seqs.append(prompt + answer + [tok.eos_id])
            starts.append(len(prompt))
        width = max(len(s) for s in seqs)
        x = torch.full((len(seqs), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), width - 1)
        for i, (s, p0) in enumerate(zip(seqs, starts)):
            x[i, :len(s)] = torch.tensor(s)
            mask[i, p0 - 1:len(s) - 1] = 1.0
        logp = token_logprobs(model(x[:, :-1]), x[:, 1:])
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % w.eval_every == 0 or step == w.max_steps:
            score = greedy_reward(model, task, tok, w.eval_size, max_new_tokens)
            report({"step": step, "loss": loss.item(), "greedy_reward": score,
                    "seconds": time.monotonic() - t0})
            if score >= w.target_greedy_reward:
                break
    return {"steps": step, "greedy_reward": score, "seconds": time.monotonic() - t0}
