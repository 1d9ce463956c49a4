"""bench/group_life.py: a trajectory's time before training split into generating and waiting for
its group (docs/frontier.md), on a small simulated campaign (seconds)."""
from __future__ import annotations

import os

import pytest

from helpers import REPO

from bench import group_life

REFERENCE = os.path.join(REPO, "configs", "bench", "longtail-math.yaml")


def test_the_wait_for_the_group_grows_with_its_size():
    pairs = group_life.group_life(REFERENCE, "laminar", 2, 0, 6, ["trainer.group_size=2", "trainer.groups_per_step=512"])
    grouped = group_life.group_life(REFERENCE, "laminar", 2, 0, 6, [])  # 64 groups of 16
    assert pairs["trajectories"] > 0 and grouped["trajectories"] > 0
    # with one sibling a member waits on average less than it generates (one of two waits for the other)
    assert 0 < pairs["waiting_for_group"] < pairs["generating"]
    # long-tailed lengths: a member waits for the longest of its 16 siblings longer than it generates
    assert grouped["waiting_for_group"] > grouped["generating"] > 0
    assert 0.5 < grouped["waiting_share"] < 1.0


def test_bad_input_is_one_line_naming_what_to_fix(capsys, tmp_path):
    assert group_life.main([str(tmp_path / "none.yaml"), "--sweep", "2", "--seeds", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("group_life: error:") and "none.yaml" in err and "\n" not in err
    assert group_life.main([REFERENCE, "trainer.lrr=1", "--sweep", "2", "--seeds", "0"]) == 2
    assert "trainer.lrr" in capsys.readouterr().err
    for bad in (["--mode", "lamnar"], ["--sweep", "x"], ["repack.enabled=false", "--mode", "laminar-pure"]):
        with pytest.raises(SystemExit) as exit_:
            group_life.main([REFERENCE, *bad])
        assert exit_.value.code == 2
