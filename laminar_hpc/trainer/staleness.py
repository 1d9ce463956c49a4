"""The trainer's staleness bookkeeping: the run's lineage on disk and each batch's lags.

`run_dir/lineage.json` lists every trainer start of the run (policy/lineage.py): a start appends
itself before its first publish, so any version a rollout can hold maps to the training step it
holds. A trajectory's staleness is reported both as version lag (version numbers) and as step
lag (train steps between its weights and the trainer's, across restarts); the bound
`trainer.max_staleness` is on step lag.

    lineage = start_lineage(rundir.lineage, version=10, step=6, resumed_version=6)
    version_lags, step_lags = group_lags(lineage, 12, group)
    m.update(lag_metrics([group_lags(lineage, 12, g) for g in batch]))
"""
from __future__ import annotations

from pathlib import Path

from laminar_hpc.policy.lineage import Segment, step_lag
from laminar_hpc.rundir import atomic_write_json, read_json
from laminar_hpc.transport.protocol import Group

# off-policy health and staleness figures that also go into each train_step trace event (every
# key of the step's metrics goes to metrics.jsonl)
TRACED = ("staleness_mean", "staleness_max", "step_lag_mean", "step_lag_max", "staleness_hist", "step_lag_hist",
          "is_ratio_mean", "is_ratio_max", "truncated_frac", "masked_frac", "clipped_frac", "kl_mu_pi", "entropy",
          "outside_support_frac", "dropped_groups")


def start_lineage(path: Path, *, version: int, step: int, resumed_version: int | None) -> list[Segment]:
    """Append this trainer start to the run's lineage file (atomically) and return the lineage."""
    rows = read_json(path, default=None) or []
    lineage = [Segment.from_json(r) for r in rows]
    if not lineage and resumed_version is not None:
        # a run from before lineages were recorded: its versions so far are taken as one start
        lineage = [Segment(resumed_version - step, 0, None)]
    lineage.append(Segment(version, step, resumed_version))
    atomic_write_json(path, [s.to_json() for s in lineage])
    return lineage


def group_lags(lineage: list[Segment], version: int, g: Group) -> tuple[list[int], list[int]]:
    """Each member's (version lags, step lags) behind the weights of `version`."""
    versions = [t.version for t in g.trajectories]
    # a version above the trainer's can only come from a corrupt frame: lag 0 (the controller validates)
    return ([version - v for v in versions],
            [step_lag(lineage, version, v) if v <= version else 0 for v in versions])


def lag_metrics(lags: list[tuple[list[int], list[int]]]) -> dict:
    """A batch's staleness, from each group's (version lags, step lags): mean, max and histogram
    of both (they differ only across a trainer restart)."""
    out: dict = {}
    for name, k in (("staleness", 0), ("step_lag", 1)):
        vals = [lag for group in lags for lag in group[k]]
        hist: dict[str, int] = {}
        for v in vals:
            hist[str(v)] = hist.get(str(v), 0) + 1
        out.update({f"{name}_mean": sum(vals) / max(1, len(vals)), f"{name}_max": max(vals, default=0),
                    f"{name}_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))})
    return out


