"""The rollout's message handling, in-process: a `Rollout` on the emulated engine (no sleeping),
its controller channel a FakeChannel that records every message it sends (through the real
encode/decode) and hands it the controller's messages. Weights come from a real weight store
where the node's relay would keep them."""
from __future__ import annotations

import time

import os

import pytest
from helpers import FakeChannel, close_rollout, role_context, work_item

from laminar_hpc.rollout.main import Rollout
from laminar_hpc.transport.channel import WaitTimeout
from laminar_hpc.transport.protocol import (
    Assign, Finished, Heartbeat, Leaving, Migrate, Migrated, MigrateReject, Resume, Resync, RolloutState, Stop, Stream,
    UpdateWeights, WantWork, WeightsLoaded,
)
from laminar_hpc.transport.weight_store import WeightStore, digest_to_int

# long responses (every one ~200 tokens): a few steps leave every trajectory running
LONG = ("emulation.lengths.median=200", "emulation.lengths.p99_over_median=1.01")


_relay_stores: dict = {}  # the weight store of each test's relay (by path)


@pytest.fixture
def make(tmp_path):
    made = []

    def build(*overrides: str) -> Rollout:
        r = Rollout(role_context("rollout", 0, tmp_path, overrides=overrides), relay=0)
        made.append(r)
        return r

    yield build
    for r in made:
        close_rollout(r)
        store = _relay_stores.pop(r.weights.path, None)
        if store is not None:
            store.close()


def paused(r, newest: int) -> bool:
    """One loop iteration's weight decision (rollout/updates.py): True while the global update holds it."""
    r.updates.tick(newest)
    return r.updates.paused


def publish(r: Rollout, version: int) -> None:
    """What the node's relay does: a version into its weight store."""
    store = _relay_stores.get(r.weights.path)
    if store is None:
        store = _relay_stores[r.weights.path] = WeightStore.create(r.weights.path, 2, r.layout.nbytes)
    slot, _ = store.begin(version)
    store.commit(slot, version, r.layout.nbytes, 0, digest_to_int(r.layout.digest))


def ctrl(r: Rollout) -> FakeChannel:
    return r.ctx.ctrl


def started(r: Rollout, version: int = 0) -> Rollout:
    publish(r, version)
    r.wait_first_version({}, r.beat)
    assert ctrl(r).of(WeightsLoaded)[-1].version == version == r.engine.version
    return r


def tell(r: Rollout, *msgs) -> None:
    ctrl(r).inbox.extend(msgs)
    assert not r._drain_control()


def generate(r: Rollout, steps: int | None = None) -> None:
    """Decode steps as the loop runs them (all until the engine is empty, or `steps`), then the
    finished ones sent once the reward pool scored them (rollout/scoring.py)."""
    n = 0
    while r.engine.num_active() and (steps is None or n < steps):
        r.handle(r.engine.step())
        r.flush_streams()
        n += 1
    scored(r)


def scored(r: Rollout, timeout_s: float = 60.0) -> None:
    """Send every finished trajectory whose reward the pool is computing, once it is back."""
    deadline = time.monotonic() + timeout_s
    while r.scoring.waiting:
        r.send_scored()
        assert time.monotonic() < deadline, f"rewards of {sorted(r.scoring.waiting)} did not come back from the pool"
        time.sleep(0.002)  # polling the pool's results


def streamed(r: Rollout, traj_id: str) -> tuple[int, list[int]]:
    """(offset of the first chunk, every token) the partial-response pool received for a
    trajectory; each chunk must continue the one before."""
    start, toks = None, []
    for msg in ctrl(r).of(Stream):
        for it in msg.items:
            if it.traj_id != traj_id:
                continue
            start = it.offset if start is None else start
            assert it.offset == start + len(toks) and len(it.logprobs) == len(it.tokens)
            toks += it.tokens
    return start, toks


def test_assign_admits_work_into_the_engine_and_streams_it(make):
    r = started(make())
    tell(r, Assign(work=[work_item(0), work_item(1)]))
    assert [w.traj_id for w in r.queue] == ["0.0", "0.1"]
    r.admit(draining=False)
    assert sorted(r.engine.active_ids()) == ["0.0", "0.1"] and not r.queue
    items = {it.traj_id: it for it in ctrl(r).of(Stream)[-1].items}  # the pool learns each one's version at once
    assert set(items) == {"0.0", "0.1"}
    assert all(it.version == 0 and it.offset == 0 and len(it.tokens) == 1 for it in items.values())


def test_finished_trajectories_carry_their_work_item_and_every_token(make):
    r = started(make())
    work = [work_item(0, group=3, prompt=(5, 6, 7, 8)), work_item(1, group=3, prompt=(5, 6, 7, 8))]
    tell(r, Assign(work=work))
    r.admit(draining=False)
    generate(r)
    done = {m.trajectory.traj_id: m.trajectory for m in ctrl(r).of(Finished)}
    assert sorted(done) == ["3.0", "3.1"] and not r.running
    for w in work:
        t = done[w.traj_id]
        assert (t.group_id, t.problem, t.prompt, t.version, t.rollout) == (w.group_id, w.problem, w.prompt, 0, 0)
        assert len(t.tokens) == len(t.logprobs) and t.tokens[-1] == r.tok.eos_id and t.finish == "eos"
        assert isinstance(t.reward, float) and t.t_end >= t.t_start and t.version_last is None
        start, sent = streamed(r, w.traj_id)
        assert start == 0 and sent and t.tokens[:len(sent)] == sent  # a prefix; the finish carries every token
    r.ask_for_work(draining=False)
    assert ctrl(r).of(WantWork)[-1] == WantWork(credit=2, version=0)


def test_a_finished_result_carries_no_token_its_streams_delivered_nor_its_prompt(make):
    """Protocol 7: each token crosses the wire once. The result is the tail after what the stream
    frames delivered (`offset`), without the prompt the pool holds since admission."""
    r = started(make(*LONG))
    work = [work_item(i, prompt=(5, 6, 7, 8)) for i in range(3)]
    tell(r, Assign(work=work))
    r.admit(draining=False)
    generate(r)
    tails = {t.traj_id: t for t in ctrl(r).tails}
    assert sorted(tails) == [w.traj_id for w in work]
    for w in work:
        tail, whole = tails[w.traj_id], next(m.trajectory for m in ctrl(r).of(Finished) if m.trajectory.traj_id == w.traj_id)
        start, sent = streamed(r, w.traj_id)
        assert start == 0 and tail.offset == len(sent) > 0 and tail.prompt == []
        assert len(sent) + len(tail.tokens) == len(whole.tokens) and len(tail.logprobs) == len(tail.tokens)


def test_after_a_controller_restart_results_go_whole(make):
    """The restarted controller's pool may lack chunks sent before it went down: what was held at
    the resync finishes with every token and its prompt (no `offset`)."""
    r = started(make(*LONG))
    tell(r, Heartbeat(t=1.0, epoch="first"), Assign(work=[work_item(0, prompt=(5, 6, 7))]))
    r.admit(draining=False)
    generate(r, steps=2)
    tell(r, Heartbeat(t=2.0, epoch="second"), Assign(work=[work_item(1, prompt=(5, 6, 7))]))
    r.admit(draining=False)
    generate(r)
    assert [t.traj_id for t in ctrl(r).tails] == ["0.1"]  # taken after the resync: its streams went to this pool
    (whole,) = [m.trajectory for m in ctrl(r).of(Finished) if m.trajectory.traj_id == "0.0"]
    assert whole.offset is None and whole.prompt == [5, 6, 7] and len(whole.tokens) > 2


def test_migrated_work_goes_first_and_continues_its_tokens(make):
    r = started(make())
    fresh = work_item(0)
    moved = work_item(1, tokens=[9, 10], logprobs=[-1.0, -2.0], version=0)
    tell(r, Assign(work=[fresh, moved]))
    assert [w.traj_id for w in r.queue] == ["0.1", "0.0"]
    r.admit(draining=False)
    generate(r)
    t = next(m.trajectory for m in ctrl(r).of(Finished) if m.trajectory.traj_id == "0.1")
    assert t.tokens[:2] == [9, 10] and t.logprobs[:2] == [-1.0, -2.0] and t.version == 0
    start, sent = streamed(r, "0.1")
    assert start == 2 and t.tokens[2:2 + len(sent)] == sent  # the pool held its first two tokens already


def test_work_pinned_to_a_version_this_replica_left_is_rejected(make):
    r = make("rollout.refresh_in_flight=never")  # pure laminar: a trajectory stays on its version
    publish(r, 0)
    publish(r, 1)
    r.wait_first_version({}, r.beat)
    assert r.engine.version == 1
    tell(r, Assign(work=[work_item(0, tokens=[9], logprobs=[-1.0], version=0), work_item(1)]))
    r.admit(draining=False)
    assert ctrl(r).of(MigrateReject) == [MigrateReject(traj_ids=["0.0"])]
    assert r.engine.active_ids() == ["0.1"] and r.credit_to_return == 1


def test_migrate_hands_running_trajectories_back(make):
    r = started(make(*LONG))
    tell(r, Assign(work=[work_item(0), work_item(1)]))
    r.admit(draining=False)
    generate(r, steps=2)
    tell(r, Migrate(traj_ids=["0.0", "9.9"], dest=3))  # 9.9 finished meanwhile (not here any more)
    (msg,) = ctrl(r).of(Migrated)
    assert msg.dest == 3 and [t.traj_id for t in msg.trajectories] == ["0.0"]
    t = msg.trajectories[0]
    assert t.reward is None and t.t_end is None and t.finish is None and t.version == 0
    start, sent = streamed(r, "0.0")
    assert len(t.tokens) == len(t.logprobs) > 1 and start == 0 and t.tokens[:len(sent)] == sent
    assert r.engine.active_ids() == ["0.1"] and "0.0" not in r.running and r.credit_to_return == 1


def test_weight_targets_only_rise(make):
    r = make("mode=partial-rollout")
    tell(r, UpdateWeights(version=3), UpdateWeights(version=2), Resume(version=2), Resume(version=1))
    assert (r.updates.target_version, r.updates.resume_version) == (3, 2)


def test_a_restarted_controller_gets_what_this_replica_holds(make):
    r = started(make(*LONG))
    tell(r, Heartbeat(t=1.0, epoch="first"))  # the first epoch seen: nothing to re-send
    assert not ctrl(r).of(Resync)
    tell(r, Assign(work=[work_item(i) for i in range(3)]))
    r.admit(draining=False)
    tell(r, Assign(work=[work_item(3)]))
    tell(r, Heartbeat(t=2.0, epoch="second"))
    (msg,) = ctrl(r).of(Resync)
    assert sorted(msg.held) == ["0.0", "0.1", "0.2", "0.3"]
    assert (msg.free, msg.version, msg.pid) == (r.engine.max_batch - 4, 0, os.getpid())


def test_a_trajectory_waiting_for_its_reward_is_held_but_its_slot_is_free(make, tmp_path):
    """Its slot went back when the sequence finished: a resync that counted it as taken would
    lose that slot for the rest of the run (found in review)."""
    gate = tmp_path / "open"
    code = tmp_path / "gated.py"
    code.write_text("import os, time\n"
                    f"def score(problem, response):\n    while not os.path.exists({str(gate)!r}):\n"
                    "        time.sleep(0.01)\n    return 1.0\n")
    r = started(make(f"task.reward.fn={code}:score", "rollout.max_new_tokens=2"))
    tell(r, Assign(work=[work_item(0, max_new_tokens=2)]))
    r.admit(draining=False)
    while r.engine.num_active():
        r.handle(r.engine.step())
    assert list(r.scoring.waiting) == ["0.0"] and not r.running  # finished, its reward still being computed
    tell(r, Heartbeat(t=1.0, epoch="first"), Heartbeat(t=2.0, epoch="second"))
    (msg,) = ctrl(r).of(Resync)
    assert msg.held == ["0.0"] and msg.free == r.engine.max_batch
    opened = time.time()
    gate.write_text("")
    scored(r)
    assert [m.trajectory.traj_id for m in ctrl(r).of(Finished)] == ["0.0"]
    assert ctrl(r).of(Finished)[0].trajectory.t_end < opened  # when generation ended, not when it was scored


def test_partial_rollout_continues_interrupted_trajectories_on_the_new_version(make):
    r = started(make("mode=partial-rollout", *LONG))
    tell(r, Assign(work=[work_item(0)]))
    r.admit(draining=False)
    generate(r, steps=1)
    publish(r, 1)
    tell(r, UpdateWeights(version=1))
    assert paused(r, 1) and r.engine.version == 1 and not r.engine.num_active()  # paused, loaded
    assert paused(r, 1)  # the others are still loading
    tell(r, Resume(version=1))
    assert not paused(r, 1) and r.engine.active_ids() == ["0.0"]
    generate(r)
    (msg,) = ctrl(r).of(Finished)
    assert (msg.trajectory.version, msg.trajectory.version_last) == (0, 1)


def test_partial_rollout_generates_on_until_its_relay_holds_the_new_version(make):
    """`partial_rollout.pause_at: relay` (the default): told of version 1 before its relay holds it,
    the replica keeps decoding, its engine call ends when the version lands, then it pauses and loads."""
    r = started(make("mode=partial-rollout", *LONG))
    tell(r, Assign(work=[work_item(0)]))
    r.admit(draining=False)
    tell(r, UpdateWeights(version=1))
    assert not paused(r, 0) and r.engine.active_ids() == ["0.0"]  # not in the relay yet: generating
    generate(r, steps=1)
    assert streamed(r, "0.0")[1]  # decoded (and streamed) meanwhile
    r.newest_seen = r.weights.newest()  # what the loop looked at before this engine call
    assert not r.arrived(0.0)  # nothing new in the relay
    publish(r, 1)
    assert r.arrived(0.0)  # the engine call ends at the next decode step
    assert paused(r, 1) and r.engine.version == 1 and not r.engine.num_active()
    tell(r, Resume(version=1))
    assert not paused(r, 1) and r.engine.active_ids() == ["0.0"]


def test_partial_rollout_pausing_at_the_publish_waits_idle_for_its_relay(make):
    r = started(make("mode=partial-rollout", "partial_rollout.pause_at=publish", *LONG))
    tell(r, Assign(work=[work_item(0)]))
    r.admit(draining=False)
    tell(r, UpdateWeights(version=1))
    assert paused(r, 0) and not r.engine.num_active() and r.engine.version == 0  # stopped, nothing to load yet
    r.newest_seen = r.weights.newest()
    assert not r.arrived(0.0)  # a paused replica makes no engine call to cut short
    publish(r, 1)
    assert paused(r, 1) and r.engine.version == 1


def test_stop_before_the_first_weights_ends_the_role(make):
    r = make()
    ctrl(r).inbox.append(Stop(reason="the campaign is over"))
    assert r.wait_first_version({}, r.beat) is False
    r.run({})  # returns at once: nothing was generated or asked for
    assert not ctrl(r).of(WantWork) and r.engine.version < 0


def test_a_leaving_joiner_streams_every_token_it_holds_before_it_says_so(make):
    r = started(make(*LONG))
    tell(r, Assign(work=[work_item(0, max_new_tokens=400), work_item(1, max_new_tokens=400)]))
    r.admit(draining=False)
    r.handle(r.engine.step())  # tokens generated, not streamed yet (stream_every_tokens)
    held = {t: len(r.running[t].tokens) + len(r.stream.buf.get(t, ([], []))[0]) for t in r.running}
    r.leave(grace_s=1.0)  # (main() calls it for a joiner on SIGTERM)
    (msg,) = ctrl(r).of(Leaving)
    assert sorted(msg.held) == ["0.0", "0.1"]
    sent = ctrl(r).sent
    assert all(isinstance(m, Stream) for m in sent[sent.index(msg) - 1:sent.index(msg)])  # streamed first
    for t in held:
        assert len(streamed(r, t)[1]) == r.stream.streamed[t] > 0  # every token it had reached the pool


def test_the_loop_serves_assigned_work_until_stop(make):
    """`run` as the process runs it: asks for work, generates what it is given, reports its state,
    and returns when the controller says stop."""
    r = make()
    publish(r, 0)
    work = [work_item(i) for i in range(4)]
    calls, assigned = [0], []

    def controller(ch: FakeChannel):
        calls[0] += 1
        assert calls[0] < 100_000, "the rollout loop did not finish its work"
        if not assigned and ch.of(WantWork):
            assigned.append(True)
            return [Assign(work=work)]
        if len(ch.of(Finished)) == len(work):
            return [Stop(reason="done")]
        return []

    ctrl(r).script = controller
    r.run({})
    asks = ctrl(r).of(WantWork)
    assert asks[0] == WantWork(credit=r.engine.max_batch, version=0)
    assert sorted(m.trajectory.traj_id for m in ctrl(r).of(Finished)) == [w.traj_id for w in work]
    assert ctrl(r).of(RolloutState)  # its batch and KV, for the rollout manager
    assert r.stopping and not r.engine.num_active()


# ------------------------------------------------------------------------------------------
# laminar's refresh in flight (rollout/updates.py: ReplicaRefresh)
# ------------------------------------------------------------------------------------------

def _finished(r: Rollout) -> dict:
    return {m.trajectory.traj_id: m.trajectory for m in ctrl(r).of(Finished)}


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_refresh_in_flight_continues_the_sequences_under_the_new_version(make, kv):
    r = started(make(*LONG, "rollout.refresh_in_flight=always", f"rollout.refresh_kv={kv}"))
    tell(r, Assign(work=[work_item(0), work_item(1)]))
    r.admit(draining=False)
    generate(r, steps=1)
    before = {t: len(streamed(r, t)[1]) for t in ("0.0", "0.1")}
    prefill = r.engine.busy_emulated_s
    publish(r, 1)
    assert not r.updates.tick(newest=1)  # nothing drains
    assert r.engine.version == 1 and sorted(r.engine.active_ids()) == ["0.0", "0.1"]
    repaid = r.engine.busy_emulated_s - prefill  # keep: no re-prefill; recompute: prompt + tokens again
    expected = sum(3 + n for n in before.values())
    assert repaid == (0.0 if kv == "keep" else pytest.approx(r.engine.cost.prefill_s(expected)))
    generate(r)
    done = _finished(r)
    for tid, n in before.items():
        t = done[tid]
        assert (t.version, t.version_last, t.version_spans) == (0, 1, [(0, 0), (n, 1)])
        chunks = [it for m in ctrl(r).of(Stream) for it in m.items if it.traj_id == tid]
        assert {it.version for it in chunks if it.offset < n} == {0} and {it.version for it in chunks
                                                                         if it.offset >= n} == {1}
    assert [m.version for m in ctrl(r).of(WeightsLoaded)] == [0, 1]


def test_underfull_drains_a_full_batch_and_switches_below_its_fraction(make):
    r = started(make(*LONG, "rollout.refresh_in_flight=underfull", "rollout.refresh_below=0.5",
                     "rollout.max_batch=4"))
    tell(r, Assign(work=[work_item(i) for i in range(3)]))
    r.admit(draining=False)
    publish(r, 1)
    assert r.updates.tick(newest=1) and r.engine.version == 0  # 3 of 4 running: drain
    r.migrate(["0.2"], dest=1)  # one leaves: 2 of 4 is not below half
    assert r.updates.tick(newest=1) and r.engine.version == 0
    r.migrate(["0.1"], dest=1)  # 1 of 4: below half, it switches in flight
    assert not r.updates.tick(newest=1) and r.engine.version == 1 and r.engine.active_ids() == ["0.0"]


@pytest.mark.parametrize("refresh, taken", [("always", True), ("never", False)])
def test_moved_work_of_an_older_version_is_taken_only_when_versions_are_recorded_per_span(make, refresh, taken):
    r = started(make(*LONG, f"rollout.refresh_in_flight={refresh}"), version=2)
    tell(r, Assign(work=[work_item(0, tokens=[7, 8, 9], logprobs=[-1.0] * 3, version=1)]))
    r.admit(draining=False)
    if not taken:
        assert ctrl(r).of(MigrateReject)[0].traj_ids == ["0.0"] and not r.engine.num_active()
        return
    assert not ctrl(r).of(MigrateReject) and r.engine.active_ids() == ["0.0"]
    generate(r)
    t = _finished(r)["0.0"]
    assert t.tokens[:3] == [7, 8, 9] and (t.version, t.version_spans, t.version_last) == (1, [(0, 1), (3, 2)], 2)


@pytest.mark.parametrize("mode", ["laminar", "partial-rollout"])
def test_a_message_or_a_newer_version_ends_an_emulated_macro_step(make, mode):
    """The emulated engine's `wake` (emulation.step_interrupts): a control message ends a macro step
    in every mode, a newer version in the relay only a laminar replica's (it refreshes on its own)."""
    r = started(make(*LONG, f"mode={mode}"))
    assert r.engine.wake == r.arrived
    r.newest_seen = r.weights.newest()
    assert not r.arrived(0.0)
    publish(r, 1)
    assert r.arrived(0.0) == (mode == "laminar")
    r.newest_seen = 1
    assert not r.arrived(0.0)
    ctrl(r).inbox.append(Assign(work=[]))
    assert r.arrived(0.0)


def test_the_first_weights_are_waited_for_past_the_timeout_while_the_trainer_progresses(make):
    """Issue 35: a warm-up longer than timeouts.weights_s killed every rollout waiting for the first
    version, again and again. The controller's heartbeat answers say how long the trainer has been
    quiet: a rollout waits while that stays under the timeout."""
    r = make("timeouts.weights_s=0.2")
    t0 = time.monotonic()

    def controller(ch: FakeChannel):
        if time.monotonic() - t0 > 0.6:
            publish(r, 0)  # the warm-up ends: the first version reaches the relay
        return [Heartbeat(t=1.0, epoch="e", echo=0.0, trainer_quiet_s=0.01)]

    ctrl(r).script = controller
    assert r.wait_first_version({}, r.beat) and r.engine.version == 0
    assert time.monotonic() - t0 > 0.6  # three times the timeout


@pytest.mark.parametrize("quiet", [50.0, None])
def test_a_rollout_gives_up_on_the_first_weights_once_the_trainer_is_silent(make, quiet):
    r = make("timeouts.weights_s=0.2")
    ctrl(r).script = lambda ch: [Heartbeat(t=1.0, epoch="e", echo=0.0, trainer_quiet_s=quiet)]
    with pytest.raises(WaitTimeout, match="silent for 50s" if quiet else "never heard of"):
        r.wait_first_version({}, r.beat)
