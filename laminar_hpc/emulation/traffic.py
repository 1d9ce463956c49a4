"""The control-plane traffic an emulated campaign sends its controller: messages and tokens per
second, by message type, derived from the config (its cost model, lengths and cadences).

The campaign runs at its ideal (emulation/ideal.py: `lambda` trajectories/s over R replicas
decoding B' sequences each; docs/goodput.md). What reaches the controller per second:

    finished        lambda                          no token: its stream frames delivered them (protocol 7)
    want_work       lambda                          at most one per finish (credit goes back at once)
    stream (admit)  lambda                          the prefill's first token of each admitted one
    stream (decode) R * steps_per_s / k             B' items of k tokens each on average
    rollout_state   R * calls * (passes that report: repack.state_interval_s since the last report)
    heartbeat       R * min(1 / supervisor.heartbeat_interval_s, calls) + (relays + 2) / that interval
    trainer, relays a few per train step (train_step, published, want_groups; version_ready and
                    weights_loaded per version)

(a rollout reports its state and beats at most once per pass of its loop, i.e. per engine call:
`calls` = engine calls per replica and second). steps_per_s = lambda (E[L] - 1) / (R B') decode
steps per replica and second, calls = steps_per_s / steps_per_call. k is the decode
steps between two stream frames of a replica: `rollout.stream_every_tokens` engine calls, and an
engine call is one decode step for a real engine ("decode-step" cadence) but a macro step for the
emulated one ("engine-call": up to `emulation.max_macro_steps` steps, never past the next sequence
to finish and, with emulation.step_interrupts, ended by a control message's arrival: `call_steps`;
`mean_macro_steps` is a seeded Monte Carlo of one full replica). Tokens count token ids
in frames to the controller: each response token crosses once, in a stream frame, with its
float32 log-prob; a finished result carries only what its frames did not deliver
(`Trajectory.offset`: at most the last engine call's tokens, counted here with the frames) and
no prompt, which the controller holds since admission.

    t = campaign_traffic(cfg)                       # cfg: a (scaled) preset, e.g. 512 x B=64
    t.messages_per_s, t.tokens_per_s, t.by_type["rollout_state"]
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.emulation.cost import lognormal_sigma
from laminar_hpc.emulation.ideal import Ideal, config_moments, ideal_for_config

if TYPE_CHECKING:
    from laminar_hpc.config import Config

CADENCES = ("engine-call", "decode-step")


@dataclass(frozen=True)
class Traffic:
    ideal_trajectories_per_s: float
    replicas: int
    batch: float  # B'
    decode_step_s: float  # T(B')
    steps_per_call: float  # decode steps per engine call (k = steps_per_call * stream_every_tokens)
    steps_per_stream: float
    mean_response: float
    prompt_tokens: int
    cadence: str
    by_type: dict[str, float] = field(default_factory=dict)  # messages/s to the controller
    tokens_by_type: dict[str, float] = field(default_factory=dict)  # token ids/s in them

    @property
    def messages_per_s(self) -> float:
        return sum(self.by_type.values())

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens_by_type.values())

    def as_dict(self) -> dict:
        return {**asdict(self), "messages_per_s": self.messages_per_s, "tokens_per_s": self.tokens_per_s}


def call_steps(most: int, to_finish: int, cut: bool) -> int:
    """Decode steps of one call of the emulated engine (rollout/emulated_engine.py `step`): up to `most`
    (max_macro_steps), never past the next sequence to finish (`to_finish` steps away). With
    emulation.step_interrupts a call ends at the decode step in which a control message arrives:
    `cut` when the loop just asked for work with the credit of a finish, or beat (the answer
    arrives within one decode step: a controller round trip is shorter than a step)."""
    return 1 if cut else max(1, min(most, to_finish))


def mean_macro_steps(cfg: Config, batch: int, step_s: float, *, calls: int = 20_000, seed: int = 0) -> float:
    """Mean decode steps per call of the emulated engine (`call_steps`): `engine_calls`' first figure."""
    return engine_calls(cfg, batch, step_s, calls=calls, seed=seed)[0]


def engine_calls(cfg: Config, batch: int, step_s: float, *, calls: int = 20_000, seed: int = 0) -> tuple[float, float]:
    """(decode steps per call, state reports per call) of the emulated engine (`call_steps`) on a
    replica kept full with `batch` sequences, each a decode step of `step_s` seconds, its loop
    beating every supervisor.heartbeat_interval_s and reporting its state on a pass at least
    repack.state_interval_s after the last report. Lengths: the config's log-normal (capped,
    rounded); a mixture or empirical list by its mean."""
    lg, most = cfg.emulation.lengths, cfg.emulation.max_macro_steps
    cap = min(cfg.rollout.max_new_tokens, lg.max_tokens)
    interrupts = cfg.emulation.step_interrupts
    beat = cfg.supervisor.heartbeat_interval_s / step_s  # decode steps between heartbeats
    rng = np.random.default_rng(seed)
    plain = getattr(lg, "mixture", None) is None and getattr(lg, "empirical", None) is None

    def draw(n: int) -> np.ndarray:  # decode steps after the prefill's token: L - 1
        if plain:
            raw = lg.median * np.exp(lognormal_sigma(lg.p99_over_median) * rng.standard_normal(n))
            length = np.minimum(cap, np.maximum(lg.min_tokens, np.rint(raw)))
        else:
            length = rng.exponential(config_moments(cfg).mean, n).round().clip(1, cap)
        return np.maximum(1, length - 1)

    state = cfg.repack.state_interval_s / step_s
    left = draw(batch)
    steps, t, next_beat, cut, last_state, states = 0, 0.0, beat * rng.random(), False, -math.inf, 0
    for _ in range(calls):
        s = call_steps(most, int(left.min()), cut)
        left -= s
        steps += s
        t += s
        if t - last_state >= state:
            last_state, states = t, states + 1
        done = left <= 0
        beat_due = t >= next_beat
        if beat_due:
            next_beat += beat
        cut = interrupts and (bool(done.any()) or beat_due)
        if done.any():
            left[done] = draw(int(done.sum()))
    return steps / calls, states / calls


def campaign_traffic(cfg: Config, *, cadence: str | None = None, ideal: Ideal | None = None) -> Traffic:
    """What the campaign of `cfg` sends its controller per second at its ideal (module doc).
    `cadence`: "engine-call" (the emulated engine's macro steps; the default for an emulated
    rollout backend) or "decode-step" (an engine call is one decode step: a real engine)."""
    if cadence is None:
        cadence = "engine-call" if rollout_backend(cfg).emulated else "decode-step"
    if cadence not in CADENCES:
        raise ValueError(f"cadence {cadence!r}: use one of {', '.join(CADENCES)}")
    ide = ideal or ideal_for_config(cfg)
    lam, R, B = ide.trajectories_per_s, ide.replicas, ide.batch
    L, P = ide.mean_response, ide.prompt_tokens
    step_s = ide.step_base_s + ide.step_per_seq_s * B
    per_call, states_per_call = engine_calls(cfg, max(1, round(B)), step_s) if cadence == "engine-call" else (1.0, None)
    k = per_call * cfg.rollout.stream_every_tokens
    steps_per_s = lam * max(0.0, L - 1) / (R * B)  # decode steps per replica and second, at the ideal
    decode_frames = R * steps_per_s / k
    calls = steps_per_s / per_call  # passes of a rollout's loop per second
    relays = cfg.relay.count
    beat = 1.0 / cfg.supervisor.heartbeat_interval_s
    step_period = cfg.trainer.groups_per_step * cfg.trainer.group_size / lam  # seconds per train step
    by_type = {
        "stream_decode": decode_frames,
        "stream_admit": lam,
        "finished": lam,
        "want_work": lam,
        "rollout_state": R * (calls * states_per_call if states_per_call is not None
                              else min(1.0 / cfg.repack.state_interval_s, calls)),
        "heartbeat": R * min(beat, calls) + (relays + 2) * beat,
        # train_step, published, want_groups; version_ready; weights_loaded
        "per_version": (3 + relays + R) / step_period,
    }
    tokens = {
        "stream_decode": lam * max(0.0, L - 1),
        "stream_admit": lam,
        "finished": 0.0,
    }
    return Traffic(ideal_trajectories_per_s=lam, replicas=R, batch=B, decode_step_s=step_s, steps_per_call=per_call,
                   steps_per_stream=k, mean_response=L, prompt_tokens=P, cadence=cadence,
                   by_type={k_: v for k_, v in by_type.items() if math.isfinite(v)}, tokens_by_type=tokens)
