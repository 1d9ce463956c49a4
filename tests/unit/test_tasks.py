"""Task sources: built-in generated tasks, GSM8K through the dataset loader, build_task (the loader's
own cases: test_dataset.py)."""
from __future__ import annotations

import json
import math
import os
import re
from collections import Counter

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.tasks.sources.build import build_task
from laminar_hpc.tasks.sources.builtin import KINDS, BuiltinTasks
from laminar_hpc.tasks.problem import Response
from laminar_hpc.tasks.sources.dataset import DatasetError, DatasetTasks
from laminar_hpc.tasks.rewards.scorer import Scorer

from helpers import SHARED_GSM8K

ALL_KINDS = ["reverse", "sort", "add", "repeat"]


# ------------------------------------------------------------------------------------------
# built-in tasks
# ------------------------------------------------------------------------------------------

def _expected_answer(prompt: str) -> tuple[str, str]:
    """(kind, answer) recomputed from the prompt text alone."""
    m = re.fullmatch(r"rev:(\d+)=", prompt)
    if m:
        return "reverse", m.group(1)[::-1]
    m = re.fullmatch(r"srt:(\d+)=", prompt)
    if m:
        return "sort", "".join(sorted(m.group(1)))
    m = re.fullmatch(r"add:(\d+)\+(\d+)=", prompt)
    if m:
        return "add", str(int(m.group(1)) + int(m.group(2)))
    m = re.fullmatch(r"rep(\d+):(\d+)=", prompt)
    if m:
        return "repeat", m.group(2) * int(m.group(1))
    raise AssertionError(f"prompt {prompt!r} matches no known task format")


def test_builtin_same_seed_and_index_give_the_same_problem():
    a = BuiltinTasks(ALL_KINDS, seed=3, min_len=2, max_len=10, tail_alpha=1.0)
    b = BuiltinTasks(ALL_KINDS, seed=3, min_len=2, max_len=10, tail_alpha=1.0)
    for i in [0, 1, 7, 123, 10**9]:
        assert a.problem(i) == b.problem(i)
        assert a.problem(i) == a.problem(i)  # no hidden state advanced by a call
        assert a.problem(i).index == i
    # order of calls does not matter either
    forward = [a.problem(i) for i in range(20)]
    backward = [b.problem(i) for i in reversed(range(20))][::-1]
    assert forward == backward


def test_builtin_different_seeds_differ():
    a = BuiltinTasks(ALL_KINDS, seed=0, min_len=2, max_len=10, tail_alpha=1.0)
    b = BuiltinTasks(ALL_KINDS, seed=1, min_len=2, max_len=10, tail_alpha=1.0)
    pa = [a.problem(i).prompt for i in range(100)]
    pb = [b.problem(i).prompt for i in range(100)]
    assert pa != pb
    # not merely one coincidental difference: most prompts differ
    assert sum(x != y for x, y in zip(pa, pb)) > 50
    # and within one seed, different indices give different problems
    assert len(set(pa)) > 50


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_builtin_answers_are_correct_for_each_kind(kind):
    src = BuiltinTasks([kind], seed=11, min_len=1, max_len=12, tail_alpha=0.5)
    for i in range(300):
        p = src.problem(i)
        got_kind, answer = _expected_answer(p.prompt)
        assert got_kind == kind, p
        assert p.answer == answer, p
        assert p.answer.isdigit()


def test_builtin_mixed_kinds_cover_all_and_follow_weights():
    src = BuiltinTasks(ALL_KINDS, seed=5, min_len=2, max_len=8, tail_alpha=1.0, weights=[1, 1, 1, 1])
    kinds = Counter(_expected_answer(src.problem(i).prompt)[0] for i in range(800))
    assert set(kinds) == set(ALL_KINDS)
    for k in ALL_KINDS:  # ~200 each
        assert 120 < kinds[k] < 280, kinds
    heavy = BuiltinTasks(["reverse", "sort"], seed=5, min_len=2, max_len=8, tail_alpha=1.0, weights=[9, 1])
    kinds = Counter(_expected_answer(heavy.problem(i).prompt)[0] for i in range(1000))
    assert kinds["reverse"] > 4 * kinds["sort"] > 0


@pytest.mark.parametrize("min_len,max_len", [(2, 12), (1, 5), (4, 4)])
def test_builtin_answer_lengths_within_bounds(min_len, max_len):
    for kind in ALL_KINDS:
        src = BuiltinTasks([kind], seed=2, min_len=min_len, max_len=max_len, tail_alpha=1.0)
        for i in range(300):
            p = src.problem(i)
            n = len(p.answer)
            if kind in ("reverse", "sort"):
                # the answer is a permutation of the digit string of length in [min, max]
                assert min_len <= n <= max_len, (kind, p)
            elif kind == "add":
                # two operands share the digit budget: the sum has at most ceil(max/2)+1 digits
                assert 1 <= n <= math.ceil(max_len / 2) + 1, (kind, p)
            else:  # repeat: reps (2 or 3) copies of a chunk of at least one digit
                assert 2 <= n <= max(max_len, 3), (kind, p)


def test_builtin_length_distribution_is_long_tailed():
    min_len, max_len, alpha = 2, 12, 1.5
    src = BuiltinTasks(["reverse"], seed=0, min_len=min_len, max_len=max_len, tail_alpha=alpha)
    n = 4000
    counts = Counter(len(src.problem(i).answer) for i in range(n))
    # every length in range shows up eventually
    assert set(counts) <= set(range(min_len, max_len + 1))
    assert counts[min_len] > 0 and counts[max_len] > 0
    # power law P(len) ~ len^-alpha: the shortest is (12/2)^1.5 ~ 14.7x as likely as the longest
    assert counts[min_len] > 5 * counts[max_len]
    # short answers dominate: frequencies decrease along the lengths (checked in coarse bins)
    short = sum(counts[k] for k in range(2, 5))
    mid = sum(counts[k] for k in range(5, 9))
    long = sum(counts[k] for k in range(9, 13))
    assert short > mid > long
    # frequency of the shortest length matches the analytic power law within sampling error
    z = sum(k ** -alpha for k in range(min_len, max_len + 1))
    p_min = min_len ** -alpha / z
    sd = math.sqrt(p_min * (1 - p_min) / n)
    assert abs(counts[min_len] / n - p_min) < 5 * sd


def test_builtin_tail_alpha_zero_is_not_long_tailed():
    """Control for the test above: alpha=0 gives uniform lengths."""
    src = BuiltinTasks(["reverse"], seed=0, min_len=2, max_len=12, tail_alpha=0.0)
    counts = Counter(len(src.problem(i).answer) for i in range(3000))
    assert counts[12] > 0.5 * counts[2]


def test_builtin_tasks_are_scored_by_exact_match_with_whitespace():
    src = BuiltinTasks(ALL_KINDS, seed=9, min_len=2, max_len=8, tail_alpha=1.0)
    scorer = Scorer(config_from_dict({}).task.reward)  # the built-in tasks' default reward

    def reward(text, p):
        return scorer.score(p, Response(text)).reward
    for i in range(40):
        p = src.problem(i)
        assert reward(p.answer, p) == 1.0
        assert reward(f"  {p.answer}\n", p) == 1.0
        assert reward(f"\t{p.answer} ", p) == 1.0
        assert reward(p.answer + "0", p) == 0.0
        assert reward(p.answer[:-1], p) == 0.0
        assert reward("", p) == 0.0
        assert reward(f"{p.answer[0]} {p.answer[1:]}", p) == (1.0 if len(p.answer) == 1 else 0.0)
        wrong = str((int(p.answer) + 1))
        assert reward(wrong, p) == 0.0


@pytest.mark.parametrize("kinds", [["nope"], ["reverse", "multiply"], []])
def test_builtin_unknown_kind_raises(kinds):
    with pytest.raises(ValueError) as err:
        BuiltinTasks(kinds, seed=0, min_len=2, max_len=8, tail_alpha=1.0)
    for k in KINDS:  # the message lists the allowed kinds
        assert k in str(err.value)


def test_builtin_weights_length_mismatch_raises():
    with pytest.raises(ValueError, match="weights"):
        BuiltinTasks(["reverse", "add"], seed=0, min_len=2, max_len=8, tail_alpha=1.0, weights=[1.0])


# ------------------------------------------------------------------------------------------
# GSM8K (real data)
# ------------------------------------------------------------------------------------------

def _gsm8k(split: str) -> str:
    path = os.path.join(SHARED_GSM8K, f"{split}.jsonl")
    if not os.path.isfile(path):
        pytest.skip(f"GSM8K {split} split not found at {os.path.abspath(path)} (shared data not present)")
    return path


def _gold_from_raw(answer: str) -> str:
    return answer.split("#### ")[-1].strip().replace(",", "")


@pytest.mark.parametrize("split,rows", [("train", 7473), ("test", 1319)])
def test_gsm8k_loads_all_rows(split, rows):
    path = _gsm8k(split)
    src = DatasetTasks(path, shuffle=False)
    assert len(src) == rows
    assert src.skipped == 0
    assert src.name == f"dataset:{split}.jsonl"
    with open(path, encoding="utf-8") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert len(raw) == rows
    # unshuffled, problems follow the file order and the prompt template; indices wrap around epochs
    for i in (0, 1, rows - 1):
        p = src.problem(i)
        assert p.prompt == f"{raw[i]['question']}\nAnswer: "
        assert p.answer == _gold_from_raw(raw[i]["answer"])
        assert src.where(i) == f"{path} line {i + 1}"
    assert src.problem(rows).prompt == src.problem(0).prompt
    assert src.problem(rows).index == rows
    # shuffled (the default), every row once per epoch
    shuffled = DatasetTasks(path, seed=0)
    assert sorted(shuffled.problem(i).answer for i in range(rows)) == sorted(_gold_from_raw(r["answer"]) for r in raw)


# ------------------------------------------------------------------------------------------
# malformed datasets (more in test_dataset.py)
# ------------------------------------------------------------------------------------------

def _row(q: str, a: str) -> str:
    return json.dumps({"question": q, "answer": a}) + "\n"


GOOD = [_row("1+1?", "it is 2\n#### 2"), _row("2+3?", "five\n#### 5"), _row("10*10?", "#### 1,000")]


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(DatasetError) as err:
        DatasetTasks(str(missing))
    assert str(missing) in str(err.value)


BAD_ROWS = {
    "not_json": "{this is not json\n",
    "not_object": "[1, 2, 3]\n",
    "missing_answer": json.dumps({"question": "q?"}) + "\n",
    "non_string_answer": json.dumps({"question": "q?", "answer": [4]}) + "\n",
    "number_answer_without_hashes": json.dumps({"question": "q?", "answer": 4}) + "\n",  # answer_format: gsm8k
    "missing_question": json.dumps({"answer": "#### 4"}) + "\n",
    "no_hashes": _row("q?", "the answer is 4"),
}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_bad_row_fail_names_file_and_line(tmp_path, kind):
    path = tmp_path / f"{kind}.jsonl"
    # line 1, 2 good, line 3 blank (still a physical line), line 4 bad, line 5 good
    path.write_text(GOOD[0] + GOOD[1] + "\n" + BAD_ROWS[kind] + GOOD[2], encoding="utf-8")
    with pytest.raises(DatasetError) as err:
        DatasetTasks(str(path), on_bad_row="fail")
    msg = str(err.value)
    assert str(path) in msg
    assert re.search(r"\bline 4\b", msg), msg
    assert "\n" not in msg


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_bad_row_skip_keeps_good_rows_and_counts(tmp_path, kind):
    path = tmp_path / f"{kind}.jsonl"
    path.write_text(BAD_ROWS[kind] + GOOD[0] + BAD_ROWS[kind] + GOOD[1] + GOOD[2] + BAD_ROWS[kind],
                    encoding="utf-8")
    src = DatasetTasks(str(path), on_bad_row="skip", shuffle=False)
    assert src.skipped == 3
    assert len(src) == 3
    assert [src.problem(i).answer for i in range(3)] == ["2", "5", "1000"]
    assert [src.problem(i).prompt for i in range(3)] == ["1+1?\nAnswer: ", "2+3?\nAnswer: ", "10*10?\nAnswer: "]


def test_all_rows_bad_errors_even_with_skip(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(BAD_ROWS.values()), encoding="utf-8")
    with pytest.raises(DatasetError) as err:
        DatasetTasks(str(path), on_bad_row="skip")
    assert str(path) in str(err.value)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_errors(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DatasetError) as err:
        DatasetTasks(str(path))
    assert str(path) in str(err.value)


def test_non_utf8_file_errors(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD[0].encode() + b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DatasetError) as err:
        DatasetTasks(str(path))
    assert str(path) in str(err.value)


def test_plain_format_and_custom_fields(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"q": "capital of France?", "a": " Paris "}) + "\n", encoding="utf-8")
    src = DatasetTasks(str(path), prompt_field="q", answer_field="a", answer_format="plain",
                       prompt_template="Q: {prompt}\nA:")
    p = src.problem(0)
    assert p.prompt == "Q: capital of France?\nA:"
    assert p.answer == "Paris"


# ------------------------------------------------------------------------------------------
# build_task from a config
# ------------------------------------------------------------------------------------------

def test_build_task_builtin_from_config():
    cfg = config_from_dict({"task": {"type": "builtin", "kinds": ["add", "sort"], "weights": [1.0, 3.0],
                                     "min_len": 3, "max_len": 9, "tail_alpha": 0.7}})
    src = build_task(cfg.task, seed=42)
    assert isinstance(src, BuiltinTasks)
    ref = BuiltinTasks(["add", "sort"], 42, 3, 9, 0.7, [1.0, 3.0])
    for i in range(50):
        assert src.problem(i) == ref.problem(i)
        assert _expected_answer(src.problem(i).prompt)[0] in ("add", "sort")
    other = build_task(cfg.task, seed=43)
    assert [other.problem(i) for i in range(30)] != [src.problem(i) for i in range(30)]


@pytest.mark.parametrize("task_type", ["dataset", "jsonl"])
def test_build_task_dataset_from_config(tmp_path, task_type):
    path = tmp_path / "d.jsonl"
    path.write_text("oops\n" + "".join(GOOD), encoding="utf-8")
    cfg = config_from_dict({"task": {"type": task_type, "path": str(path), "on_bad_row": "skip",
                                     "prompt_template": ">> {prompt}"}})
    src = build_task(cfg.task, seed=0)
    assert isinstance(src, DatasetTasks)
    assert len(src) == 3 and src.skipped == 1
    assert [src.problem(i) for i in range(6)] == [DatasetTasks.from_config(cfg.task, 0).problem(i) for i in range(6)]
    assert sorted((src.problem(i).prompt, src.problem(i).answer) for i in range(3)) == [
        (">> 1+1?", "2"), (">> 10*10?", "1000"), (">> 2+3?", "5")]

    cfg_fail = config_from_dict({"task": {"type": task_type, "path": str(path)}})
    with pytest.raises(DatasetError, match="line 1"):
        build_task(cfg_fail.task, seed=0)
