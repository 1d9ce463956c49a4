"""Calibrate the simulator from a run's traces and metrics.

    cal = calibrate("runs/bench/laminar")      # or the parent of several runs (bench/bench_modes.py --out)
    cfg = calibrated_config(cfg, cal)           # decode, training and length model into emulation.*
    params = apply_calibration(SimParams.from_config(cfg, spec), cal)   # sync costs, latency
    cal.fitted, cal.sources                     # what was measured, and from how many events

What is fitted (wall durations of an emulated run are divided by its emulation.time_scale, so
everything is in emulated seconds; a real run has time_scale 1):

- decode-step cost, from the rollouts' `decode_sample` events {batch, kv, steps, seconds}: least
  squares of seconds = steps * (base + per_seq * batch) + per_kv * kv_sum, kv_sum = steps * kv +
  batch * steps * (steps - 1) / 2 (the CostModel's own form), coefficients kept >= 0. Without
  such events the config's coefficients stay.
- response lengths, from the rollouts' `traj_finished` tokens (emulation.workload.complete_group_lengths,
  which an `empirical: {trace: RUN_DIR}` lengths source reads too): a log-normal with the measured
  median, sigma from the median and 90th percentile (robust to the length cap), and the longest
  seen as max_tokens; the sorted sample is kept for `--lengths empirical`. Only complete groups
  count: the groups admitted before the first one with a trajectory still unfinished when the
  run ended. The finished trajectories of a run under-represent long ones (they are the ones
  still running at the end), which made a simulation ~5% faster than the run it came from.
  Fewer than MIN_FIT_GROUPS complete groups are no fit (the config's lengths stay, said in the
  sources): the first groups of a short run to complete are its short ones (4 steps of the
  reference workload completed 3 groups: median 843 and p99 6.9x the median, against 1,024 and
  10x, and a plan calibrated on them predicted 42 trajectories/s where the run gives ~26).
  A config with tool-use episodes keeps its own workload (a trajectory's tokens hold its
  observations too); `--lengths empirical` still resamples the measured lengths.
- sync costs: weight load (`weights_pulled` pull_s), publish stall (`publish` stall_s), publish
  -> readable at each relay (`relay_ready` since_publish_s), one-way message latency (half the
  `heartbeat` round trip, 10th percentile: a role reads the answer only between its own steps).
- training cost per token, from metrics.jsonl: sum(train_s) / sum(response + prompt tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from laminar_hpc.config import load_config
from laminar_hpc.config.task import fixed_prompt_tokens
from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.emulation.cost import Z99
from laminar_hpc.emulation.workload import complete_groups, has_tools
from laminar_hpc.metrics.summary import read_metrics
from laminar_hpc.metrics.trace import read_run
from laminar_hpc.sim.params import SimParams

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

Z90 = 1.2815515655446004


MIN_FIT_GROUPS = 16  # complete groups a length fit needs (module docstring)


class CalibrationError(ValueError):
    """A run directory the simulator cannot be calibrated from (the message is one line)."""


@dataclass
class Calibration:
    run_dirs: list[str]
    fitted: dict = field(default_factory=dict)  # parameter -> value (emulated units)
    sources: dict = field(default_factory=dict)  # parameter -> how it was measured
    empirical_lengths: list[int] | None = None


def run_dirs(path: str | Path) -> list[Path]:
    p = Path(path)
    if not p.is_dir():
        raise CalibrationError(f"{p}: no such run directory")
    if (p / "config.yaml").is_file():
        return [p]
    subs = sorted(d for d in p.iterdir() if d.is_dir() and (d / "config.yaml").is_file())
    if not subs:
        raise CalibrationError(f"{p}: not a run directory (no config.yaml) and holds none")
    return subs


def fit_decode(samples: list[tuple[int, int, int, float]]) -> tuple[np.ndarray, float]:
    """(base_s, per_seq_s, per_kv_s) from (batch, kv, steps, seconds) rows, all >= 0; and R^2."""
    b, kv, st, sec = (np.asarray(x, dtype=float) for x in zip(*samples))
    X = np.stack([st, st * b, st * kv + b * st * (st - 1) / 2], axis=1)
    keep = [0, 1, 2]
    while True:  # drop a negative coefficient and refit (active set on three unknowns)
        coef = np.zeros(3)
        sol, *_ = np.linalg.lstsq(X[:, keep], sec, rcond=None)
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            break
        keep.remove(min(neg, key=lambda k: coef[k]))
    res = float(((sec - X @ coef) ** 2).sum())
    ss, tiny = float(((sec - sec.mean()) ** 2).sum()), 1e-12 * float((sec ** 2).sum())
    r2 = 1.0 - res / ss if ss > tiny else (1.0 if res <= tiny else 0.0)  # constant seconds: exact or not
    return coef, r2


def fit_lengths(tokens: list[int]) -> dict:
    a = np.asarray(tokens, dtype=float)
    med = float(np.median(a))
    q90 = float(np.quantile(a, 0.90))
    sigma = max(1e-6, math.log(max(q90, med * (1 + 1e-6)) / med) / Z90)
    return {"median": med, "p99_over_median": max(1.0001, math.exp(Z99 * sigma)),
            "min_tokens": int(a.min()), "max_tokens": int(a.max())}


def _median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def calibrate(path: str | Path) -> Calibration:
    dirs = run_dirs(path)
    cal = Calibration([str(d) for d in dirs])
    decode, lengths, pulls, stalls, hb, relay, train_s, train_tok = [], [], [], [], [], {}, 0.0, 0.0
    finished, admitted = {}, []
    grouped: int | None = 0  # complete groups whose lengths were read (None: traces without admissions)
    for d in dirs:
        cfg = load_config(d / "config.yaml")
        scale = rollout_backend(cfg).time_scale(cfg)
        prompt = fixed_prompt_tokens(cfg.task)
        prompts = []
        for e in read_run(d).events:
            ev, role = e["ev"], e.get("role", "")
            if role.startswith("rollout"):
                if ev == "decode_sample" and e.get("seconds") is not None:
                    decode.append((int(e["batch"]), int(e["kv"]), int(e.get("steps", 1)), e["seconds"] / scale))
                elif ev == "traj_finished" and e.get("tokens"):
                    finished[e["traj"]] = int(e["tokens"])
                elif ev == "weights_pulled" and e.get("pull_s") is not None:
                    pulls.append(e["pull_s"] / scale)
                elif ev == "traj_started" and e.get("prompt_tokens"):
                    prompts.append(e["prompt_tokens"])
            if ev == "publish" and e.get("stall_s") is not None:
                stalls.append(e["stall_s"] / scale)
            elif ev == "relay_ready" and e.get("since_publish_s") is not None:
                rank = int(role.rpartition("-")[2]) if role.rpartition("-")[2].isdigit() else 0
                relay.setdefault(rank, []).append(e["since_publish_s"] / scale)
            elif ev == "heartbeat" and e.get("rtt") is not None:
                hb.append(e["rtt"] / 2 / scale)
            elif ev == "group_admitted":
                admitted.append((e["t"], int(e["group"]), int(e.get("n", 0))))
        if admitted:
            groups = complete_groups(finished, admitted)
            lengths.extend(n for group in groups for n in group)
            grouped += len(groups)
        else:  # older traces: every finished trajectory (no groups to count)
            lengths.extend(finished.values())
            grouped = None
        finished, admitted = {}, []
        if prompt is None and prompts:
            prompt = float(np.mean(prompts))
        for r in read_metrics(d):
            train_s += r["train_s"] / scale
            train_tok += r["tokens"] + r["trajectories"] * (prompt or 0)
    f, s = cal.fitted, cal.sources
    if len(decode) >= 3:
        coef, r2 = fit_decode(decode)
        f.update(decode_base_ms=coef[0] * 1e3, decode_per_seq_us=coef[1] * 1e6, decode_per_kv_token_ns=coef[2] * 1e9)
        s["decode"] = f"least squares over {len(decode)} decode_sample events (R^2 {r2:.3f})"
    else:
        s["decode"] = "config emulation.decode_* (the traces hold no decode_sample events)"
    if grouped is not None and grouped < MIN_FIT_GROUPS:
        s["lengths"] = (f"config emulation.lengths: the run completed {grouped} group(s) before its first unfinished "
                        f"one, a length fit needs {MIN_FIT_GROUPS} (the first groups to complete are the short ones; "
                        "run more steps)")
    elif len(lengths) >= 20:
        f["lengths"] = fit_lengths(lengths)
        cal.empirical_lengths = sorted(lengths)
        s["lengths"] = f"log-normal fitted to {len(lengths)} trajectories of complete groups (median, p90)"
    if train_tok > 0:
        f["train_per_token_us"] = train_s / train_tok * 1e6
        s["train"] = "metrics.jsonl: sum(train_s) / sum(prompt + response tokens)"
    for key, xs, what in (("pull_s", pulls, "weights_pulled pull_s"), ("publish_stall_s", stalls, "publish stall_s")):
        if xs:
            f[key] = _median(xs)
            s[key] = f"median of {len(xs)} {what}"
    if hb:  # a role handles the answer only between its own steps: the short round trips are the network's
        f["msg_latency_s"] = float(np.quantile(hb, 0.1))
        s["msg_latency_s"] = f"10th percentile of {len(hb)} heartbeat round trips / 2"
    if relay:
        f["relay_ready_s"] = {k: _median(v) for k, v in sorted(relay.items())}
        s["relay_ready_s"] = f"median relay_ready since_publish_s per relay ({sum(map(len, relay.values()))} events)"
    if not f:
        raise CalibrationError(f"{path}: its traces hold nothing to calibrate from (no trace/ events or metrics)")
    return cal


def calibrated_config(cfg: Config, cal: Calibration):
    """The config with the measured cost model in its emulation section (decode, training, lengths)."""
    f = cal.fitted
    emu = {k: f[k] for k in ("decode_base_ms", "decode_per_seq_us", "decode_per_kv_token_ns", "train_per_token_us")
           if k in f}
    if "lengths" in f and not has_tools(cfg.emulation.lengths):
        # the fitted log-normal replaces the configured distribution (a mixture or a list included);
        # episodes keep their workload: a trace's lengths hold observations, not the model's turns
        emu["lengths"] = type(cfg.emulation.lengths)(**f["lengths"])
    if not emu:
        return cfg
    return cfg.model_copy(update={"emulation": cfg.emulation.model_copy(update=emu)})


def apply_calibration(params: SimParams, cal: Calibration) -> SimParams:
    """The measured sync costs and message latency (build `params` from `calibrated_config` first)."""
    f = cal.fitted
    changes = {k: f[k] for k in ("pull_s", "publish_stall_s", "msg_latency_s") if k in f}
    if "relay_ready_s" in f:
        changes["relay_ready_measured"] = dict(f["relay_ready_s"])
    sources = {**params.sources, **{f"calibrated {k}": v for k, v in cal.sources.items()}}
    return replace(params, sources=sources, **changes)
