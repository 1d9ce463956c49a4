"""Multi-turn episodes on a rollout: turns that end with tool calls leave the decode batch,
their calls run beside the decode loop (rollout/tool_runner.py), and the episode comes back
with the observation tokens appended (loss mask 0) to be prefilled and continued.

The rollout keeps one `Episode` per trajectory of an episodic task: the loss mask of the tokens
up to its last observation (the tokens after it are the model's) and its tool counts. A sequence
is in one of three places: in the engine (decoding), `parked` (its tools are running) or
`returned` (its observation is appended; it waits for a free slot). All three hold the version
it started on: the rollout loads no new weights while any is out (one version per episode).

    eps = Episodes(cfg, task, tok, tracer)            # eps.enabled: the config has tools/env
    eps.start(traj, req, problem)                     # on admission (a resumed one may run its pending call)
    ids = eps.stops(outs)                             # turns that wrote a call: abort them from the engine
    eps.turn_ended(req, finish)                       # True: parked for its tools; False: the episode is over
    for req in eps.collect(): ...                     # observations appended: add them back to the engine
(Emulated episodes' workload, drawn from the config, is emulation/emulated_episodes.py.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.rollout.engine_interface import SeqRequest
from laminar_hpc.rollout.tool_runner import ToolRunner
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.tools.episode import (
    EnvContext, Environment, last_turn, model_turns, observation_ids, pending_calls, transcript,
)
from laminar_hpc.transport.protocol import Trajectory

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


@dataclass
class Episode:
    env: Environment
    mask: list[int] = field(default_factory=list)  # up to the last observation; model tokens after
    tool_calls: int = 0
    tool_errors: int = 0
    tail: list[int] = field(default_factory=list)  # the last tokens, for the format's stop check

    def full_mask(self, n_tokens: int) -> list[int]:
        return self.mask + [1] * (n_tokens - len(self.mask))


def episode_parts(cfg: Config, tok, workload=None):
    """(format, environment class, its args) for this config, or None without episodes
    (`workload`: an emulated engine's, which its tool environment follows)."""
    if rollout_backend(cfg).emulated:
        from laminar_hpc.emulation.emulated_episodes import EmulatedFormat, EmulatedToolEnv, episodes_enabled
        if episodes_enabled(cfg.emulation):
            return EmulatedFormat(), EmulatedToolEnv, {
                "emulation": cfg.emulation, "seed": cfg.seed, "max_new_tokens": cfg.rollout.max_new_tokens,
                "workload": workload}
        return None
    if not cfg.env.enabled:
        return None
    from laminar_hpc.tasks.tools.loader import load_environment, load_format
    return load_format(cfg.env), load_environment(cfg.env), dict(cfg.env.args)


class Episodes:
    def __init__(self, cfg: Config, tok, tracer, max_len: int | None, workload=None):
        self.cfg, self.tok, self.tracer, self.max_len = cfg, tok, tracer, max_len
        parts = episode_parts(cfg, tok, workload)
        self.enabled = parts is not None
        self.state: dict[str, Episode] = {}
        self.parked: dict[str, SeqRequest] = {}
        self.returned: list[SeqRequest] = []
        # episodes that end without a model turn: no room for the observation ("length"), or
        # resumed at a call that a limit refuses ("eos"): (request, how its last turn ended)
        self.ended: list[tuple[SeqRequest, str]] = []
        self.failed: list[tuple[SeqRequest, str]] = []  # the environment's code raised for these
        self.runner: ToolRunner | None = None
        self.stop_at_call = cfg.env.stop_at_call
        if parts is not None:
            self.fmt, self.env_cls, self.args = parts
            env = cfg.env
            self.runner = ToolRunner(max_concurrent=env.max_concurrent, timeout_s=env.tool_timeout_s,
                                     max_chars=env.observation_max_chars)

    # -- bookkeeping ----------------------------------------------------------------------
    def out_of_engine(self) -> int:
        """Episodes of this version not in the engine (tools running, or waiting for a slot)."""
        return len(self.parked) + len(self.returned)

    def held_ids(self) -> list[str]:
        return [*self.parked, *(r.traj_id for r in self.returned)]

    def start(self, traj: Trajectory, req: SeqRequest, problem: Problem, mask: list[int] | None,
              tool_calls: int = 0, tool_errors: int = 0) -> bool:
        """Register an admitted episode (a resumed one with its mask and counts). Returns True
        when it is parked instead of added: it resumed with a call whose result it never got."""
        env = self.env_cls(problem, EnvContext(traj_id=traj.traj_id, seed=self.cfg.seed, args=self.args))
        ep = Episode(env, list(mask) if mask is not None else [1] * len(req.tokens), tool_calls, tool_errors,
                     req.tokens[-16:])
        self.state[traj.traj_id] = ep
        if req.tokens:
            env.restore(transcript(self.tok, req.tokens, ep.mask))
            calls = pending_calls(self.fmt, self.tok, req.tokens, ep.mask)
            if calls:  # its turn ended with calls: the same limits as when a turn ends here
                calls = self._due(req, ep, calls)
                if not calls:
                    self.ended.append((req, "eos"))
                    return True
                self._park(req, ep, calls, rerun=True)
                return True
        return False

    def stops(self, outs) -> list[str]:
        """Sequences whose turn just wrote a complete call (not finished by the engine); none
        with `env.stop_at_call: false` (turns end at their end-of-turn token, all calls written)."""
        out = []
        if not self.stop_at_call:
            return out
        for o in outs:
            ep = self.state.get(o.traj_id)
            if ep is None or o.finished or not o.tokens:
                continue
            ep.tail = (ep.tail + o.tokens)[-16:]
            if self.fmt.stopped(self.tok, ep.tail):
                out.append(o.traj_id)
        return out

    def at_call(self, tokens: list[int]) -> bool:
        """Whether a turn ending with `tokens` has just written its call and leaves the engine
        (never with `env.stop_at_call: false`, nor without episodes)."""
        return self.enabled and self.stop_at_call and bool(tokens) and self.fmt.stopped(self.tok, tokens[-16:])

    def turn_ended(self, req: SeqRequest, finish: str) -> bool:
        """A model turn ended (EOS, or its call was written). Park it for its tools and return
        True, or return False: the episode is over (no call, the environment is done, or a limit)."""
        ep = self.state.get(req.traj_id)
        if ep is None:
            return False
        a, b = last_turn(req.tokens, ep.full_mask(len(req.tokens)))
        calls = self._due(req, ep, self.fmt.turn_calls(self.tok, req.tokens[a:b]) if finish != "length" else [])
        if not calls:
            return False
        self._park(req, ep, calls)
        return True

    def _due(self, req: SeqRequest, ep: Episode, calls) -> list:
        """The calls of a model turn that run ([]: the episode is over): none when the turn made
        none, the environment says it is done, or a turn or call limit is reached; at most the
        calls left under `max_tool_calls`."""
        mask, env = ep.full_mask(len(req.tokens)), self.cfg.env
        a, b = last_turn(req.tokens, mask)
        if (not calls or ep.env.done(self.tok.decode(req.tokens[a:b]), calls)
                or model_turns(mask, len(req.tokens)) >= env.max_turns or ep.tool_calls >= env.max_tool_calls):
            return []
        return calls[:env.max_tool_calls - ep.tool_calls]

    def _park(self, req: SeqRequest, ep: Episode, calls, rerun: bool = False) -> None:
        ep.mask = ep.full_mask(len(req.tokens))
        self.parked[req.traj_id] = req
        self.runner.submit(req.traj_id, ep.env, calls)
        self._trace_waiting()
        if rerun:
            self.tracer.emit("tool_rerun", traj=req.traj_id, calls=len(calls))

    def collect(self) -> list[tuple[SeqRequest, list[int]]]:
        """Episodes whose tools came back, with the observation tokens appended to each: ready
        to be added to the engine (in `returned`, which the rollout admits first). Those without
        room for the observation and one more token end (`take_ended`, "length")."""
        if self.runner is None:
            return []
        done, back = self.runner.finished(), []
        for traj_id, results in done:
            req, ep = self.parked.pop(traj_id, None), self.state.get(traj_id)
            if req is None or ep is None:
                continue
            eos = bool(req.tokens) and req.tokens[-1] == self.tok.eos_id
            try:
                obs = observation_ids(self.fmt, self.tok, [r for r, _, _ in results], ended_with_eos=eos)
            except Exception as err:  # noqa: BLE001 - a format or template that cannot render: this episode fails
                self.failed.append((req, f"environment: observation: {type(err).__name__}: {err}"))
                continue
            for res, t_start, latency in results:
                ep.tool_calls += 1
                ep.tool_errors += res.outcome != "ok"
                self.tracer.emit("tool_call", traj=traj_id, name=res.name, t_start=t_start, latency_s=latency,
                                 outcome=res.outcome, obs_tokens=len(obs) // max(1, len(results)))
            room = req.max_new_tokens - len(req.tokens)
            if self.max_len is not None:
                room = min(room, self.max_len - len(req.prompt) - len(req.tokens))
            if len(obs) + 1 > room:
                self.ended.append((req, "length"))
                continue
            req.tokens.extend(obs)
            req.logprobs.extend([0.0] * len(obs))
            ep.mask.extend([0] * len(obs))
            ep.tail = req.tokens[-16:]
            self.returned.append(req)
            back.append((req, obs))
        if done:
            self._trace_waiting()
        return back

    def take_failed(self) -> list[tuple[SeqRequest, str]]:
        out, self.failed = self.failed, []
        return out

    def take_ended(self) -> list[tuple[SeqRequest, str]]:
        out, self.ended = self.ended, []
        return out

    def take_returned(self, n: int) -> list[SeqRequest]:
        reqs, self.returned = self.returned[:n], self.returned[n:]
        return reqs

    def take(self, traj_ids: list[str]) -> list[SeqRequest]:
        """Parked or returned episodes leaving this rollout (repack): their calls are cancelled
        (they run again where the episode resumes)."""
        wanted, out = set(traj_ids), []
        for t in [t for t in self.parked if t in wanted]:
            self.runner.cancel(t)
            out.append(self.parked.pop(t))
        keep = []
        for r in self.returned:
            (out if r.traj_id in wanted else keep).append(r)
        self.returned = keep
        if out:
            self._trace_waiting()
        return out

    def fields(self, traj_id: str, n_tokens: int) -> dict:
        """What a trajectory carries of its episode: mask (None when all the model's) and counts."""
        ep = self.state.get(traj_id)
        if ep is None:
            return {}
        mask = ep.full_mask(n_tokens)
        return {"mask": None if all(mask) else mask, "tool_calls": ep.tool_calls, "tool_errors": ep.tool_errors}

    def chunk_mask(self, traj_id: str, offset: int, n: int) -> list[int] | None:
        ep = self.state.get(traj_id)
        if ep is None or len(ep.mask) <= offset or all(ep.mask[offset:]):
            return None
        return ep.full_mask(offset + n)[offset:offset + n]

    def forget(self, traj_id: str) -> None:
        self.state.pop(traj_id, None)

    def _trace_waiting(self) -> None:
        self.tracer.emit("tool_wait", waiting=len(self.parked))

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
