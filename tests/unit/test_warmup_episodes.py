"""The tool task's warm-up: demonstrations with their loss mask, and greedy episodes that run
the environment's real tools between turns."""
from __future__ import annotations

import random

from laminar_hpc.config.env import EnvCfg
from laminar_hpc.config.task import RewardCfg
from laminar_hpc.model.tokenizer import CharTokenizer
from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.sources.toolcalc import ToolCalcTasks, call_text
from laminar_hpc.trainer.warmup_episodes import demo_sequence, greedy_episodes

TOK = CharTokenizer()
ENV = EnvCfg(tools={"calc": "calculator"}, max_turns=3)


class _Args:
    max_seq_len = 200


class _Policy:
    args = _Args()


def test_a_demonstration_learns_the_model_turns_only():
    task = ToolCalcTasks(0)
    p = task.problem(5)
    seq, mask, p0 = demo_sequence(task, TOK, p, noise=0.0, rng=random.Random(0), max_len=200)
    assert seq[:p0] == encode_prompt(TOK, p) and mask[:p0] == [0] * p0
    text = TOK.decode(seq[p0:])
    assert text == call_text(p.fields["expression"]) + f"<tool_response>{p.answer}</tool_response>" + p.answer
    learned = [t for t, m in zip(seq, mask) if m]
    assert TOK.decode(learned) == call_text(p.fields["expression"]) + p.answer
    assert learned.count(TOK.eos_id) == 2  # each model turn ends with the end-of-turn token
    noisy, _, _ = demo_sequence(task, TOK, p, noise=1.0, rng=random.Random(0), max_len=200)
    assert TOK.decode(noisy).count("<tool_response>" + p.answer) == 1  # observations are never noised


def test_greedy_episodes_call_the_real_calculator_between_turns():
    task = ToolCalcTasks(0)
    problems = [task.problem(i) for i in range(6)]
    seen = []

    def decode(prompts, rooms):
        """A policy that calls the tool on its first turn and answers with what it read."""
        outs = []
        for x in prompts:
            text = TOK.decode(x)
            seen.append(text)
            if "<tool_response>" not in text:
                expr = text.split("mul:")[1].split("=")[0]
                wrong = expr.endswith("3")  # some calls ask for the wrong product: reward 0
                outs.append(TOK.encode(call_text(expr + ("+1" if wrong else ""))) + [TOK.eos_id])
            else:
                outs.append(TOK.encode(text.split("<tool_response>")[1].split("</tool_response>")[0]) + [TOK.eos_id])
        return outs

    rewards = greedy_episodes(_Policy(), task, TOK, problems, ENV, max_new_tokens=150,
                              reward=RewardCfg(fn="exact"), decode=decode)
    assert rewards == [0.0 if p.fields["expression"].endswith("3") else 1.0 for p in problems]
    assert len(seen) == 2 * len(problems)  # two turns each: the call, then the answer


def test_greedy_episodes_stop_at_the_turn_limit():
    task = ToolCalcTasks(0)
    calls = []

    def decode(prompts, rooms):
        calls.append(len(prompts))
        return [TOK.encode(call_text("1*1")) + [TOK.eos_id] for _ in prompts]  # never answers

    rewards = greedy_episodes(_Policy(), task, TOK, [task.problem(0)], EnvCfg(tools={"calc": "calculator"}, max_turns=2),
                              max_new_tokens=190, reward=RewardCfg(fn="exact"), decode=decode)
    assert calls == [1, 1] and rewards == [0.0]
