"""Multi-turn episodes on a rollout, in-process, on the torch engine with a random model: a turn
that calls a tool leaves the decode batch while the others keep decoding, comes back with its
observation (loss mask 0, log-prob 0) prefilled, and a moved episode takes its pending call
with it. The format (tests/data/episode_tools.py) makes every token a turn that calls `echo`."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers import close_rollout, role_context, work_item

from laminar_hpc.rollout.main import Rollout
from laminar_hpc.tasks.tools.episode import segments
from laminar_hpc.transport.protocol import Assign, Finished, Migrate, Migrated, Stream

TOOLS = Path(__file__).resolve().parents[1] / "data" / "episode_tools.py"
OVERRIDES = (f"env.format={TOOLS}:EveryToken", f"env.environment={TOOLS}:Gated", f"env.tools.echo={TOOLS}:echo",
             "env.max_turns=3", "rollout.max_new_tokens=100", "model.max_seq_len=128", "rollout.verify_checksum=false")


def _module(r: Rollout):
    """The tools file as the rollout loaded it (its own module name): the gate is there."""
    gated = r.episodes.env_cls.__mro__[1]  # env.tools are added in a subclass of env.environment
    assert gated.__name__ == "Gated"
    return sys.modules[gated.__module__]


@pytest.fixture
def make(tmp_path):
    made = []

    def build(rank: int = 0) -> Rollout:
        from test_rollout_handlers import publish
        r = Rollout(role_context("rollout", rank, tmp_path / f"r{rank}", config="configs/tiny.yaml",
                                 overrides=OVERRIDES), relay=0)
        made.append(r)
        publish(r, 0)
        r.wait_first_version({}, r.beat)
        return r

    yield build
    for r in made:
        _module(r).OPEN.set()
        close_rollout(r)
    from test_rollout_handlers import _relay_stores
    for r in made:
        store = _relay_stores.pop(r.weights.path, None)
        if store is not None:
            store.close()


def step_until(r: Rollout, done, timeout_s: float = 30.0) -> None:
    """Run the rollout loop's parts (tool results in, admission, one decode step, streaming,
    scored results out) until `done()`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the episodes did not get there in time"
        r.turns.returns()
        r.admit(draining=False)
        if r.engine.num_active():
            r.handle(r.step())
        r.flush_streams()
        r.send_scored()
        time.sleep(0.001)  # polling the tool loop and the reward pool


def finished(r: Rollout) -> dict:
    return {m.trajectory.traj_id: m.trajectory for m in r.ctx.ctrl.of(Finished)}


def test_a_waiting_episode_leaves_the_batch_and_the_others_finish_with_their_masks(make):
    r = make()
    gate = _module(r)
    gate.GATED.clear()
    gate.GATED.add("0.0")
    gate.OPEN.clear()
    r.ctx.ctrl.inbox.append(Assign(work=[work_item(0, prompt=(5, 6, 7)), work_item(1, prompt=(5, 6, 7))]))
    r._drain_control()
    step_until(r, lambda: "0.1" in finished(r))
    # 0.1 ran its three turns while 0.0 waited for its tool outside the engine
    assert "0.0" not in finished(r) and r.episodes.out_of_engine() == 1 and r.engine.num_active() == 0
    t = finished(r)["0.1"]
    assert t.tool_calls == 2 and t.tool_errors == 0
    # turn, observation, turn, observation, turn; an observation after a turn stopped at its call
    # starts with the end-of-turn token the model did not write
    segs = segments(len(t.tokens), t.mask)
    assert [mine for mine, _, _ in segs] == [True, False, True, False, True]
    assert [b - a for mine, a, b in segs if mine] == [1, 1, 1]
    text = r.tok.encode("<tool_response>r1</tool_response>")
    for _, a, b in (s for s in segs if not s[0]):
        eos = [] if t.tokens[a - 1] == r.tok.eos_id else [r.tok.eos_id]
        assert t.tokens[a:b] == eos + text
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.mask) if m == 1)
    # the stream carried the same tokens and mask chunk by chunk (what the partial pool resumes from)
    toks, mask = [], []
    for msg in r.ctx.ctrl.of(Stream):
        for it in msg.items:
            if it.traj_id == "0.1":
                assert it.offset == len(toks)
                toks += it.tokens
                mask += it.mask if it.mask is not None else [1] * len(it.tokens)
    assert toks == t.tokens[:len(toks)] and mask == t.mask[:len(toks)]
    gate.OPEN.set()
    step_until(r, lambda: "0.0" in finished(r))
    assert finished(r)["0.0"].tool_calls == 2 and r.episodes.out_of_engine() == 0


def test_an_episode_moved_while_its_tool_runs_takes_the_pending_call_along(make):
    src, dest = make(0), make(1)
    gate = _module(src)
    gate.GATED.clear()
    gate.GATED.add("0.0")
    gate.OPEN.clear()
    src.ctx.ctrl.inbox.append(Assign(work=[work_item(0, prompt=(5, 6, 7))]))
    src._drain_control()
    step_until(src, lambda: src.episodes.out_of_engine() == 1)
    src.ctx.ctrl.inbox.append(Migrate(traj_ids=["0.0"], dest=1))
    src._drain_control()
    (moved,) = src.ctx.ctrl.of(Migrated)[-1].trajectories
    assert moved.traj_id == "0.0" and len(moved.tokens) == 1 and src.episodes.out_of_engine() == 0
    assert moved.mask is None and moved.tool_calls == 0  # one model token: its call has no observation yet
    gate.GATED.clear()
    w = work_item(0, prompt=(5, 6, 7), tokens=moved.tokens, logprobs=moved.logprobs, version=0,
                  mask=moved.mask, tool_calls=moved.tool_calls)
    dest.ctx.ctrl.inbox.append(Assign(work=[w]))
    dest._drain_control()
    step_until(dest, lambda: "0.0" in finished(dest))
    t = finished(dest)["0.0"]
    assert t.tokens[0] == moved.tokens[0] and t.tool_calls == 2 and t.mask.count(1) == 3  # the call ran again there
    from laminar_hpc.metrics.trace import role_events
    dest.ctx.tracer.flush()
    assert [e["calls"] for e in role_events(dest.ctx.run_dir, "rollout-1") if e["ev"] == "tool_rerun"] == [1]


def test_emulated_episodes_make_the_calls_of_their_plan(tmp_path):
    """The emulated engine ends a tool turn with its TOOL token (not an EOS): the rollout runs
    the call, so each episode finishes with exactly its plan's calls and tokens."""
    from test_rollout_handlers import _relay_stores, publish

    from laminar_hpc.emulation.emulated_episodes import episode_plan
    over = ("emulation.lengths.median=null", "emulation.lengths.p99_over_median=null",
            "emulation.lengths.mixture.agent.weight=1", "emulation.lengths.mixture.agent.median=40",
            "emulation.lengths.mixture.agent.p99_over_median=1.5", "emulation.lengths.mixture.agent.tools.calls=[2,3]",
            "emulation.lengths.mixture.agent.tools.latency.median_s=0.01",
            "emulation.lengths.mixture.agent.tools.latency.p99_s=0.02",
            "emulation.lengths.mixture.agent.tools.observation.median=8",
            "emulation.lengths.mixture.agent.tools.observation.p99_over_median=1.5", "env.max_turns=8")
    r = Rollout(role_context("rollout", 0, tmp_path, overrides=over), relay=0)
    try:
        publish(r, 0)
        r.wait_first_version({}, r.beat)
        r.ctx.ctrl.inbox.append(Assign(work=[work_item(i) for i in range(4)]))
        r._drain_control()
        step_until(r, lambda: len(finished(r)) == 4)
        for t in finished(r).values():
            plan = episode_plan(r.ctx.cfg.emulation, seed=r.ctx.cfg.seed, traj_id=t.traj_id, cap=512)
            assert t.tool_calls == len(plan.latencies_s) >= 2 and t.finish == "eos"
            assert t.mask is not None and t.mask.count(0) == sum(plan.observations)
    finally:
        close_rollout(r)
        store = _relay_stores.pop(r.weights.path, None)
        if store is not None:
            store.close()


def test_an_environment_that_raises_fails_its_episode_and_the_rollout_goes_on(tmp_path):
    from test_rollout_handlers import _relay_stores, publish
    over = tuple(o.replace(":Gated", ":Broken") for o in OVERRIDES)
    r = Rollout(role_context("rollout", 0, tmp_path, config="configs/tiny.yaml", overrides=over), relay=0)
    try:
        publish(r, 0)
        r.wait_first_version({}, r.beat)
        r.ctx.ctrl.inbox.append(Assign(work=[work_item(0, prompt=(5, 6, 7)), work_item(1, prompt=(5, 6, 7))]))
        r._drain_control()
        step_until(r, lambda: len(finished(r)) == 2)
        got = {t: f.finish for t, f in finished(r).items()}
        assert got == {"0.1": "error: environment: ValueError: no such row",
                       "0.0": "error: environment: KeyError: 'done'"}
        assert not r.episodes.state and not r.running and r.errors == 2
    finally:
        close_rollout(r)
        store = _relay_stores.pop(r.weights.path, None)
        if store is not None:
            store.close()


def test_a_resumed_episode_at_its_turn_limit_ends_without_running_its_pending_call(make):
    # streamed at its third turn's call (env.max_turns=3), then its rollout died before the turn
    # was scored: where it resumes, the limit holds as it would have here
    r = make()
    _module(r).GATED.clear()
    obs = [9, 10, 11]
    tokens, mask = [20, *obs, 21, *obs, 22], [1, 0, 0, 0, 1, 0, 0, 0, 1]
    w = work_item(0, prompt=(5, 6, 7), tokens=tokens, logprobs=[-0.5 if m else 0.0 for m in mask], version=0,
                  mask=mask, tool_calls=2)
    r.ctx.ctrl.inbox.append(Assign(work=[w]))
    r._drain_control()
    step_until(r, lambda: "0.0" in finished(r))
    t = finished(r)["0.0"]
    assert t.tokens == tokens and t.mask == mask and t.tool_calls == 2 and t.finish == "eos"
    from laminar_hpc.metrics.trace import role_events
    r.ctx.tracer.flush()
    assert not [e for e in role_events(r.ctx.run_dir, "rollout-0") if e["ev"] in ("tool_rerun", "tool_call")]


def test_a_turn_that_wrote_its_call_while_run_alone_after_an_engine_error_goes_to_its_tools(make):
    # the engine raises adding two episodes: each is run alone, writes its call (every token is
    # one here) and must go to its tools, neither stepped past its call nor put back in the batch
    r = make()
    _module(r).GATED.clear()
    real_add, failed = r.engine.add, []

    def add_once_failing(reqs):
        if not failed and len(reqs) == 2:
            failed.append(True)
            raise RuntimeError("transient engine error")
        return real_add(reqs)

    r.engine.add = add_once_failing
    r.ctx.ctrl.inbox.append(Assign(work=[work_item(0, prompt=(5, 6, 7)), work_item(1, prompt=(5, 6, 7))]))
    r._drain_control()
    step_until(r, lambda: len(finished(r)) == 2)
    assert failed and r.errors == 0
    for t in finished(r).values():
        segs = segments(len(t.tokens), t.mask)
        assert [b - a for mine, a, b in segs if mine] == [1, 1, 1], t.traj_id  # one token a turn, each a call
        assert t.tool_calls == 2


def test_with_stop_at_call_off_a_turn_runs_to_its_end(tmp_path):
    # every token is a call in this format: with turns stopped at their call, each is one token;
    # without, each turn runs on to its end-of-turn token (or the episode's length limit)
    from test_rollout_handlers import _relay_stores, publish
    r = Rollout(role_context("rollout", 0, tmp_path, config="configs/tiny.yaml",
                             overrides=(*OVERRIDES, "env.stop_at_call=false")), relay=0)
    try:
        publish(r, 0)
        r.wait_first_version({}, r.beat)
        _module(r).GATED.clear()
        r.ctx.ctrl.inbox.append(Assign(work=[work_item(0, prompt=(5, 6, 7))]))
        r._drain_control()
        step_until(r, lambda: "0.0" in finished(r))
        t = finished(r)["0.0"]
        turns = [(a, b) for mine, a, b in segments(len(t.tokens), t.mask) if mine]
        assert max(b - a for a, b in turns) > 1
        assert all(t.tokens[b - 1] == r.tok.eos_id for a, b in turns[:-1])  # calls ran after whole turns only
        assert t.tool_calls == len(turns) - 1
    finally:
        close_rollout(r)
        store = _relay_stores.pop(r.weights.path, None)
        if store is not None:
            store.close()
