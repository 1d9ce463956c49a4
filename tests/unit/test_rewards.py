"""Reward functions (tasks/rewards/scorer.py): the built-ins with the (problem, response) signature, loading
the user's `task.reward` from a module or a file, and the Scorer's components, weights, range and
error codes. The pool's timeouts: tests/integration/test_reward_pool.py; the remote verifier:
tests/integration/test_remote_reward.py."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import zlib

import pytest

from laminar_hpc.config.task import RewardCfg
from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.tasks.sources.builtin import BuiltinTasks
from laminar_hpc.config.reward_specs import BUILTIN_REWARDS
from laminar_hpc.tasks.rewards.scorer import (REASONS, RewardError, RewardOutcome, Scorer,
                                       build_reward, coin_flip, exact, final_number, judge, load_reward_fn,
                                       math_verify)

from helpers import REPO, SHARED_GSM8K

P = Problem(0, "What is 12 + 7?", "19")


def r(text: str) -> Response:
    return Response(text)


# ------------------------------------------------------------------------------------------
# built-ins
# ------------------------------------------------------------------------------------------

def test_exact_matches_the_stripped_answer():
    src = BuiltinTasks(["reverse", "sort", "add", "repeat"], seed=9, min_len=2, max_len=8, tail_alpha=1.0)
    for i in range(40):
        p = src.problem(i)
        assert exact(p, r(p.answer)) == 1.0
        assert exact(p, r(f"  {p.answer}\n")) == 1.0 and exact(p, r(f"\t{p.answer} ")) == 1.0
        assert exact(p, r(p.answer + "0")) == 0.0 and exact(p, r(p.answer[:-1])) == 0.0
        assert exact(p, r("")) == 0.0
        assert exact(p, r(f"{p.answer[0]} {p.answer[1:]}")) == (1.0 if len(p.answer) == 1 else 0.0)
        assert exact(p, r(str(int(p.answer) + 1))) == 0.0


def test_math_verify_reads_the_last_gsm8k_answer_and_equal_forms():
    p = Problem(0, "q", "72")
    assert math_verify(p, r("72")) == 1.0 and math_verify(p, r("The total is 72.0")) == 1.0
    assert math_verify(p, r("Step by step...\n#### 72")) == 1.0
    assert math_verify(p, r("#### 72\nno wait\n#### 73")) == 0.0  # the last '####' is the final answer
    assert math_verify(p, r("73")) == 0.0 and math_verify(p, r("I do not know")) == 0.0
    assert math_verify(Problem(1, "q", "0.5"), r("$\\frac{1}{2}$")) == 1.0


def test_math_verify_works_off_the_main_thread():
    """math-verify's own timeouts use SIGALRM, which a pool thread may not set: the old reward
    turned that ValueError into a silent 0 for every response scored in a thread."""
    got = []
    t = threading.Thread(target=lambda: got.append(math_verify(Problem(0, "q", "72"), r("#### 72"))))
    t.start()
    t.join(60)
    assert got == [1.0]


def test_math_verify_on_gsm8k_gold_and_wrong_answers():
    path = SHARED_GSM8K / "train.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K not found at {path} (shared data not present)")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(next(f)) for _ in range(30)]
    for i, row in enumerate(rows):
        gold = row["answer"].split("#### ")[-1].strip().replace(",", "")
        p = Problem(i, row["question"], gold)
        assert math_verify(p, r(gold)) == 1.0, (i, gold)
        assert math_verify(p, r(row["answer"])) == 1.0, (i, gold)  # the dataset's own solution text
        wrong = str(int(gold) + 1) if re.fullmatch(r"-?\d+", gold) else str(float(gold) + 1)
        assert math_verify(p, r(wrong)) == 0.0 and math_verify(p, r(f"Working...\n#### {wrong}")) == 0.0, (i, gold)


def test_final_number_and_its_task_bug():
    assert final_number(P, r("12 + 7 = 19")) == 1.0 and final_number(P, r("19 + 1 = 20")) == 0.0
    with pytest.raises(ValueError, match="problem 3"):
        final_number(Problem(3, "q", "four"), r("4"))


def test_coin_flip_is_the_synthetic_tasks_crc32_of_the_text():
    texts = [f"response {i}" for i in range(50)]
    assert [coin_flip(P, r(t)) for t in texts] == [float(zlib.crc32(t.encode()) % 2) for t in texts]
    assert {coin_flip(P, r(t)) for t in texts} == {0.0, 1.0}


def test_builtin_names_load_their_functions_from_the_config_list():
    functions = {"exact": exact, "math_verify": math_verify, "final_number": final_number, "coin_flip": coin_flip,
                 "judge": judge}
    assert list(BUILTIN_REWARDS) == list(functions)
    for name, fn in functions.items():
        assert load_reward_fn(name) is fn and build_reward(name) is fn


# ------------------------------------------------------------------------------------------
# loading the user's function
# ------------------------------------------------------------------------------------------

def _write(path, code: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


def test_load_from_a_package_module(tmp_path, monkeypatch):
    _write(tmp_path / "myrewards" / "__init__.py", "")
    _write(tmp_path / "myrewards" / "scoring.py", """
        def score(problem, response):
            return 1.0 if response.text == problem.answer else 0.25
        class Grader:
            @staticmethod
            def grade(problem, response):
                return 0.5
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("myrewards.scoring:score")
    assert fn(P, r("19")) == 1.0 and fn(P, r("x")) == 0.25
    assert load_reward_fn("myrewards.scoring:Grader.grade")(P, r("")) == 0.5


def test_load_from_a_file_relative_to_the_working_directory(tmp_path, monkeypatch):
    # a directory that is not a package, and a dataclass (needs its module in sys.modules)
    _write(tmp_path / "examples" / "task" / "reward.py", """
        from dataclasses import dataclass
        @dataclass
        class Parts:
            correct: float
        def score(problem, response):
            return {"correct": Parts(float(response.text.strip() == problem.answer)).correct}
    """)
    monkeypatch.chdir(tmp_path)
    fn = load_reward_fn("examples/task/reward.py:score")
    assert fn(P, r(" 19")) == {"correct": 1.0}
    # base_dir: relative to a given directory instead; the same file is the same module
    assert load_reward_fn("task/reward.py:score", base_dir=tmp_path / "examples") is fn


def _message(spec: str, **kw) -> str:
    with pytest.raises(RewardError) as err:
        load_reward_fn(spec, **kw)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{kw.get('key', 'task.reward')} {spec!r}: "), text
    return text


def test_bad_specs_say_what_is_wrong_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "not found" in _message("missing/reward.py:score") and str(tmp_path) in _message("missing/reward.py:score")
    _write(tmp_path / "broken.py", "x = 1\ny = 1 / 0\n")
    assert re.search(r"importing .*broken\.py failed \(ZeroDivisionError: division by zero \(at broken\.py:2\)\)",
                     _message("broken.py:score"))
    _write(tmp_path / "syntax.py", "def score(problem, response)\n    return 1\n")
    assert re.search(r"SyntaxError.*line 1.*fix the file", _message("syntax.py:score"))
    _write(tmp_path / "ok.py", "limit = 3\ndef one(problem):\n    return 1.0\ndef score(problem, response):\n"
                               "    return 1.0\n")
    assert "ok.py defines no 'scor'; define def scor(problem, response)" in _message("ok.py:scor")
    assert "'limit' in ok.py is a int, not a function" in _message("ok.py:limit")
    assert "one(problem) cannot be called as one(problem, response)" in _message("ok.py:one")
    assert "module 'no_such_pkg.rewards' not found on the Python path" in _message("no_such_pkg.rewards:score")
    _write(tmp_path / "needs_dep.py", "import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "importing needs_dep failed (ModuleNotFoundError: No module named 'no_such_dependency'" in \
        _message("needs_dep:score")
    assert "not a reward; write 'package.module:function'" in _message("vibes")
    assert _message("ok.py:nope", key="task.reward.fn.format").startswith("task.reward.fn.format 'ok.py:nope'")
    with pytest.raises(ValueError, match="reward"):  # RewardError is a ValueError (callers catching those)
        build_reward("vibes")


# ------------------------------------------------------------------------------------------
# the Scorer
# ------------------------------------------------------------------------------------------

REWARD_FILE = """
    import math
    from laminar_hpc.tasks.rewards.scorer import RemoteError

    def score(problem, response):
        return VALUES[response.text]() if response.text in VALUES else 1.0

    def fmt(problem, response):
        return 1.0 if response.text.startswith("A:") else 0.0

    def parts(problem, response):
        return {"steps": 0.5, "style": 1.0}

    def boom():
        raise KeyError("no such step")

    def remote():
        raise RemoteError("remote verifier http://x: HTTP 500 (after 3 attempts)")

    VALUES = {"raise": boom, "remote": remote, "half": lambda: 0.5, "int": lambda: 1, "neg": lambda: -0.5,
              "str": lambda: "abc", "bool": lambda: True, "none": lambda: None, "list": lambda: [1.0],
              "nan": lambda: float("nan"), "inf": lambda: math.inf, "big": lambda: 5,
              "dict": lambda: {"format": 1.0, "correct": 0.5}, "empty": lambda: {},
              "dict_str": lambda: {"format": "yes"}, "dict_key": lambda: {1: 1.0}, "dict_big": lambda: {"a": 2.0},
              "exit": lambda: exec("raise SystemExit(3)")}
"""


@pytest.fixture
def reward_file(tmp_path):
    return str(_write(tmp_path / "my_rewards.py", REWARD_FILE))


def scorer(reward_file, fn="score", **kw) -> Scorer:
    spec = {k: f"{reward_file}:{v}" if v not in BUILTIN_REWARDS else v for k, v in fn.items()} if isinstance(fn, dict) \
        else f"{reward_file}:{fn}"
    return Scorer(RewardCfg(fn=spec, **kw))


def test_a_float_is_the_reward_and_a_dict_its_weighted_components(reward_file):
    s = scorer(reward_file, weights={"format": 0.2, "correct": 0.8})
    assert scorer(reward_file).score(P, r("half")) == RewardOutcome(0.5, {}, None)
    assert scorer(reward_file).score(P, r("int")) == RewardOutcome(1.0, {}, None)
    out = s.score(P, r("dict"))
    assert out.components == {"format": 1.0, "correct": 0.5} and out.reward == pytest.approx(0.2 + 0.8 * 0.5)
    assert out.error is None and out.detail == ""


def test_a_map_of_functions_names_the_components_and_flattens_dicts(reward_file):
    s = scorer(reward_file, {"format": "fmt", "correct": "exact", "quality": "parts"},
               weights={"format": 0.5, "quality.style": 0.3, "quality": 0.5}, range=(0.0, 2.0))
    out = s.score(P, r("A: 19"))
    assert out.components == {"format": 1.0, "correct": 0.0, "quality.steps": 0.5, "quality.style": 1.0}
    # quality's dict sums only quality.style (weighed 0.3); quality.steps is logged, never added;
    # the component quality weighs 0.5, format 0.5, correct 1 (no weight)
    assert out.reward == pytest.approx(0.5 * 1.0 + 0.0 + 0.5 * (0.3 * 1.0))
    assert scorer(reward_file, {"correct": "exact"}).score(P, r("19")) == RewardOutcome(1.0, {"correct": 1.0})
    with pytest.raises(RewardError, match=r"task.reward.weights names 'formt', not a component"):
        scorer(reward_file, {"format": "fmt"}, weights={"formt": 1.0})


def test_range_is_checked_on_the_total(reward_file):
    assert scorer(reward_file, range=(-1.0, 1.0)).score(P, r("neg")).reward == -0.5
    out = scorer(reward_file).score(P, r("neg"))
    assert (out.error, out.reward) == ("out_of_range", 0.0)
    assert "returned -0.5, outside task.reward.range [0, 1]" in out.detail
    # each component lies in [0, 1], their weighted total (1.0 * 1.0 + 0.5 * 0.5 = 1.25) does not
    out = scorer(reward_file, weights={"format": 1.0, "correct": 0.5}).score(P, r("dict"))
    assert (out.error, out.reward) == ("out_of_range", 0.0)
    assert "scored 1.25 in all (the weighted sum of its components), outside task.reward.range [0, 1]" in out.detail


@pytest.mark.parametrize("text,error,detail", [
    ("raise", "exception", "my_rewards.py:score raised KeyError: 'no such step' (at my_rewards.py:"),
    ("exit", "exception", "raised SystemExit: 3"),
    ("remote", "remote", "remote verifier http://x: HTTP 500 (after 3 attempts)"),
    ("nan", "not_finite", "returned nan; return a finite number"),
    ("inf", "not_finite", "returned inf"),
    ("big", "out_of_range", "returned 5, outside task.reward.range [0, 1]"),
    ("dict_big", "out_of_range", "returned 2, outside"),
    ("dict", "bad_type", "returned the components 'format', 'correct' and task.reward.weights names none of them"),
    ("str", "bad_type", "my_rewards.py:score returned str ('abc'); return a float or a dict of floats"),
    ("bool", "bad_type", "returned bool (True)"),
    ("none", "bad_type", "returned NoneType (None)"),
    ("list", "bad_type", "returned list ([1.0])"),
    ("empty", "bad_type", "returned an empty dict"),
    ("dict_str", "bad_type", "returned for 'format' str ('yes')"),
    ("dict_key", "bad_type", "returned a dict with key 1"),
])
def test_every_failure_scores_zero_with_its_reason(reward_file, text, error, detail):
    out = scorer(reward_file).score(P, r(text))
    assert (out.reward, out.components, out.error) == (0.0, {}, error)
    assert error in REASONS and detail in out.detail and "\n" not in out.detail, out.detail


def test_a_component_that_fails_fails_the_whole_reward(reward_file):
    s = scorer(reward_file, {"format": "fmt", "main": "score"})
    out = s.score(P, r("str"))
    assert out.error == "bad_type" and out.detail.startswith("component 'main' (") and out.components == {}


def test_bad_specs_fail_when_the_scorer_is_built(reward_file):
    with pytest.raises(RewardError, match=r"task.reward.fn.correct '.*my_rewards.py:nope'"):
        scorer(reward_file, {"format": "fmt", "correct": "nope"})


def test_tasks_import_neither_torch_nor_httpx():
    code = ("import sys, laminar_hpc.tasks.rewards.scorer, laminar_hpc.tasks.rewards.remote_verifier, "
            "laminar_hpc.tasks.rewards.reward_pool; "
            "print(sorted(m for m in ('torch', 'httpx', 'math_verify') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
