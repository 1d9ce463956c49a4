"""bench/bench_frontier.py: its sweeps, and a small simulated frontier end to end (seconds)."""
from __future__ import annotations

import json
import os

import pytest

from laminar_hpc.config import load_config

from helpers import REPO

from bench import bench_frontier
from bench import bench_modes

TINY = os.path.join(REPO, "configs", "tiny-emulated.yaml")


def test_sweeps_zip_or_cross():
    assert bench_frontier.parse_sweep(["controller.max_ahead_steps=1,2,4"]) == [
        {"controller.max_ahead_steps": "1"}, {"controller.max_ahead_steps": "2"}, {"controller.max_ahead_steps": "4"}]
    zipped = bench_frontier.parse_sweep(["a.x=1,2", "b.y=3, 4"])
    assert zipped == [{"a.x": "1", "b.y": "3"}, {"a.x": "2", "b.y": "4"}]
    crossed = bench_frontier.parse_sweep(["a.x=1,2", "b.y=3,4,5"], cross=True)
    assert len(crossed) == 6 and crossed[0] == {"a.x": "1", "b.y": "3"} and crossed[-1] == {"a.x": "2", "b.y": "5"}
    assert bench_frontier.label(zipped[1]) == "x=2,y=4"


@pytest.mark.parametrize("items, says", [
    (["a.x=1,2", "b.y=3"], "as many values"),
    (["a.x"], "KEY=V1,V2"),
    (["a.x="], "KEY=V1,V2"),
    (["a.x=1", "a.x=2"], "swept twice"),
])
def test_bad_sweeps_are_one_clear_error(items, says):
    with pytest.raises(bench_frontier.UsageError, match=says):
        bench_frontier.parse_sweep(items)


def test_every_bench_mode_loads():
    for mode, overrides in bench_modes.MODES.items():
        assert load_config(TINY, overrides).mode == overrides[0].split("=", 1)[1], mode


def test_a_small_simulated_frontier(tmp_path, capsys):
    out = tmp_path / "f.json"
    code = bench_frontier.main([TINY, "--steps", "4", "--sweep", "controller.max_ahead_steps=1,3",
                                "--modes", "laminar,partial-rollout", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [(r["label"], r["mode"]) for r in rows] == [
        ("max_ahead_steps=1", "laminar"), ("max_ahead_steps=1", "partial-rollout"),
        ("max_ahead_steps=3", "laminar"), ("max_ahead_steps=3", "partial-rollout")]
    assert doc["ideal"]["trajectories_per_s"] > 0
    for r in rows:
        assert r["where"] == "sim" and 0 < r["goodput"] < 1.2
        assert r["version_lag"]["mean"] is not None and r["step_lag"]["p95"] is not None
    for mode in ("laminar", "partial-rollout"):  # a looser bound lets staleness grow
        lo, hi = (r for r in rows if r["mode"] == mode)
        assert hi["step_lag"]["mean"] > lo["step_lag"]["mean"]
    printed = capsys.readouterr().out
    assert "vlag p95" in printed and "ideal (cost model)" in printed
    if doc["plot"].startswith("frontier plot written"):
        assert out.with_suffix(".png").stat().st_size > 0


def test_usage_errors_are_one_line(capsys):
    assert bench_frontier.main([TINY, "--modes", "fastest"]) == 2
    assert bench_frontier.main([TINY, "--gpus", "64", "--run", "runtime"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "unknown mode 'fastest'" in err and "--gpus" in err
