"""Live progress of a campaign: a table on a terminal, plain log lines otherwise.

Fed with the controller's status.json (refreshed every second).
"""
from __future__ import annotations

import sys
import time

from laminar_hpc.metrics.status import Status


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _total(st: Status) -> str:
    return "?" if st.total_steps is None else str(st.total_steps)


def status_line(st: Status) -> str:
    m = st.metrics
    if st.phase == "warmup":
        return (f"warm-up step {m.get('warmup.step', 0)} greedy reward {_fmt(m.get('warmup.greedy_reward'))} "
                f"elapsed {st.elapsed_s:.0f}s")
    return (f"step {st.step}/{_total(st)} reward {_fmt(m.get('reward_mean'))}{eval_text(st)} "
            f"traj/s {_fmt(st.trajectories_per_s, '.1f')} "
            f"staleness {_fmt(m.get('staleness_mean'), '.2f')}/{m.get('staleness_max', '-')} "
            f"versions in flight {st.versions_in_flight} trainer v{st.trainer_version} "
            f"elapsed {st.elapsed_s:.0f}s")


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
        self.live = None
        if self.tty:
            from rich.console import Console
            from rich.live import Live
            self.live = Live(console=Console(file=self.stream), refresh_per_second=4, transient=False)
            self.live.start()

    def update(self, st: Status) -> None:
        if not st.t:
            return  # the controller has not written its status yet
        if self.live is not None:
            self.live.update(self._table(st))
        elif time.monotonic() - self.last_plain >= self.plain_every_s:
            print(status_line(st), file=self.stream, flush=True)
            self.last_plain = time.monotonic()

    def message(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def _table(self, st: Status):
        from rich.table import Table
        m = st.metrics
        t = Table(title=self.title, show_header=False, min_width=60)
        t.add_column("what", style="bold")
        t.add_column("value")
        if st.phase == "warmup":
            t.add_row("phase", "supervised warm-up")
            t.add_row("warm-up step", str(m.get("warmup.step", 0)))
            t.add_row("greedy reward", _fmt(m.get("warmup.greedy_reward")))
        else:
            t.add_row("step", f"{st.step} / {_total(st)}")
            t.add_row("reward (batch mean)", _fmt(m.get("reward_mean")))
            for name, value in reward_rows(m):
                t.add_row(name, value)
            if st.eval:
                t.add_row("eval (validation)", eval_cell(st.eval))
            t.add_row("trajectories/s", _fmt(st.trajectories_per_s, ".1f"))
            t.add_row("staleness mean / max", f"{_fmt(m.get('staleness_mean'), '.2f')} / {m.get('staleness_max', '-')}"
                      f" versions, {_fmt(m.get('step_lag_mean'), '.2f')} / {m.get('step_lag_max', '-')} steps")
            t.add_row("pi/mu mean / max", f"{_fmt(m.get('is_ratio_mean'))} / {_fmt(m.get('is_ratio_max'))}")
            t.add_row("truncated / masked / clipped", " / ".join(
                _fmt(m.get(k), ".1%") for k in ("truncated_frac", "masked_frac", "clipped_frac")))
            t.add_row("KL(mu||pi) / entropy", f"{_fmt(m.get('kl_mu_pi'), '.4f')} / {_fmt(m.get('entropy'))}")
            t.add_row("groups dropped (too stale / no signal)",
                      f"{m.get('dropped_groups', 0)} / {st.groups_dropped_by.get('no_signal', 0)}")
            t.add_row("versions in flight", str(st.versions_in_flight))
            t.add_row("trainer version", str(st.trainer_version))
            t.add_row("relay versions", str(st.relay_versions))
            t.add_row("rollout versions", str(st.rollout_versions))
            stall = _fmt(m.get("publish_stall_s"), ".4f")
            t.add_row("trainer wait / publish stall", f"{_fmt(m.get('wait_s'))}s / {stall}s")
        t.add_row("elapsed", f"{st.elapsed_s:.0f}s")
        return t

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
