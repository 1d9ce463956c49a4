"""Generated arithmetic (tasks/sources/arith.py) and the `final_number` reward (tasks/rewards/scorer.py)."""
from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest

from laminar_hpc.tasks.sources.build import build_task
from laminar_hpc.tasks.sources.arith import HELD_OUT_OFFSET, ArithTasks, evaluate
from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.config import config_from_dict
from laminar_hpc.config.reward_specs import BUILTIN_REWARDS
from laminar_hpc.tasks.rewards.scorer import Scorer, build_reward, final_number, last_number

QUESTION = re.compile(r"What is (\d+(?: [-+*] \d+)+)\? Answer with just the number\.")


def _expr(problem: Problem) -> str:
    m = QUESTION.fullmatch(problem.prompt)
    assert m, f"prompt {problem.prompt!r} is not a question of the expected form"
    return m.group(1)


@pytest.mark.parametrize("ops,operands", [(["+"], 2), (["+", "-"], 2), (["*"], 2), (["+", "-", "*"], 3),
                                         (["-"], 4)])
def test_answers_are_the_value_of_the_expression(ops, operands):
    src = ArithTasks(seed=4, ops=ops, operands=operands, max_value=12)
    for i in range(300):
        p = src.problem(i)
        expr = _expr(p)
        numbers = [int(n) for n in re.findall(r"\d+", expr)]
        assert len(numbers) == operands and all(0 <= n <= 12 for n in numbers), p
        assert set(re.findall(r"[-+*]", expr)) <= set(ops), p
        # Python's own precedence as the independent computation
        assert int(p.answer) == eval(expr, {"__builtins__": {}}) >= 0, p  # noqa: S307 - digits and + - * only
        assert p.chat and p.system is None and p.index == i


def test_every_operator_and_operand_value_occurs():
    src = ArithTasks(seed=0, ops=["+", "-", "*"], operands=2, max_value=5)
    exprs = [_expr(src.problem(i)) for i in range(600)]
    ops = Counter(re.findall(r"[-+*]", " ".join(exprs)))
    assert set(ops) == {"+", "-", "*"} and min(ops.values()) > 120, ops
    assert {int(n) for e in exprs for n in re.findall(r"\d+", e)} == set(range(6))


def test_same_seed_and_index_give_the_same_problem_and_seeds_differ():
    a, b = ArithTasks(seed=3), ArithTasks(seed=3)
    assert [a.problem(i) for i in range(50)] == [b.problem(i) for i in reversed(range(50))][::-1]
    other = ArithTasks(seed=4)
    assert sum(a.problem(i) != other.problem(i) for i in range(50)) > 40


def test_held_out_problems_come_from_indices_training_never_reaches():
    src = ArithTasks(seed=0)
    p = src.held_out(5)
    assert p.index == HELD_OUT_OFFSET + 5 and p == src.problem(HELD_OUT_OFFSET + 5)
    assert HELD_OUT_OFFSET > 10**12  # a run draws one index per prompt: never that many


def test_instruction_and_system_prompt_and_plain_prompts():
    src = ArithTasks(seed=1, instruction="", system_prompt="You are a calculator.", chat=True)
    p = src.problem(0)
    assert re.fullmatch(r"What is \d+ [-+] \d+\?", p.prompt) and p.system == "You are a calculator."
    plain = ArithTasks(seed=1, chat=False).problem(0)
    assert not plain.chat and plain.prompt.endswith("Answer with just the number.")


def test_evaluate_follows_precedence_and_checks_its_input():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([10, 2, 3], ["-", "-"]) == 5
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    with pytest.raises(ValueError, match="operators"):
        evaluate([1, 2], [])
    with pytest.raises(ValueError, match="'/'"):
        evaluate([1, 2], ["/"])


@pytest.mark.parametrize("kwargs,field", [({"ops": ["/"]}, "task.ops"), ({"ops": []}, "task.ops"),
                                          ({"operands": 1}, "task.operands"), ({"max_value": 0}, "task.max_value")])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        ArithTasks(seed=0, **kwargs)


@pytest.mark.parametrize("response,reward", [
    ("19", 1.0), ("19.", 1.0), ("7 + 12 = 19", 1.0), ("The answer is 19.0", 1.0), ("19\n", 1.0),
    ("The answer is 18.", 0.0), ("19 + 1 = 20", 0.0), ("", 0.0), ("nineteen", 0.0), ("-19", 0.0), ("119", 0.0),
])
def test_final_number_rewards_the_last_number(response, reward):
    assert final_number(Problem(0, "q", "19"), Response(response)) == reward


def test_final_number_reads_signs_decimals_and_thousands():
    assert last_number("it is -4") == -4 and last_number("1,024 apples") == 1024
    assert last_number("0.5 or 2.25") == last_number("2.250") and last_number("no digits") is None
    assert final_number(Problem(0, "q", "-4"), Response("10 - 14 = -4")) == 1.0
    with pytest.raises(ValueError, match="problem 3"):  # a task bug says which problem
        final_number(Problem(3, "q", "four"), Response("4"))


def test_final_number_is_a_named_reward_and_the_task_uses_it():
    assert build_reward("final_number") is final_number and "final_number" in BUILTIN_REWARDS
    cfg = config_from_dict({"task": {"type": "arith", "chat_template": False}})
    assert cfg.task.reward.fn == "final_number"  # the arithmetic task's default reward
    scorer = Scorer(cfg.task.reward)
    p = ArithTasks(seed=2).problem(0)
    assert scorer.score(p, Response(f"{_expr(p)} = {p.answer}")).reward == 1.0
    assert scorer.score(p, Response(f"{_expr(p)} = {int(p.answer) + 1}")).reward == 0.0


def test_build_task_arith_section():
    cfg = SimpleNamespace(type="arith", ops=["+", "*"], operands=3, max_value=7, instruction="Just the number.",
                          system_prompt="Be brief.", chat_template=True)
    src = build_task(cfg, seed=9)
    ref = ArithTasks(9, ops=["+", "*"], operands=3, max_value=7, instruction="Just the number.",
                     system_prompt="Be brief.")
    assert isinstance(src, ArithTasks)
    assert [src.problem(i) for i in range(20)] == [ref.problem(i) for i in range(20)]
    assert src.problem(0).system == "Be brief." and src.problem(0).prompt.endswith("? Just the number.")


def test_arith_config_section_when_the_schema_has_it():
    from laminar_hpc.config import config_from_dict
    # the character tokenizer has no chat template: plain prompts
    cfg = config_from_dict({"task": {"type": "arith", "ops": ["+", "-"], "max_value": 10, "chat_template": False}})
    src = build_task(cfg.task, seed=0)
    ref = ArithTasks(0, ops=["+", "-"], max_value=10, chat=False)
    assert isinstance(src, ArithTasks) and [src.problem(i) for i in range(5)] == [ref.problem(i) for i in range(5)]
