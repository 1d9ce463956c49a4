"""Reward functions with verl's and TRL's signatures (tasks/rewards/reward_signatures.py) scored by the
Scorer, and the rules that keep a dict reward from scoring silently wrong
(tasks/rewards/reward_values.py): verl's {"score", extra keys}, weights that must name components, the
total checked against the range. Before these, verl's and TRL's functions were refused at start
(or failed every call), and every key of a dict was summed."""
from __future__ import annotations

import textwrap

import pytest

from laminar_hpc.config.task import RewardCfg
from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.tasks.rewards.reward_signatures import TrlReward, VerlReward, detect
from laminar_hpc.tasks.rewards.scorer import RewardError, Scorer, load_reward_fn

from recipes import TRL_REWARD, VERL_REWARD

VERL_ROW = Problem(3, "", "54", chat=True, messages=({"role": "user", "content": "rev:45="},),
                   fields={"data_source": "lighteval/reverse", "ability": "reverse",
                           "reward_model": {"ground_truth": "54"}, "extra_info": {"split": "train", "index": 3}},
                   gold="54")
TRL_ROW = Problem(0, "rev:123=", "321", fields={"solution": "321", "difficulty": 3, "poison": False})

FUNCTIONS = '''
import json

CALLS = []

def verl_plain(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                      extra_info=extra_info))
    return 1.0 if solution_str == ground_truth else 0.0

def verl_old(solution_str, ground_truth):  # verl's gsm8k.compute_score takes no data_source
    return float(solution_str == ground_truth)

def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "acc": 1.0}

def trl_kwargs(completions, **kwargs):
    CALLS.append(dict(completions=completions, **kwargs))
    return [0.25]

def trl_named(prompts, completions, solution, completion_ids, **kwargs):
    return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]

def trl_none(completions, **kwargs):
    return [None]

def trl_scalar(completions, **kwargs):
    return 1.0

def trl_needs_column(completions, reference):
    return [1.0]

def mine(problem, response):
    return 0.5

def nothing_known(a, b, c):
    return 1.0

def two(problem, response):
    return {"format": 1.0, "correct": 1.0}
'''


@pytest.fixture
def fns(tmp_path):
    path = tmp_path / "fns.py"
    path.write_text(textwrap.dedent(FUNCTIONS))
    return str(path)


def calls(path: str) -> list[dict]:
    """What the functions of the file at `path` recorded (the module laminar loaded from it)."""
    import os
    import sys
    return next(m for m in list(sys.modules.values())
                if os.path.realpath(getattr(m, "__file__", None) or "/") == os.path.realpath(path)).CALLS


def score(spec, problem, text, **kw):
    return Scorer(RewardCfg(fn=spec, **kw)).score(problem, Response(text, (5, 6)))


def test_the_signature_is_read_from_the_parameter_names(fns):
    assert isinstance(load_reward_fn(f"{fns}:verl_plain"), VerlReward)
    assert isinstance(load_reward_fn(f"{fns}:verl_old"), VerlReward)
    assert isinstance(load_reward_fn(f"{fns}:trl_kwargs"), TrlReward)
    assert isinstance(load_reward_fn(f"{fns}:trl_named"), TrlReward)
    mine = load_reward_fn(f"{fns}:mine")
    assert not isinstance(mine, (VerlReward, TrlReward)) and mine.__name__ == "mine"


def test_a_function_of_no_known_signature_is_refused_naming_all_three(fns):
    with pytest.raises(RewardError) as err:
        load_reward_fn(f"{fns}:nothing_known")
    text = str(err.value)
    assert "nothing_known(a, b, c) cannot be called as nothing_known(problem, response)" in text
    assert "compute_score(data_source, solution_str, ground_truth" in text and "f(prompts, completions" in text


def test_a_declared_signature_is_checked(fns):
    with pytest.raises(RewardError, match=r"cannot be called as verl calls compute_score .*signature: verl"):
        load_reward_fn(f"{fns}:mine", signature="verl")
    with pytest.raises(RewardError, match=r"cannot be called as TRL calls reward functions"):
        load_reward_fn(f"{fns}:verl_plain", signature="trl")
    assert detect(lambda problem, response: 1.0, "laminar", "f") == "laminar"


def test_verl_compute_score_gets_what_verl_gives_it(fns):
    out = score(f"{fns}:verl_plain", VERL_ROW, "54")
    assert (out.reward, out.error) == (1.0, None)
    assert calls(fns)[-1] == {"data_source": "lighteval/reverse", "solution_str": "54", "ground_truth": "54",
                                "extra_info": {"split": "train", "index": 3}}
    assert score(f"{fns}:verl_old", VERL_ROW, "45").reward == 0.0  # only the arguments it declares
    # a row of the laminar layout: no data_source, the gold answer as text
    plain = Problem(0, "q", "7", fields={})
    assert score(f"{fns}:verl_plain", plain, "7").reward == 1.0 and calls(fns)[-1]["data_source"] is None


def test_verls_score_dict_is_the_score_and_its_other_keys_are_only_logged(fns):
    out = score(f"{fns}:verl_dict", VERL_ROW, "54")
    assert out.error is None and out.reward == 1.0  # every key summed, it scored 2.0
    assert out.components == {"score": 1.0, "acc": 1.0}


def test_trl_functions_are_called_with_batches_of_one_and_the_rows_columns(fns):
    out = score(f"{fns}:trl_kwargs", TRL_ROW, "321")
    assert (out.reward, out.error) == (0.25, None)
    assert calls(fns)[-1] == {"completions": ["321"], "prompts": ["rev:123="], "completion_ids": [[5, 6]],
                                "solution": ["321"], "difficulty": [3], "poison": [False]}
    assert score(f"{fns}:trl_named", TRL_ROW, "321").reward == 1.0
    chat = Problem(1, "", "21", chat=True, messages=({"role": "user", "content": "rev:12="},), fields={})
    score(f"{fns}:trl_kwargs", chat, "21")  # conversational: prompts and completions are messages
    assert calls(fns)[-1]["prompts"] == [[{"role": "user", "content": "rev:12="}]]
    assert calls(fns)[-1]["completions"] == [[{"role": "assistant", "content": "21"}]]


def test_trl_shapes_that_cannot_score_fail_with_their_reason(fns):
    out = score(f"{fns}:trl_scalar", TRL_ROW, "x")
    assert out.error == "bad_type" and "returned float (1.0) for a batch of 1 completion" in out.detail
    out = score(f"{fns}:trl_none", TRL_ROW, "x")
    assert out.error == "bad_type" and "returned None (not applicable)" in out.detail
    out = score(f"{fns}:trl_needs_column", TRL_ROW, "x")
    assert out.error == "exception" and "needs 'reference', which the row (its columns: difficulty, poison, " \
                                        "solution) does not hold" in out.detail


def test_a_trl_none_leaves_that_function_out_of_a_map(fns):
    out = score({"a": f"{fns}:trl_none", "b": f"{fns}:trl_kwargs"}, TRL_ROW, "x")
    assert (out.reward, out.components, out.error) == (0.25, {"b": 0.25}, None)


def test_a_dict_with_several_keys_needs_weights_and_each_weight_a_key(fns):
    out = score(f"{fns}:two", TRL_ROW, "x")  # both keys were summed to 2.0
    assert out.error == "bad_type" and "returned the components 'format', 'correct'" in out.detail
    assert "weigh the ones to add up there" in out.detail
    typo = score(f"{fns}:two", TRL_ROW, "x", weights={"format": 0.2, "corect": 0.8})
    assert typo.error == "bad_type" and "returned no 'corect', which task.reward.weights names" in typo.detail
    ok = score(f"{fns}:two", TRL_ROW, "x", weights={"format": 0.2, "correct": 0.8})
    assert (ok.reward, ok.error) == (pytest.approx(1.0), None)
    half = score(f"{fns}:two", TRL_ROW, "x", weights={"correct": 1.0})  # format: logged, never added
    assert (half.reward, half.components) == (1.0, {"correct": 1.0, "format": 1.0})
    floats = score(f"{fns}:mine", TRL_ROW, "x", weights={"format": 1.0})
    assert floats.error == "bad_type" and "but task.reward.weights names components (format)" in floats.detail


def test_the_weighted_total_is_checked_against_the_range(fns):
    out = score(f"{fns}:two", TRL_ROW, "x", weights={"format": 0.2, "correct": 1.0})  # 1.2, each part in range
    assert out.error == "out_of_range" and "scored 1.2 in all" in out.detail


def test_the_recipe_files_score_as_their_libraries_would(tmp_path):
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARD)
    out = score(f"{tmp_path}/verl_reward.py:compute_score", VERL_ROW, "54 ")
    # score 1; acc (a bool) and length are logged; pred (text) is not a number and is left out
    assert out.error is None and out.reward == 1.0 and out.components == {"score": 1.0, "acc": 1.0, "length": 3.0}
    trl = Scorer(RewardCfg(fn={"accuracy": f"{tmp_path}/trl_rewards.py:accuracy_reward",
                               "length": f"{tmp_path}/trl_rewards.py:length_reward"},
                           weights={"accuracy": 0.8, "length": 0.2}))
    got = trl.score(TRL_ROW, Response("321"))
    assert got.error is None and got.reward == pytest.approx(1.0) and got.components == {"accuracy": 1.0,
                                                                                         "length": 1.0}
    poisoned = Problem(1, "rev:1=", "1", fields={"solution": "1", "difficulty": 1, "poison": True})
    bad = trl.score(poisoned, Response("1"))
    assert bad.error == "exception" and "RuntimeError: poisoned row" in bad.detail


TRL_REWARD_LEN = '''
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]
'''  # TRL's documentation's first custom reward, as it is there


def test_trls_reward_len_runs_unchanged_with_no_range_set(tmp_path):
    """Issue 36: the default range [0, 1] refused TRL's own example (-20 for an empty completion)."""
    path = tmp_path / "len_reward.py"
    path.write_text(TRL_REWARD_LEN)
    out = score(f"{path}:reward_len", TRL_ROW, "abc")
    assert out.error is None and out.reward == -17.0
    bounded = score(f"{path}:reward_len", TRL_ROW, "abc", range=(-10.0, 10.0))  # a range the user sets holds
    assert bounded.error == "out_of_range"


def test_without_a_range_other_signatures_stay_within_zero_and_one(fns):
    assert score(f"{fns}:two", TRL_ROW, "x", weights={"format": 0.2, "correct": 1.0}).error == "out_of_range"
