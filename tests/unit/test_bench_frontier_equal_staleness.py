"""bench/bench_frontier.py --equal-staleness: the modes' throughput at the same mean version lag,
interpolated along the admission bound (issue 34 item 2)."""
from __future__ import annotations

import json
import math
import os

import pytest

from helpers import REPO

from bench import bench_frontier
from bench.bench_frontier import at_staleness

TINY = os.path.join(REPO, "configs", "tiny-emulated.yaml")
BOUND = bench_frontier.BOUND_KEY


# -- at_staleness ---------------------------------------------------------------------------------
def test_interpolates_between_the_bracketing_points():
    pts = [(1.0, 10.0), (3.0, 30.0)]
    assert at_staleness(pts, 2.0) == pytest.approx(20.0)
    assert at_staleness(pts, 1.5) == pytest.approx(15.0)
    assert at_staleness(pts, 2.9) == pytest.approx(29.0)


def test_an_exact_hit_is_the_point_itself():
    pts = [(1.0, 10.0), (2.0, 14.0), (3.0, 30.0)]
    assert at_staleness(pts, 1.0) == 10.0
    assert at_staleness(pts, 2.0) == 14.0
    assert at_staleness(pts, 3.0) == 30.0
    assert at_staleness([(2.5, 7.0)], 2.5) == 7.0  # one point is enough when S is that point's lag


def test_no_extrapolation_outside_the_lags_covered():
    pts = [(1.0, 10.0), (3.0, 30.0)]
    assert at_staleness(pts, 0.99) is None
    assert at_staleness(pts, 3.01) is None
    assert at_staleness([], 2.0) is None
    assert at_staleness([(None, 5.0)], 2.0) is None  # a point without a lag is no point


def test_unsorted_points_use_their_neighbours_in_lag_order():
    # between the lags 2 and 3 (14 -> 30), not between the first two given (3 and 1: 10 -> 30 would give 25)
    pts = [(3.0, 30.0), (1.0, 10.0), (2.0, 14.0)]
    assert at_staleness(pts, 2.5) == pytest.approx(22.0)
    assert at_staleness(pts, 1.5) == pytest.approx(12.0)


def test_points_sharing_a_lag_count_as_their_mean():
    pts = [(2.0, 10.0), (3.0, 30.0), (2.0, 20.0)]
    assert at_staleness(pts, 2.0) == pytest.approx(15.0)
    assert at_staleness(pts, 2.5) == pytest.approx(22.5)


def test_a_missing_figure_only_matters_at_a_bracketing_point():
    pts = [(1.0, None), (2.0, 4.0), (3.0, 6.0)]
    assert at_staleness(pts, 2.5) == pytest.approx(5.0)
    assert at_staleness(pts, 1.5) is None
    assert at_staleness([(2.0, None), (2.0, 3.0), (3.0, 5.0)], 2.5) is None  # a shared lag without the figure


# -- equal_staleness over rows --------------------------------------------------------------------
def _row(mode: str, seed: int, bound: int, lag: float, tps: float, p95: float | None = None,
         mx: float | None = None, where: str = "sim") -> dict:
    point = {BOUND: str(bound), "seed": str(seed)}
    return {"where": where, "point": point, "label": bench_frontier.label(point), "mode": mode,
            "trajectories_per_s": tps, "goodput": None, "figures": {},
            "version_lag": {"mean": lag, "p95": lag + 1 if p95 is None else p95, "max": lag + 3 if mx is None else mx},
            "step_lag": None}


def _frontier() -> list[dict]:
    """Two seeds whose lags interleave: pooled, S=2 would hit seed 0's point (20) exactly; per seed,
    seed 1 interpolates to 50, so the mean is 35."""
    return [
        _row("partial-rollout", 0, 1, 1.0, 10.0, p95=2, mx=4), _row("partial-rollout", 0, 2, 2.0, 20.0, p95=4, mx=6),
        _row("partial-rollout", 0, 4, 3.0, 30.0, p95=5, mx=9),
        _row("partial-rollout", 1, 1, 1.5, 40.0, p95=3, mx=5), _row("partial-rollout", 1, 4, 2.5, 60.0, p95=5, mx=11),
        _row("laminar", 0, 1, 1.0, 12.0), _row("laminar", 0, 2, 2.0, 24.0), _row("laminar", 0, 4, 3.0, 36.0),
        _row("laminar", 1, 1, 1.5, 44.0), _row("laminar", 1, 4, 2.5, 66.0),
    ]


def test_each_seed_is_its_own_frontier_then_mean_and_spread():
    (e,) = bench_frontier.equal_staleness(_frontier(), [2.0], ["partial-rollout", "laminar"])
    assert e["staleness"] == 2.0 and e["where"] == "sim"
    assert e["trajectories_per_s"]["partial-rollout"] == pytest.approx(35.0)  # (20 + 50) / 2, not pooled 20
    assert e["spread"]["partial-rollout"] == pytest.approx([20.0, 50.0])
    assert e["trajectories_per_s"]["laminar"] == pytest.approx(39.5)  # (24 + 55) / 2
    assert e["spread"]["laminar"] == pytest.approx([24.0, 55.0])
    by = {pg["label"]: pg for pg in e["per_group"]}
    assert set(by) == {"seed=0", "seed=1"} and by["seed=1"]["group"] == {"seed": "1"}
    assert by["seed=1"]["modes"]["partial-rollout"]["trajectories_per_s"] == pytest.approx(50.0)
    assert by["seed=1"]["modes"]["partial-rollout"]["covered"] == [1.5, 2.5]
    # the tail at the same operating point: p95 interpolated the same way (seed 0: 4, seed 1: 4), the
    # max too (6 and 8), and the worst combination's max is the mode's
    assert e["version_lag_p95"]["partial-rollout"] == pytest.approx(4.0)
    assert by["seed=1"]["modes"]["partial-rollout"]["version_lag_max"] == pytest.approx(8.0)
    assert e["version_lag_max"]["partial-rollout"] == pytest.approx(8.0)
    assert e["version_lag_p95"]["laminar"] == pytest.approx(3.0)
    assert e["version_lag_max"]["laminar"] == pytest.approx(5.0)
    assert e["missed"] == {}


def test_laminar_over_every_other_mode():
    rows = _frontier() + [_row("partial-rollout-areal", s, b, lag, tps / 2) for s, b, lag, tps in
                          ((0, 1, 1.0, 10.0), (0, 4, 3.0, 30.0), (1, 1, 1.5, 40.0), (1, 4, 2.5, 60.0))]
    (e,) = bench_frontier.equal_staleness(rows, [2.0], ["partial-rollout", "partial-rollout-areal", "laminar"])
    assert set(e["laminar_over"]) == {"partial-rollout", "partial-rollout-areal"}  # not laminar over itself
    assert e["laminar_over"]["partial-rollout"] == pytest.approx(39.5 / 35.0)
    assert e["laminar_over"]["partial-rollout-areal"] == pytest.approx(39.5 / 17.5)
    # per seed the ratios are 24/20 and 55/50
    assert e["laminar_over_spread"]["partial-rollout"] == pytest.approx([1.1, 1.2])


def test_a_seed_that_missed_makes_the_mode_null_and_names_its_range():
    levels = [2.8, 0.5]
    entries = bench_frontier.equal_staleness(_frontier(), levels, ["partial-rollout", "laminar"])
    assert [e["staleness"] for e in entries] == levels
    hi, lo = entries
    # seed 0 reaches 2.8 (28), seed 1 stops at 2.5: no mean over seed 0 alone
    seeds = [pg["modes"]["partial-rollout"]["trajectories_per_s"] for pg in hi["per_group"]]
    assert seeds == [pytest.approx(28.0), None]
    assert hi["trajectories_per_s"]["partial-rollout"] is None and hi["spread"]["partial-rollout"] is None
    assert hi["laminar_over"]["partial-rollout"] is None and hi["version_lag_max"]["laminar"] is None
    assert hi["missed"]["partial-rollout"] == {"seed=1": [1.5, 2.5]}
    assert set(lo["missed"]["laminar"]) == {"seed=0", "seed=1"}
    lines = bench_frontier.missed_lines(entries)
    assert any("partial-rollout did not reach mean version lag 2.8" in ln and "seed=1: 1.50-2.50" in ln
               and "--sweep " + BOUND in ln for ln in lines)
    assert len(lines) == 4  # two modes at each of the two levels
    table = bench_frontier.staleness_table(entries, ["partial-rollout", "laminar"])
    assert "laminar/partial-rollout" in table and "2.8 | - | - | -" in table


def test_without_laminar_it_is_a_usage_error():
    with pytest.raises(bench_frontier.UsageError, match="add laminar to --modes"):
        bench_frontier.equal_staleness(_frontier(), [2.0], ["partial-rollout"])


@pytest.mark.parametrize("argv, says", [
    (["--modes", "partial-rollout", "--equal-staleness", "2"], "--equal-staleness compares against laminar"),
    (["--modes", "laminar", "--equal-staleness", "-1"], "--equal-staleness -1"),
    (["--modes", "laminar", "--equal-staleness", "nan"], "--equal-staleness nan"),
    (["--modes", "laminar", "--sweep", "seed=0,1", "--equal-staleness", "2"], f"--sweep {BOUND}="),
])
def test_bad_equal_staleness_is_one_line_naming_the_flag(argv, says, capsys):
    assert bench_frontier.main([TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


# -- end to end -----------------------------------------------------------------------------------
def _by_hand(rows: list[dict], mode: str, s: float) -> float:
    """Linear interpolation at lag s from this mode's two bracketing rows, written out independently."""
    pts = sorted((r["version_lag"]["mean"], r["trajectories_per_s"]) for r in rows if r["mode"] == mode)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= s <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (s - x0) / (x1 - x0)
    raise AssertionError(f"{mode}: no bracketing pair for {s} in {pts}")


def test_a_small_simulated_equal_staleness_run(tmp_path, capsys):
    out = tmp_path / "f.json"
    modes = ["partial-rollout", "laminar"]
    code = bench_frontier.main([TINY, "--steps", "6", "--sweep", f"{BOUND}=1,2,4", "--modes", ",".join(modes),
                                "--equal-staleness", "1.5", "--equal-staleness", "50", "--json", str(out),
                                "--plot", str(tmp_path / "f.png")])
    assert code == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    for m in modes:  # the precondition of what follows: the tiny frontier spans lag 1.5
        lags = [r["version_lag"]["mean"] for r in rows if r["mode"] == m]
        assert min(lags) < 1.5 < max(lags) < 50, (m, lags)
    reached, beyond = doc["equal_staleness"]
    assert reached["staleness"] == 1.5 and beyond["staleness"] == 50 and reached["where"] == "sim"
    for m in modes:
        assert reached["trajectories_per_s"][m] == pytest.approx(_by_hand(rows, m, 1.5))
        assert reached["spread"][m] == pytest.approx([reached["trajectories_per_s"][m]] * 2)  # one frontier
        p95, mx = reached["version_lag_p95"][m], reached["version_lag_max"][m]
        assert p95 is not None and mx is not None and 0 < p95 <= mx
        assert beyond["trajectories_per_s"][m] is None and m in beyond["missed"]
    assert set(reached["laminar_over"]) == {"partial-rollout"}
    assert reached["laminar_over"]["partial-rollout"] == pytest.approx(
        reached["trajectories_per_s"]["laminar"] / reached["trajectories_per_s"]["partial-rollout"])
    assert [pg["label"] for pg in reached["per_group"]] == ["all"]
    printed = capsys.readouterr().out
    head = printed.index("equal staleness (sim)")
    assert printed.index("vlag p95") < head  # after the frontier's own table
    assert "staleness | partial-rollout | laminar | laminar/partial-rollout" in printed
    assert f"1.5 | {reached['trajectories_per_s']['partial-rollout']:.2f} | " in printed
    assert "laminar did not reach mean version lag 50" in printed
    assert not math.isnan(doc["wall_s"])
