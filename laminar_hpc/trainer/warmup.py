"""Supervised warm-up on the task format, so RL starts from a policy it can improve.

Trains on (prompt, answer) pairs whose answer digits are replaced at random with probability
`label_noise`: the model learns the format and the rough skill, but its samples stay noisy.
Every `eval_every` steps it decodes a held-out batch greedily; warm-up ends once that greedy
reward reaches `target_greedy_reward` (or after `max_steps`). RL then has to turn a policy
that *can* solve the task into one that reliably *does* when sampling.

With `warmup.data` it trains on the user's own demonstrations instead (chat conversations, tool
calls included: tasks/sources/demos.py, tasks/sources/demo_tokens.py), on a `model.hf_path` checkpoint too.

The evaluation decodes as a rollout would (a float32 CPU copy of the policy, the model's KV
cache, the sampler's greedy pick), with the model package only: the trainer sits below the
rollout role and never imports it.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable

import torch

from laminar_hpc.model.adapters import plain_state_dict
from laminar_hpc.model.llama import KVCache, Transformer, token_logprobs
from laminar_hpc.model.sampling import sample_tokens
from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.rewards.reward_pool import score_all
from laminar_hpc.tasks.problem import Response
from laminar_hpc.tasks.sources.demo_tokens import demo_rows
from laminar_hpc.trainer.warmup_episodes import demo_sequence, greedy_episodes, noisy_digits

if TYPE_CHECKING:
    from laminar_hpc.config.schema import WarmupCfg

WARMUP_OFFSET = 1 << 40  # problem indices used by warm-up: disjoint from RL's (which start at 0)
EVAL_OFFSET = 1 << 41


@torch.inference_mode()
def greedy_decode(model: Transformer, prompts: list[list[int]], eos_id: int, max_new_tokens: int) -> list[list[int]]:
    """The greedy completion of each prompt (ending with `eos_id` unless cut at `max_new_tokens`
    or the model's max_seq_len). All prompts are prefilled as one right-padded batch, then each
    step decodes one token per unfinished sequence; a finished sequence leaves the batch and the
    last one moves into its cache slot. That is the rollout engine's order of work, so the rows
    computed together, and hence the tokens, are the ones a rollout would produce."""
    args = model.args
    for p in prompts:
        if len(p) + 1 > args.max_seq_len or max_new_tokens < 1:
            raise ValueError(f"a prompt of {len(p)} tokens leaves no room to generate "
                             f"(model.max_seq_len={args.max_seq_len}, max_new_tokens={max_new_tokens})")
    n, width = len(prompts), max(len(p) for p in prompts)
    cache = KVCache(args, n)
    x = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        x[i, :len(p)] = torch.tensor(p)
    logits = model(x, cache=cache, positions=torch.arange(width).expand(n, width), key_len=width)
    logits = logits[torch.arange(n), torch.tensor([len(p) - 1 for p in prompts])]
    out: list[list[int]] = [[] for _ in prompts]
    seq = list(range(n))  # cache slot -> sequence
    filled = [len(p) for p in prompts]  # cache slot -> positions written
    while True:
        picks, _ = sample_tokens(logits, 0.0, 1.0)  # temperature 0: the arg-max
        for s, t in enumerate(picks.tolist()):
            out[seq[s]].append(t)
        for s in reversed(range(len(seq))):  # from the back: a slot moved into a hole is unfinished
            o, i = out[seq[s]], seq[s]
            if o[-1] == eos_id or len(o) >= max_new_tokens or len(prompts[i]) + len(o) >= args.max_seq_len:
                if s != len(seq) - 1:
                    cache.move_slot(len(seq) - 1, s)
                    seq[s], filled[s] = seq[-1], filled[-1]
                seq.pop()
                filled.pop()
        if not seq:
            return out
        pos = torch.tensor([[f] for f in filled])
        tokens = torch.tensor([[out[i][-1]] for i in seq])
        logits = model(tokens, cache=cache, positions=pos, key_len=int(pos.max()) + 1)[:, -1]
        filled = [f + 1 for f in filled]


def greedy_reward(model: Transformer, task, tok, n: int, max_new_tokens: int, reward, env=None,
                  failures: Counter | None = None, tool_calls: list[int] | None = None,
                  scorer_factory=None) -> float:
    """Mean reward of greedy answers to `n` held-out problems, scored by `reward` (task.reward) in
    a reward pool, as the rollouts score (`env`: a tool task's episodes, trainer/warmup_episodes.py;
    `scorer_factory`: the pool's, which asks the campaign's judges where it has some).
    `failures` counts the calls that failed (scored 0), by reason; `tool_calls` gets each
    episode's tool calls."""
    # a float32 CPU copy, as a rollout holds the published weights (whatever the trainer's device and dtype)
    policy = Transformer(model.args).requires_grad_(False)
    policy.load_state_dict(plain_state_dict(model))  # (a policy of adapters: merged into its base)
    if env is not None and env.enabled:
        def decode(prompts: list[list[int]], rooms: list[int]) -> list[list[int]]:
            outs = greedy_decode(policy, prompts, tok.eos_id, max(rooms))
            return [o[:r] for o, r in zip(outs, rooms)]
        problems = [task.problem(EVAL_OFFSET + i) for i in range(n)]
        rewards = greedy_episodes(policy, task, tok, problems, env, max_new_tokens=max_new_tokens, reward=reward,
                                  decode=decode, calls=tool_calls)
        return sum(rewards) / max(1, len(rewards))
    # a row whose prompt leaves no room to answer is skipped, as admission refuses it in RL
    rows = [(p, encode_prompt(tok, p)) for p in (task.problem(EVAL_OFFSET + i) for i in range(n))]
    rows = [(p, x) for p, x in rows if fits(x, model.args.max_seq_len)]
    if not rows:
        return 0.0
    answers = greedy_decode(policy, [x for _, x in rows], tok.eos_id, max_new_tokens)
    outcomes = score_all(reward, [(p, Response(tok.decode([t for t in a if t != tok.eos_id]), tuple(a)))
                                  for (p, _), a in zip(rows, answers)], scorer_factory)
    if failures is not None:
        failures.update(o.error for o in outcomes if o.error is not None)
    return sum(o.reward for o in outcomes) / len(rows)


def fits(prompt: list[int], max_seq_len: int) -> bool:
    """Whether a prompt leaves room for at least one generated token."""
    return 0 < len(prompt) < max_seq_len


def run_warmup(model: Transformer, task, tok, cfg: WarmupCfg, seed: int, max_new_tokens: int,
               report: Callable[[dict], None], should_stop: Callable[[], bool] = lambda: False, *, reward,
               env=None, progress: Callable[[int], None] = lambda step: None, scorer_factory=None) -> dict:
    """Returns {'steps', 'greedy_reward', 'seconds'}; `report` gets one dict per evaluation,
    `progress` each step number as it ends. Ends early (incomplete) when `should_stop()` turns true.
    `scorer_factory`: how its evaluations' reward pool scores (greedy_reward)."""
    w = cfg
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=w.lr, weight_decay=0.0)
    rng = random.Random(seed)
    t0 = time.monotonic()
    score, step = 0.0, 0
    calls: dict = {}  # a tool task's: the last evaluation's tool calls per greedy episode
    failed: Counter = Counter()  # the last evaluation's rewards that failed, by reason
    demos = env is not None and env.enabled and hasattr(task, "demonstration")
    # warmup.data: the user's demonstrations, tool calls included (tasks/sources/demo_tokens.py)
    rows = demo_rows(w.data, task, tok, env, max_len=model.args.max_seq_len, seed=seed) if w.data else None
    for step in range(1, w.max_steps + 1):
        if should_stop():
            break
        seqs, starts, masks = [], [], []
        if rows is not None:
            seqs, masks, starts = rows.batch(step, w.batch_size, lambda text: noisy_digits(text, w.label_noise, rng))
        probs = [] if rows is not None else [task.problem(WARMUP_OFFSET + (step - 1) * w.batch_size + i)
                                             for i in range(w.batch_size)]
        for p in probs:
            if demos:  # a tool task: whole episodes, the model's turns learned (observations are context)
                seq, m, p0 = demo_sequence(task, tok, p, noise=w.label_noise, rng=rng, max_len=model.args.max_seq_len)
                if p0 < model.args.max_seq_len:
                    seqs.append(seq)
                    starts.append(p0)
                    masks.append(m)
                continue
            prompt = encode_prompt(tok, p)
            answer = tok.encode(noisy_digits(p.answer, w.label_noise, rng))[: max_new_tokens - 1]
            if not fits(prompt, model.args.max_seq_len):
                continue  # a row too long for the model: skipped (RL's admission refuses it too)
            seqs.append((prompt + answer + [tok.eos_id])[: model.args.max_seq_len])
            starts.append(len(prompt))
        if not seqs:
            continue
        width = max(len(s) for s in seqs)
        x = torch.full((len(seqs), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), width - 1)
        for i, (s, p0) in enumerate(zip(seqs, starts)):
            x[i, :len(s)] = torch.tensor(s)
            if masks:  # target position t predicts token t+1
                mask[i, :len(s) - 1] = torch.tensor(masks[i][1:], dtype=mask.dtype)
            else:
                mask[i, p0 - 1:len(s) - 1] = 1.0
        logp = token_logprobs(model(x[:, :-1]), x[:, 1:])
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        progress(step)
        if step % w.eval_every == 0 or step == w.max_steps:
            failed, made = Counter(), []
            score = greedy_reward(model, task, tok, w.eval_size, max_new_tokens, reward, env, failed, made,
                                  scorer_factory=scorer_factory)
            calls = {"greedy_tool_calls": sum(made) / len(made)} if made else {}
            # rewards that failed show in the live display (metrics/progress.py) and the trainer's log
            report({"step": step, "loss": loss.item(), "greedy_reward": score, "seconds": time.monotonic() - t0,
                    **failure_fields(failed), **calls})
            if score >= w.target_greedy_reward and step >= w.min_steps:
                break
    data = {} if rows is None else {"demos": len(rows.demos), "demos_too_long": rows.too_long}
    return {"steps": step, "greedy_reward": score, "seconds": time.monotonic() - t0, **failure_fields(failed), **calls,
            **data}


def failure_fields(failed: Counter) -> dict:
    """The warm-up evaluation's failed reward calls, as scalar fields: `reward_failed` (how many
    scored 0) and `reward_failed_by` ('exception 3, timeout 1')."""
    return {"reward_failed": sum(failed.values()),
            "reward_failed_by": ", ".join(f"{k} {v}" for k, v in sorted(failed.items()))}
