"""The controller's checks of what enters it (controller/validate.py), as pure functions: prompts
at admission, tokens / lengths / log-probs of what rollouts send, and where a trajectory belongs."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from helpers import REPO, trajectory

from laminar_hpc.config import load_config
from laminar_hpc.controller.validate import (Limits, as_int, limits_for, prompt_refusal, tokens_refusal,
                                             trajectory_refusal)

LIMITS = Limits(vocab_size=100, max_seq_len=10)


@dataclass
class Handed:
    """What the controller handed out under a trajectory id (a partial.Partial's fields)."""
    group_id: int = 0
    problem: int = 0
    prompt: tuple = (1, 2, 3)
    max_new_tokens: int = 6

    def __post_init__(self):
        self.prompt = list(self.prompt)


# -- prompts at admission ----------------------------------------------------------------------

def test_a_prompt_that_leaves_room_for_one_token_is_admitted():
    assert prompt_refusal(list(range(1, 10)), LIMITS) is None  # 9 + 1 new token = max_seq_len
    assert prompt_refusal([99], LIMITS) is None
    assert prompt_refusal([5] * 500, Limits(vocab_size=100)) is None  # no sequence limit (emulated engines)


@pytest.mark.parametrize("prompt,expect", [
    ([], "no tokens"),
    (list(range(1, 11)), "10 prompt tokens leave no room to generate within model.max_seq_len=10"),
    ([1, 100], "token id 100 outside the vocabulary [0, 100)"),
    ([-1, 2], "token id -1 outside the vocabulary"),
])
def test_a_prompt_that_cannot_be_generated_from_is_refused_with_why(prompt, expect):
    why = prompt_refusal(prompt, LIMITS)
    assert why is not None and expect in why and "\n" not in why


# -- tokens from rollouts ----------------------------------------------------------------------

def _tokens(tokens, logprobs=None, *, before=0, prompt_len=3, max_new=6, limits=LIMITS):
    lps = [-0.5] * len(tokens) if logprobs is None else logprobs
    return tokens_refusal(tokens, lps, limits, prompt_len=prompt_len, before=before, max_new_tokens=max_new)


def test_good_tokens_pass():
    assert _tokens([4, 5, 6]) is None
    assert _tokens([0, 99], [0.0, -1e30]) is None
    assert _tokens([4, 5, 6], before=3) is None  # 3 + 3 = max_new_tokens, prompt 3 + 6 <= 10
    assert _tokens([]) is None  # an empty chunk


@pytest.mark.parametrize("kw,expect", [
    (dict(tokens=[4, 5], logprobs=[-0.5]), "2 tokens but 1 log-probs"),
    (dict(tokens=[4, 100]), "response token id 100 outside the vocabulary"),
    (dict(tokens=[-3, 4]), "token id -3 outside"),
    (dict(tokens=[4, 5], logprobs=[-0.5, math.nan]), "not finite"),
    (dict(tokens=[4, 5], logprobs=[math.inf, -0.5]), "not finite"),
    (dict(tokens=[4, 5], logprobs=[-math.inf, -0.5]), "not finite"),
    (dict(tokens=[4], before=6), "7 response tokens exceed its max_new_tokens=6"),
    (dict(tokens=[4, 5], before=4, prompt_len=5), "prompt 5 + response 6 tokens exceed model.max_seq_len=10"),
])
def test_bad_tokens_are_refused_with_why(kw, expect):
    why = _tokens(kw.pop("tokens"), kw.pop("logprobs", None), **kw)
    assert why is not None and expect in why


# -- where a trajectory belongs ----------------------------------------------------------------

def _traj(**over):
    return trajectory(0, **{"tokens": (4, 5, 6), **over})


def test_a_trajectory_of_the_work_handed_out_passes():
    assert trajectory_refusal(_traj(), Handed(), LIMITS, finished=True) is None
    assert trajectory_refusal(_traj(finish="length"), Handed(), LIMITS, finished=True) is None
    assert trajectory_refusal(_traj(finish=None), Handed(), LIMITS, finished=True) is None


@pytest.mark.parametrize("over,expect", [
    (dict(group_id=1), "claims group 1 / problem 0, but was handed out for group 0 / problem 0"),
    (dict(problem=7), "claims group 0 / problem 7"),
    (dict(prompt=[1, 2, 4]), "its prompt is not the prompt it was handed out with"),
    (dict(version=-1), "weight version -1 is negative"),
    (dict(finish="error: engine add failed:\nValueError: too long"), "the rollout reported: error: engine add failed: "
                                                                      "ValueError: too long"),
    (dict(tokens=(4, 500)), "outside the vocabulary"),
    (dict(tokens=(4, 5, 6, 7, 8, 9, 10)), "7 response tokens exceed its max_new_tokens=6"),
])
def test_a_trajectory_that_does_not_belong_or_carries_garbage_is_refused(over, expect):
    t = _traj(**over)
    if "tokens" in over:
        t = msgspec.structs.replace(t, logprobs=[-0.5] * len(t.tokens))
    why = trajectory_refusal(t, Handed(), LIMITS, finished=True)
    assert why is not None and expect in why and "\n" not in why


def test_a_handed_back_trajectory_is_not_finished_and_without_limits_only_its_place_is_checked():
    partial = _traj(finish=None, reward=None, t_end=None, tokens=(4,))
    partial = msgspec.structs.replace(partial, logprobs=[-0.5])
    assert trajectory_refusal(partial, Handed(), LIMITS, finished=False) is None
    garbage = msgspec.structs.replace(partial, tokens=[10**9], logprobs=[math.nan, 1.0])
    assert trajectory_refusal(garbage, Handed(), None, finished=True) is None
    assert "claims group 3" in trajectory_refusal(_traj(group_id=3), Handed(), None, finished=True)


# -- the limits of a config's engines ------------------------------------------------------------

def test_limits_follow_the_engines_of_the_config():
    emulated = load_config(Path(REPO) / "configs" / "tiny-emulated.yaml")
    assert limits_for(emulated, 100) == Limits(vocab_size=100, max_seq_len=None)
    torch = load_config(Path(REPO) / "configs" / "tiny.yaml")
    assert limits_for(torch, 100) == Limits(vocab_size=100, max_seq_len=32)
    vllm = load_config(Path(REPO) / "configs" / "tiny.yaml", ["rollout.backend=vllm", "rollout.vllm.max_model_len=24"])
    assert limits_for(vllm, 50) == Limits(vocab_size=50, max_seq_len=24)


def test_as_int_takes_whole_finite_numbers_only():
    assert [as_int(v) for v in (3, -2, 4.0, 2**64 - 1)] == [3, -2, 4, 2**64 - 1]
    assert [as_int(v) for v in (True, 2.5, math.nan, math.inf, "3", None, -1.1e208, 2.0**64)] == [None] * 8
