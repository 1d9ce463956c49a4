"""Emulation: cost model, clock, response lengths (laminar_hpc/emulation/cost.py) and the emulated
rollout engine (laminar_hpc/rollout/emulated_engine.py) with real weight bytes (emulation/emulated_weights.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from laminar_hpc.emulation import cost as cost_mod
from laminar_hpc.emulation.cost import Clock, CostModel, lognormal_sigma, response_length
from laminar_hpc.emulation.emulated_weights import EmulatedWeights
from laminar_hpc.transport.weight_store import checksum as store_checksum
from laminar_hpc.rollout.engine_interface import SeqRequest, VersionInFlightError
from laminar_hpc.rollout.emulated_engine import EmulatedEngine

EOS = 1
VOCAB = 50
NBYTES = 4096


def lengths(**kw):
    d = dict(median=40, p99_over_median=4.0, min_tokens=2, max_tokens=400)
    d.update(kw)
    return SimpleNamespace(**d)


def emu(**kw):
    d = dict(time_scale=0.0, prefill_base_ms=5.0, prefill_per_token_us=20.0, decode_base_ms=12.0,
             decode_per_seq_us=30.0, decode_per_kv_token_ns=7.0, train_per_token_us=3.0,
             nominal_weight_gb=16.0, pull_gbps=8.0, max_macro_steps=16, step_interrupts=True, lengths=lengths())
    d.update(kw)
    return SimpleNamespace(**d)


# -- cost model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, kv, steps", [(1, 0, 1), (1, 100, 7), (32, 40_000, 128), (5, 17, 1),
                                              (3, 0, 0), (64, 123_456, 513)])
def test_decode_steps_equals_the_per_step_sum(batch, kv, steps):
    e = emu()
    m = CostModel(e)
    explicit = sum(e.decode_base_ms * 1e-3 + e.decode_per_seq_us * 1e-6 * batch
                   + e.decode_per_kv_token_ns * 1e-9 * (kv + batch * i) for i in range(steps))
    assert m.decode_steps_s(batch, kv, steps) == pytest.approx(explicit, rel=1e-12, abs=1e-15)


def test_decode_steps_compose():
    # n steps then m steps from where the KV got to == n + m steps at once
    m = CostModel(emu())
    whole = m.decode_steps_s(8, 1000, 30)
    assert m.decode_steps_s(8, 1000, 12) + m.decode_steps_s(8, 1000 + 8 * 12, 18) == pytest.approx(whole)


def test_prefill_train_weight_load():
    e = emu()
    m = CostModel(e)
    assert m.prefill_s(0) == 0.0
    assert m.prefill_s(1) == pytest.approx(5e-3 + 20e-6)
    assert m.prefill_s(1000) == pytest.approx(5e-3 + 20e-3)
    # affine: equal increments for equal token increments
    assert m.prefill_s(3000) - m.prefill_s(2000) == pytest.approx(m.prefill_s(2000) - m.prefill_s(1000))
    assert m.train_s(0) == 0.0
    assert m.train_s(1_000_000) == pytest.approx(3.0)
    assert m.train_s(2_000_000) == pytest.approx(2 * m.train_s(1_000_000))
    assert m.weight_load_s() == pytest.approx(2.0)
    assert CostModel(emu(pull_gbps=0)).weight_load_s() == 0.0


# -- response lengths ---------------------------------------------------------------------------

def test_lognormal_sigma():
    assert lognormal_sigma(1.0) == 0.0
    # p99 of exp(sigma * N(0,1)) is exp(sigma * z99)
    assert math.exp(lognormal_sigma(5.0) * 2.3263478740408408) == pytest.approx(5.0)


def test_response_length_deterministic_per_trajectory():
    lg = lengths()
    a = [response_length(lg, seed=3, traj_id=f"7.{i}", cap=10_000) for i in range(200)]
    b = [response_length(lg, seed=3, traj_id=f"7.{i}", cap=10_000) for i in range(200)]
    assert a == b
    assert len(set(a)) > 20  # not a constant
    c = [response_length(lg, seed=4, traj_id=f"7.{i}", cap=10_000) for i in range(200)]
    assert a != c  # the seed matters
    # order of calls does not matter (no hidden state)
    assert [response_length(lg, seed=3, traj_id=f"7.{i}", cap=10_000) for i in reversed(range(200))] == a[::-1]


def test_response_length_bounds():
    lg = lengths(median=40, p99_over_median=20.0, min_tokens=5, max_tokens=120)
    draws = [response_length(lg, seed=0, traj_id=str(i), cap=10_000) for i in range(3000)]
    assert min(draws) == 5 and max(draws) == 120  # both clamps are reached with this spread
    capped = [response_length(lg, seed=0, traj_id=str(i), cap=60) for i in range(3000)]
    assert max(capped) == 60 and min(capped) == 5
    assert all(c == min(d, 60) for c, d in zip(capped, draws))  # the cap only clips


def test_response_length_distribution():
    lg = lengths(median=200, p99_over_median=6.0, min_tokens=1, max_tokens=10**9)
    draws = np.array([response_length(lg, seed=11, traj_id=f"{i // 64}.{i % 64}", cap=10**9)
                      for i in range(20_000)])
    median = np.median(draws)
    p99 = np.percentile(draws, 99)
    assert median == pytest.approx(200, rel=0.10)
    assert p99 / median == pytest.approx(6.0, rel=0.25)


# -- clock --------------------------------------------------------------------------------------

class FakeTime:
    """Stands in for time.monotonic/time.sleep in the cost module: sleeping advances the clock."""

    def __init__(self, t=100.0):
        self.t = t
        self.sleeps = []
        self.monotonic_drift = 0.0  # added to the clock by every monotonic() call (a slow machine)

    def monotonic(self):
        self.t += self.monotonic_drift
        return self.t

    def sleep(self, s):
        assert s > 0
        self.sleeps.append(s)
        self.t += s


@pytest.fixture
def fake_time(monkeypatch):
    ft = FakeTime()
    monkeypatch.setattr(cost_mod.time, "monotonic", ft.monotonic)
    monkeypatch.setattr(cost_mod.time, "sleep", ft.sleep)
    return ft


def test_clock_time_scale_zero_never_sleeps(fake_time):
    c = Clock(0.0)
    for _ in range(100):
        c.spend(5.0)
    assert fake_time.sleeps == []
    assert c.behind_s == 0.0  # the fake clock does not move by itself


def test_clock_scales_and_sleeps_on_time(fake_time):
    c = Clock(0.5)
    for d in (1.0, 2.0, 0.25):
        c.spend(d)
    assert fake_time.sleeps == pytest.approx([0.5, 1.0, 0.125])
    assert fake_time.t == pytest.approx(101.625)
    assert c.behind_s == 0.0


def test_clock_behind_accumulates_when_late(fake_time):
    # each monotonic() call costs 0.3 s of wall time: a 0.1 s scaled spend cannot be kept
    c = Clock(1.0)
    fake_time.monotonic_drift = 0.3
    c.spend(0.1)
    c.spend(0.1)
    assert fake_time.sleeps == []
    assert c.behind_s == pytest.approx(2 * (0.3 - 0.1))
    # back to a fast machine: on time again, no more lateness
    fake_time.monotonic_drift = 0.0
    c.spend(1.0)
    assert fake_time.sleeps == pytest.approx([1.0])
    assert c.behind_s == pytest.approx(0.4)


def test_clock_idle_gap_is_not_lateness(fake_time):
    c = Clock(1.0)
    c.spend(1.0)
    fake_time.t += 50.0  # idle for a long while
    c.spend(1.0)
    assert fake_time.sleeps == pytest.approx([1.0, 1.0])
    assert c.behind_s == 0.0


def test_clock_absorbs_overhead_between_spends(fake_time):
    c = Clock(1.0)
    c.spend(1.0)
    fake_time.t += 0.25  # the caller's Python work between two steps
    c.spend(1.0, chain=True)  # the next step of a busy engine
    assert fake_time.sleeps == pytest.approx([1.0, 0.75])  # second deadline at 102.0, absolute


def test_clock_behind_counts_slow_caller(fake_time):
    c = Clock(1.0)
    for _ in range(5):
        c.spend(0.1, chain=True)
        fake_time.t += 0.3  # work between steps takes longer than the step itself
    assert c.behind_s > 0.5


# -- emulated engine ----------------------------------------------------------------------------

class Model:
    def __init__(self, array):
        self.array = array


def published(version_byte, nbytes=NBYTES):
    """Weights packed into a buffer as the trainer would publish them."""
    layout = EmulatedWeights(nbytes)
    src = Model(((np.arange(nbytes) * 7 + version_byte) % 251).astype(np.uint8))
    buf = bytearray(nbytes)
    layout.pack(src, memoryview(buf))
    return memoryview(buf), layout, src.array


def engine(*, max_batch=8, loaded=True, seed=0, length_seed=None, **kw):
    e = EmulatedEngine(emu(**kw), seed=seed, eos_id=EOS, vocab_size=VOCAB, max_batch=max_batch, nbytes=NBYTES,
                       length_seed=length_seed)
    if loaded:
        buf, layout, _ = published(1)
        e.load_weights(1, buf, layout)
    return e


def req(tid, prompt_len=5, max_new=1000, tokens=(), logprobs=()):
    return SeqRequest(tid, list(range(10, 10 + prompt_len)), max_new, list(tokens), list(logprobs))


def run_to_end(e, outs=None, calls=None):
    """Steps until idle (or `calls` steps); checks per step that the macro step stops at the first
    sequence to finish. Returns the finished trajectories by id."""
    finished = {}
    for o in outs or []:
        if o.finished:
            finished[o.traj_id] = o.request
    for _ in range(calls or 100_000):
        if not e.num_active():
            return finished
        before = {s.req.traj_id: s.target - len(s.req.tokens) for s in e.active}
        outs = e.step()
        left = min(before.values())
        steps = min(e.emu.max_macro_steps, left)
        assert {o.traj_id for o in outs} == set(before)
        for o in outs:
            assert len(o.tokens) == len(o.logprobs) == steps  # never past the next sequence's end
            assert o.finished == (before[o.traj_id] == steps)
            if o.finished:
                assert o.request is not None and o.request.tokens[-1] == EOS
                finished[o.traj_id] = o.request
            else:
                assert o.request is None
        if steps == left:
            assert any(o.finished for o in outs)  # the one that reached its end finished in this output
    if calls:
        return finished
    raise AssertionError("engine did not drain")


def test_trajectories_end_at_their_drawn_length():
    e = engine(max_batch=16)
    reqs = [req(f"0.{i}", prompt_len=3 + i, max_new=1000) for i in range(16)]
    finished = run_to_end(e, e.add(reqs))
    assert set(finished) == {r.traj_id for r in reqs}
    for r in reqs:
        want = response_length(e.emu.lengths, seed=0, traj_id=r.traj_id, cap=1000)
        got = finished[r.traj_id]
        assert got is r  # the request itself carries the trajectory
        assert len(got.tokens) == len(got.logprobs) == want
        assert got.tokens[-1] == EOS and EOS not in got.tokens[:-1]
        assert all(4 <= t < VOCAB for t in got.tokens[:-1])
        assert all(lp <= 0 for lp in got.logprobs)
    assert e.num_active() == 0 and e.kv_tokens() == 0 and e.free_slots() == 16


def test_max_new_tokens_caps_the_length():
    e = engine(lengths=lengths(median=200, p99_over_median=2.0, min_tokens=2, max_tokens=10_000))
    reqs = [req(f"1.{i}", max_new=7) for i in range(4)]
    finished = run_to_end(e, e.add(reqs))
    assert [len(finished[r.traj_id].tokens) for r in reqs] == [7] * 4
    assert all(finished[r.traj_id].tokens[-1] == EOS for r in reqs)


def test_max_new_tokens_below_min_tokens_is_still_a_cap():
    e = engine(lengths=lengths(min_tokens=4))
    finished = run_to_end(e, e.add([req("2.0", max_new=2)]))
    assert len(finished["2.0"].tokens) <= 2


def test_one_token_trajectory_finishes_at_prefill():
    e = engine(lengths=lengths(median=1, p99_over_median=1.0, min_tokens=1, max_tokens=1))
    outs = e.add([req("3.0"), req("3.1")])
    assert [o.finished for o in outs] == [True, True]
    assert [o.tokens for o in outs] == [[EOS], [EOS]]
    assert e.num_active() == 0 and e.step() == []


def test_macro_steps_bounded_by_config():
    e = engine(max_macro_steps=3, lengths=lengths(median=50, p99_over_median=1.0, min_tokens=50, max_tokens=50))
    outs = e.add([req("4.0")])
    assert len(outs[0].tokens) == 1
    sizes = []
    while e.num_active():
        sizes.append(len(e.step()[0].tokens))
    assert sizes == [3] * 16 + [1]  # 1 + 16 * 3 + 1 = 50


def test_kv_tokens_accounting():
    e = engine(max_batch=4, lengths=lengths(median=30, p99_over_median=1.0, min_tokens=30, max_tokens=30))
    assert e.kv_tokens() == 0
    e.add([req("5.0", prompt_len=10), req("5.1", prompt_len=4)])
    assert e.kv_tokens() == 10 + 4 + 2  # prompts plus the token each prefill sampled
    outs = e.step()
    n = len(outs[0].tokens)
    assert e.kv_tokens() == 10 + 4 + 2 * (1 + n)
    e.add([req("5.2", prompt_len=7)])
    assert e.kv_tokens() == sum(len(s.req.prompt) + len(s.req.tokens) for s in e.active) == 10 + 4 + 2 * (1 + n) + 8
    assert e.active_ids() == ["5.0", "5.1", "5.2"]
    run_to_end(e)
    assert e.kv_tokens() == 0


def test_abort_and_readd_keeps_the_drawn_length():
    a = engine(max_batch=4)
    ids = [f"6.{i}" for i in range(4)]
    targets = {t: response_length(a.emu.lengths, seed=0, traj_id=t, cap=1000) for t in ids}
    early = run_to_end(a, a.add([req(t) for t in ids]), calls=1)  # one macro step: all have progress
    live = a.active_ids()
    assert len(live) >= 2 and all(len(s.req.tokens) >= 2 for s in a.active)
    progress = {s.req.traj_id: len(s.req.tokens) for s in a.active}
    moved = a.abort(live[:2] + ["not-there"])
    assert [r.traj_id for r in moved] == live[:2]
    assert {r.traj_id: len(r.tokens) for r in moved} == {t: progress[t] for t in live[:2]}
    assert all(len(r.tokens) == len(r.logprobs) for r in moved)
    assert a.active_ids() == live[2:] and a.free_slots() == 2
    # the migrated trajectories continue elsewhere (same seed: same length distribution draw)
    b = engine(max_batch=4)
    prefix = {r.traj_id: list(r.tokens) for r in moved}
    kv_before = sum(len(r.prompt) + len(r.tokens) for r in moved)
    outs = b.add(moved)
    assert b.kv_tokens() == kv_before + sum(1 for o in outs if not o.finished)
    done = run_to_end(b, outs)
    done.update(run_to_end(a))
    done.update(early)
    assert set(done) == set(ids)
    for t in ids:
        assert len(done[t].tokens) == len(done[t].logprobs) == targets[t]
        assert done[t].tokens[-1] == EOS
    for t, p in prefix.items():
        assert done[t].tokens[:len(p)] == p  # progress kept


def test_migrated_trajectory_keeps_its_length_across_replicas():
    # engine seeds as laminar_hpc.rollout.node.build_engine gives them to ranks 0 and 1 of a run with seed 0
    lg = emu().lengths
    tid = next(t for t in (f"15.{i}" for i in range(100))
               if response_length(lg, seed=0, traj_id=t, cap=1000) > 20
               and response_length(lg, seed=1, traj_id=t, cap=1000) > 20
               and response_length(lg, seed=0, traj_id=t, cap=1000) != response_length(lg, seed=1, traj_id=t, cap=1000))
    a, b = engine(seed=0, length_seed=0), engine(seed=1, length_seed=0)  # as build_engine: the run's seed
    a.add([req(tid)])
    a.step()
    assert a.num_active() == 1
    (moved,) = a.abort([tid])
    done = run_to_end(b, b.add([moved]))
    assert len(done[tid].tokens) == response_length(lg, seed=0, traj_id=tid, cap=1000)


def test_readd_past_its_drawn_length_still_generates_one_token():
    e = engine(lengths=lengths(median=5, p99_over_median=1.0, min_tokens=5, max_tokens=5))
    r = req("7.0", tokens=[20] * 9, logprobs=[-0.5] * 9, max_new=100)
    done = run_to_end(e, e.add([r]))
    assert len(done["7.0"].tokens) == 10 and done["7.0"].tokens[-1] == EOS


def test_readd_with_no_room_left_is_refused():
    e = engine()
    with pytest.raises(ValueError, match="no room"):
        e.add([req("8.0", tokens=[20] * 4, logprobs=[-1.0] * 4, max_new=4)])
    assert e.num_active() == 0


def test_refused_add_leaves_the_engine_unchanged():
    e = engine()
    with pytest.raises(ValueError):
        e.add([req("8.1"), req("8.2", tokens=[20] * 4, logprobs=[-1.0] * 4, max_new=4)])
    assert e.num_active() == 0


def test_load_weights_copies_the_bytes():
    e = engine(loaded=False)
    assert e.version == -1 and not e.array.any()
    buf, layout, src = published(3)
    e.load_weights(5, buf, layout)
    assert e.version == 5
    np.testing.assert_array_equal(e.array, src)
    assert e.array.ctypes.data != np.frombuffer(buf, dtype=np.uint8).ctypes.data  # a copy, not a view
    buf[0] = (int(buf[0]) + 1) % 256  # the publisher's buffer changes afterwards
    np.testing.assert_array_equal(e.array, src)
    # a later version replaces it
    buf2, layout2, src2 = published(9)
    e.load_weights(6, buf2, layout2)
    assert e.version == 6
    np.testing.assert_array_equal(e.array, src2)
    assert not np.array_equal(src, src2)


def test_pack_unpack_round_trip_through_a_larger_buffer():
    layout = EmulatedWeights(NBYTES)
    src = Model(np.random.default_rng(0).integers(0, 256, NBYTES, dtype=np.uint8))
    buf = memoryview(bytearray(NBYTES + 64))
    layout.pack(src, buf)
    dst = Model(np.zeros(NBYTES, dtype=np.uint8))
    assert layout.unpack(buf, dst) is None
    np.testing.assert_array_equal(dst.array, src.array)
    again = Model(np.zeros(NBYTES, dtype=np.uint8))  # the verified path hashes what it copies
    assert layout.unpack(buf, again, checksum=True) == store_checksum(buf)
    np.testing.assert_array_equal(again.array, src.array)
    assert layout.digest == EmulatedWeights(NBYTES).digest != EmulatedWeights(NBYTES + 1).digest


def test_load_weights_refused_while_sequences_are_active():
    e = engine()
    e.add([req("9.0")])
    buf, layout, src = published(7)
    with pytest.raises(VersionInFlightError):
        e.load_weights(2, buf, layout)
    assert e.version == 1 and not np.array_equal(e.array, src)  # nothing changed
    run_to_end(e)
    e.load_weights(2, buf, layout)
    assert e.version == 2
    np.testing.assert_array_equal(e.array, src)


def test_add_before_weights_raises():
    e = engine(loaded=False)
    with pytest.raises(RuntimeError, match="load_weights"):
        e.add([req("10.0")])
    assert e.num_active() == 0
    assert e.add([]) == []
    assert e.step() == []


def test_free_slots_and_capacity():
    e = engine(max_batch=3, lengths=lengths(median=100, p99_over_median=1.0, min_tokens=100, max_tokens=100))
    assert e.free_slots() == 3 and e.num_active() == 0
    e.add([req("11.0"), req("11.1")])
    assert e.free_slots() == 1 and e.num_active() == 2
    with pytest.raises(ValueError, match="free slots"):
        e.add([req("11.2"), req("11.3")])
    assert e.num_active() == 2 and e.active_ids() == ["11.0", "11.1"]
    e.add([req("11.2")])
    assert e.free_slots() == 0
    with pytest.raises(ValueError):
        e.add([req("11.3")])
    e.abort(["11.0"])
    assert e.free_slots() == 1


def test_engine_time_follows_the_cost_model():
    e = engine(max_batch=4, max_macro_steps=8,
               lengths=lengths(median=20, p99_over_median=1.0, min_tokens=20, max_tokens=20))
    m = CostModel(e.emu)
    e.add([req("12.0", prompt_len=6), req("12.1", prompt_len=9)])
    expect = m.prefill_s(15)
    assert e.busy_emulated_s == pytest.approx(expect)
    kv = e.kv_tokens()
    n = len(e.step()[0].tokens)
    assert n == 8
    expect += m.decode_steps_s(2, kv, 8)
    assert e.busy_emulated_s == pytest.approx(expect)


def test_engine_with_a_small_time_scale_sleeps_about_the_emulated_time(monkeypatch):
    ft = FakeTime()
    monkeypatch.setattr(cost_mod.time, "monotonic", ft.monotonic)
    monkeypatch.setattr(cost_mod.time, "sleep", ft.sleep)
    e = engine(time_scale=0.01, max_batch=4)
    e.add([req(f"13.{i}") for i in range(4)])
    run_to_end(e)
    weight_load = CostModel(e.emu).weight_load_s()
    assert sum(ft.sleeps) == pytest.approx(0.01 * (weight_load + e.busy_emulated_s))


def test_engines_with_the_same_seed_are_reproducible():
    def trace(seed):
        e = engine(seed=seed, max_batch=4)
        done = run_to_end(e, e.add([req(f"14.{i}") for i in range(4)]))
        return {t: (r.tokens, r.logprobs) for t, r in done.items()}
    assert trace(5) == trace(5)
    t5, t6 = trace(5), trace(6)
    assert t5 != t6


# -- a macro step ends when something arrives (emulation.step_interrupts) --------------------------

def test_steps_within_is_the_inverse_of_decode_steps():
    c = CostModel(emu())
    for batch, kv, most in [(1, 0, 128), (32, 77_000, 128), (7, 12_345, 5)]:
        for k in range(1, most + 1):
            t = c.decode_steps_s(batch, kv, k)
            assert c.steps_within(batch, kv, t, most) == k  # a boundary is its own step
            assert c.steps_within(batch, kv, t - 1e-6, most) == k  # just before it: that step ends there
        assert c.steps_within(batch, kv, 0.0, most) == 1 and c.steps_within(batch, kv, 1e9, most) == most


def test_clock_woken_early_settles_at_the_chosen_boundary(fake_time):
    c = Clock(1.0)
    calls = []

    def wake(left):
        calls.append(left)
        fake_time.t += min(left, 0.3)  # something arrives 0.3 s into the wait
        return True
    assert c.spend(1.0, wake=wake) == pytest.approx(0.3)
    c.settle(0.4)  # the caller's next step boundary after it
    assert fake_time.t == pytest.approx(100.4) and c.behind_s == 0.0


def test_a_macro_step_ends_at_the_decode_step_after_something_arrived(fake_time):
    """As a real engine's loop, which runs once per decode step: the rollout's `wake` says a message
    came at 5.2 single-step times into a planned 20-step macro step: 6 steps are emitted and the clock
    stands at 6 steps' cost; without a wake the whole macro step runs."""
    e = engine(max_batch=2, decode_base_ms=10.0, decode_per_seq_us=0.0, decode_per_kv_token_ns=0.0,
               max_macro_steps=20, time_scale=1.0)
    e.add([req("0.0", max_new=1000), req("0.1", max_new=1000)])
    one = e.cost.decode_steps_s(2, e.kv_tokens(), 1)
    arrival = fake_time.t + 5.2 * one

    def wake(left):
        if fake_time.t + left < arrival:
            fake_time.t += left
            return False
        fake_time.t = arrival
        return True
    e.wake = wake
    t0, busy = fake_time.t, e.busy_emulated_s
    outs = e.step()
    assert {len(o.tokens) for o in outs} == {6}
    assert fake_time.t - t0 == pytest.approx(6 * one) and e.busy_emulated_s - busy == pytest.approx(6 * one)
    e.wake = None
    assert {len(o.tokens) for o in e.step()} == {20}
