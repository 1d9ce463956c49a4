"""Live progress of a campaign: a table on a terminal, plain log lines otherwise.

Fed with the controller's status.json (refreshed every second). The display remembers what it
saw (`History`): the batch reward of each step and the evaluation score of each round for the
sparklines (sampled at each refresh: with several steps a second, some steps are not drawn;
metrics.jsonl has all of them), and the pace of the warm-up and of training for the progress
bars' ETA. Versions are shown as compact text: `v12 x3, v11 x1` (version x how many hold it).
"""
from __future__ import annotations

import sys
import time

from laminar_hpc.metrics.eta import Eta
from laminar_hpc.metrics.status import Status


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _total(st: Status) -> str:
    return "?" if st.total_steps is None else str(st.total_steps)


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """The last `width` values as block characters, scaled from their min to their max."""
    vals = [v for v in values if v is not None][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    top = len(SPARKS) - 1
    return "".join(SPARKS[round((v - lo) / (hi - lo) * top) if hi > lo else top // 2] for v in vals)


def bar(frac: float, width: int = 24) -> str:
    """'██████░░░░' filled to `frac` (clamped to 0..1)."""
    n = round(max(0.0, min(1.0, frac)) * width)
    return "█" * n + "░" * (width - n)


def duration(s: float | None) -> str:
    """'45s', '3m20s', '1h02m'; '?' when unknown."""
    if s is None:
        return "?"
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def versions_text(held: dict[int, int]) -> str:
    """Who holds which version, newest first: {0: 50, 1: 50, 2: 49} -> 'v50 x2, v49 x1'
    ('none' for a replica that holds no version yet)."""
    if not held:
        return "-"
    counts: dict[int, int] = {}
    for v in held.values():
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{'none' if v < 0 else f'v{v}'} x{n}" for v, n in sorted(counts.items(), reverse=True))


def flight_text(versions: list[int]) -> str:
    """[11, 12] -> 'v11,v12'."""
    return ",".join(f"v{v}" for v in sorted(versions)) or "-"


class History:
    """What the display keeps across refreshes: rewards by step, evaluation scores by step, the
    warm-up's greedy rewards, and where each phase was first seen (elapsed seconds, step) for its pace."""

    def __init__(self):
        self.rewards: dict[int, float] = {}
        self.evals: dict[int, float] = {}
        self.warmup: dict[int, float] = {}
        self.first: dict[str, tuple[float, int]] = {}

    def add(self, st: Status) -> None:
        m = st.metrics
        if st.phase == "warmup":
            step = m.get("warmup.step")
            if isinstance(step, int) and isinstance(m.get("warmup.greedy_reward"), (int, float)):
                self.warmup[step] = float(m["warmup.greedy_reward"])
            self.first.setdefault("warmup", (st.elapsed_s, warmup_step(m)))
        else:
            step = m.get("step", st.step)
            if isinstance(step, int) and isinstance(m.get("reward_mean"), (int, float)):
                self.rewards[step] = float(m["reward_mean"])
            if st.phase != "?" and st.step >= 1:
                # the pace of train steps counts from the first one seen: the time before it (loading,
                # a warm-up the display did not see, the first batch's generation) is not a step's
                self.first.setdefault("rl", (st.elapsed_s, st.step))
        ev = st.eval or {}
        if isinstance(ev.get("eval_step"), int) and isinstance(ev.get("eval_reward"), (int, float)):
            self.evals[ev["eval_step"]] = float(ev["eval_reward"])

    def pace(self, phase: str, step: int, elapsed_s: float) -> float | None:
        """Seconds per step in `phase` since it was first seen, or None before a step passed."""
        t0, s0 = self.first.get(phase, (elapsed_s, step))
        return (elapsed_s - t0) / (step - s0) if step > s0 and elapsed_s > t0 else None

    def series(self, which: dict[int, float]) -> list[float]:
        return [which[k] for k in sorted(which)]


def progress_text(step: int, total: int | None, pace: float | None, at_most: bool = False,
                  left: float | None = None, known: bool = False) -> str:
    """'██████░░░░ 6/12 50% · 0.8s/step · ETA 5s' (`at_most`: the phase may end sooner; `left`: the
    campaign's time left, `known`: from metrics/eta.py, '?' where it is None; else the pace x steps left)."""
    if not total:
        return f"{step} / ?"
    if left is None and pace is not None and not known:
        left = pace * max(0, total - step)
    rate = "" if pace is None else f" · {pace:.2f}s/step"
    eta = f"{'≤ ' if at_most else ''}{duration(left)}"
    return f"{bar(step / total)} {step}/{total} {step / total:.0%}{rate} · ETA {eta}"


def warmup_step(m: dict) -> int:
    """The warm-up's newest step: its progress reports (each heartbeat interval) or evaluations."""
    steps = [m.get("warmup.step"), m.get("warmup_progress.step")]
    return max([s for s in steps if isinstance(s, int)], default=0)


def warmup_total(m: dict) -> int | None:
    total = m.get("warmup.max_steps", m.get("warmup_progress.max_steps"))
    return total if isinstance(total, int) else None


def eta_text(st: Status, history: History | None, eta: Eta | None = None) -> str:
    """' ETA 1m20s' for the plain line (the campaign's end, where `eta` knows it), or ''."""
    if eta is not None:
        now = time.monotonic()
        left = eta.warmup_left_s(now) if st.phase == "warmup" else eta.left_s(now)
        return "" if left is None else f" ETA {'≤ ' if st.phase == 'warmup' else ''}{duration(left)}"
    if history is None:
        return ""
    if st.phase == "warmup":
        step, total = warmup_step(st.metrics), warmup_total(st.metrics)
        pace = history.pace("warmup", step, st.elapsed_s)
    else:
        step, total, pace = st.step, st.total_steps, history.pace("rl", st.step, st.elapsed_s)
    if not isinstance(total, int) or pace is None:
        return ""
    at_most = "≤ " if st.phase == "warmup" else ""  # the warm-up's target may end it sooner
    return f" ETA {at_most}{duration(pace * max(0, total - step))}"


def phase_of(st: Status, roles_expected: int | None = None) -> tuple[str, str]:
    """(key, text) of the campaign's phase: starting (before the controller's status, then its roles
    getting ready: model loading), warm-up, training, final evaluation (done/items), stopping. The
    display says each key once as it begins ('phase: ...')."""
    if not st.t:
        return "starting", "starting the controller"
    if st.phase in ("?", "starting"):
        ready = sum(1 for e in st.roles.values() if e.ready_t is not None and not e.down)
        total = roles_expected or len(st.roles)
        if total and ready < total:
            return "loading", f"starting: {ready} of {total} roles ready (loading the model, first weights)"
        return "first batch", "generating the first batch"
    if st.phase == "warmup":
        return "warmup", "supervised warm-up"
    if st.phase == "finishing":
        ev = st.evaluating
        if ev:
            return "final evaluation", f"final evaluation {ev.get('done', 0)}/{ev.get('items', '?')} (step {ev.get('step')})"
        return "stopping", "stopping the roles"
    return "training", "training"


def status_line(st: Status, history: History | None = None, roles_expected: int | None = None,
                eta: Eta | None = None) -> str:
    m = st.metrics
    key, text = phase_of(st, roles_expected)
    if key not in ("warmup", "training"):
        return f"{text}, elapsed {st.elapsed_s:.0f}s{eta_text(st, None, eta)}"
    if st.phase == "warmup":
        return (f"warm-up step {warmup_step(m)} greedy reward {_fmt(m.get('warmup.greedy_reward'))}"
                f"{warmup_failures(m, ' rewards failed ')} elapsed {st.elapsed_s:.0f}s{eta_text(st, history, eta)}")
    return (f"step {st.step}/{_total(st)} reward {_fmt(m.get('reward_mean'))}{eval_text(st)} "
            f"traj/s {_fmt(st.trajectories_per_s, '.1f')} "
            f"staleness {_fmt(m.get('staleness_mean'), '.2f')}/{m.get('staleness_max', '-')} "
            f"versions in flight {flight_text(st.versions_in_flight)} trainer v{st.trainer_version} "
            f"elapsed {st.elapsed_s:.0f}s{eta_text(st, history, eta)}")


def eval_text(st: Status) -> str:
    """' eval 0.412 (v10)': the last evaluation round's score and version, or ''."""
    ev = st.eval
    return "" if not ev else f" eval {_fmt(ev.get('eval_reward'))} (v{ev.get('eval_version')})"


def eval_cell(e: dict) -> str:
    """'reward 0.412, pass@1 0.400, pass@4 0.650 at v10 (step 10)': the last round's figures (pass@k
    for every k it measured, by k), for the live table."""
    ks = sorted(int(k[10:]) for k in e if k.startswith("eval_pass@") and k[10:].isdigit())
    passes = "".join(f", pass@{k} {_fmt(e.get(f'eval_pass@{k}'))}" for k in ks)
    return f"reward {_fmt(e.get('eval_reward'))}{passes} at v{e.get('eval_version')} (step {e.get('eval_step')})"


def warmup_failures(m: dict, prefix: str = "") -> str:
    """The warm-up evaluation's rewards scored 0 because the call failed: '3 (exception 3)', or ''."""
    n = m.get("warmup.reward_failed")
    return f"{prefix}{n} ({m.get('warmup.reward_failed_by', '')})" if n else ""


def reward_rows(m: dict) -> list[tuple[str, str]]:
    """The reward's components and the rewards scored 0 because the call failed, by reason."""
    rows = [(f"reward: {k[7:]}", _fmt(v)) for k, v in sorted(m.items()) if k.startswith("reward.")]
    failed = {k[14:]: v for k, v in m.items() if k.startswith("reward_failed.")}
    if m.get("reward_failed"):
        rows.append(("rewards failed (scored 0)", f"{m['reward_failed']} ({', '.join(f'{k} {v}' for k, v in sorted(failed.items()))})"))
    return rows


class Progress:
    def __init__(self, title: str, plain_every_s: float = 5.0, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.title, self.plain_every_s = title, plain_every_s
        self.last_plain = 0.0
        self.history = History()
        self.roles_expected: int | None = None  # the launcher's roles, for 'k of M roles ready'
        self.phase: str | None = None  # the key of the phase last said
        self.eta: Eta | None = None  # the campaign's time left (the launcher sets it: Eta.for_config)
        self.live = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live
            self.live = Live(console=Console(file=self.stream), refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, st: Status) -> None:
        """Called about every 0.2 s by the launcher: a phase's first line at once, then (plain) a
        line every `plain_every_s`, so that no phase stays silent."""
        key, text = phase_of(st, self.roles_expected)
        if key != self.phase:
            self.phase = key
            self.message(f"phase: {text}")
            self.last_plain = time.monotonic()
        if not st.t:
            if self.live is None and time.monotonic() - self.last_plain >= self.plain_every_s:
                self.message(text)  # the controller has not written its status yet
                self.last_plain = time.monotonic()
            return
        self.history.add(st)
        if self.eta is not None:
            self.eta.see(st, time.monotonic())
        if self.live is not None:
            self.live.update(self._table(st))
        elif time.monotonic() - self.last_plain >= self.plain_every_s:
            print(status_line(st, self.history, self.roles_expected, self.eta), file=self.stream, flush=True)
            self.last_plain = time.monotonic()

    def message(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def _table(self, st: Status):
        from rich.table import Table
        m, h = st.metrics, self.history
        t = Table(title=self.title, show_header=False, min_width=60)
        t.add_column("what", style="bold")
        t.add_column("value")
        key, text = phase_of(st, self.roles_expected)
        t.add_row("phase", text)
        if key == "warmup":
            step = warmup_step(m)
            t.add_row("warm-up", progress_text(step, warmup_total(m), h.pace("warmup", step, st.elapsed_s), at_most=True))
            t.add_row("greedy reward", f"{_fmt(m.get('warmup.greedy_reward'))}  {sparkline(h.series(h.warmup))}")
            if warmup_failures(m):
                t.add_row("rewards failed (scored 0)", warmup_failures(m))
        elif key in ("training", "final evaluation", "stopping"):  # (the figures stay on at the end)
            if self.eta is not None:
                left = self.eta.left_s(time.monotonic())
                t.add_row("steps", progress_text(st.step, st.total_steps, self.eta.pace_s(), left=left, known=True))
            else:
                t.add_row("steps", progress_text(st.step, st.total_steps, h.pace("rl", st.step, st.elapsed_s)))
            t.add_row("reward (batch mean)", f"{_fmt(m.get('reward_mean'))}  {sparkline(h.series(h.rewards))}")
            for name, value in reward_rows(m):
                t.add_row(name, value)
            if st.eval:
                t.add_row("eval (validation)", eval_cell(st.eval))
                if len(h.evals) > 1:
                    t.add_row("eval reward by round", sparkline(h.series(h.evals)))
            if key == "training":  # (the last 10 s: a final evaluation's are not counted)
                t.add_row("trajectories/s", _fmt(st.trajectories_per_s, ".1f"))
            t.add_row("staleness mean / max", f"{_fmt(m.get('staleness_mean'), '.2f')} / {m.get('staleness_max', '-')}"
                      f" versions, {_fmt(m.get('step_lag_mean'), '.2f')} / {m.get('step_lag_max', '-')} steps")
            t.add_row("pi/mu mean / max", f"{_fmt(m.get('is_ratio_mean'))} / {_fmt(m.get('is_ratio_max'))}")
            t.add_row("truncated / masked / clipped", " / ".join(
                _fmt(m.get(k), ".1%") for k in ("truncated_frac", "masked_frac", "clipped_frac")))
            t.add_row("KL(mu||pi) / entropy", f"{_fmt(m.get('kl_mu_pi'), '.4f')} / {_fmt(m.get('entropy'))}")
            t.add_row("groups dropped (too stale / no signal)",
                      f"{m.get('dropped_groups', 0)} / {st.groups_dropped_by.get('no_signal', 0)}")
            t.add_row("versions in flight", flight_text(st.versions_in_flight))
            t.add_row("trainer version", str(st.trainer_version))
            t.add_row("relay versions", versions_text(st.relay_versions))
            t.add_row("rollout versions", versions_text(st.rollout_versions))
            stall = _fmt(m.get("publish_stall_s"), ".4f")
            t.add_row("trainer wait / publish stall", f"{_fmt(m.get('wait_s'))}s / {stall}s")
        t.add_row("elapsed", f"{st.elapsed_s:.0f}s")
        return t

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
