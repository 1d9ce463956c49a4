"""The reward pool (tasks/rewards/reward_pool.py) with real threads and real worker processes: a call past
its timeout completes as "timeout" and the pool keeps working; failures keep their reasons; a
worker process that dies or never returns is replaced (the looping one killed); calls run
`workers` at a time."""
from __future__ import annotations

import os
import textwrap
import time

import pytest

from laminar_hpc.config.task import RewardCfg
from laminar_hpc.tasks.rewards.reward_pool import RewardPool
from laminar_hpc.tasks.problem import Problem, Response

REWARDS = """
    import os, time
    from pathlib import Path

    def score(problem, response):
        text, where = response.text, Path(problem.fields["dir"])
        if text == "raise":
            raise RuntimeError("grader crashed")
        if text == "nan":
            return float("nan")
        if text == "big":
            return 7.0
        if text == "str":
            return "abc"
        if text == "dict":  # verl's form: `score` is the reward, the other keys are logged
            return {"score": 0.75, "correct": 0.5}
        if text == "exit":
            os._exit(3)
        if text == "stuck":  # until the test releases it (bounded: a thread cannot be killed)
            (where / f"pid-{problem.index}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not (where / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return 1.0
        if text == "loop":  # a runaway that never returns
            (where / f"pid-{problem.index}").write_text(str(os.getpid()))
            while True:
                pass
        if text == "meet":  # wait (bounded) until `workers` calls run at once, record how many did
            mine = where / "inflight" / str(problem.index)
            mine.parent.mkdir(exist_ok=True)
            mine.touch()
            deadline, seen = time.monotonic() + 10, 0
            while time.monotonic() < deadline:
                seen = max(seen, len(list(mine.parent.iterdir())))
                if seen >= problem.fields["workers"]:
                    break
                time.sleep(0.01)
            time.sleep(0.3)
            seen = max(seen, len(list(mine.parent.iterdir())))
            (where / f"seen-{problem.index}").write_text(str(seen))
            mine.unlink()
            return 1.0
        return 1.0 if text == problem.answer else 0.0
"""


@pytest.fixture
def make_pool(tmp_path):
    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS))
    made: list[RewardPool] = []

    def make(pool: str, max_stuck: int | None = None, **kw) -> RewardPool:
        made.append(RewardPool(RewardCfg(fn=f"{tmp_path / 'rewards.py'}:score", pool=pool, **kw), max_stuck=max_stuck))
        return made[-1]

    yield make
    (tmp_path / "release").touch()  # frees any thread a test left stuck
    for pool in made:
        pool.close()


def problem(tmp_path, i: int, answer: str = "19", **fields) -> Problem:
    return Problem(i, "q", answer, fields={"dir": str(tmp_path), **fields})


def wait_for(pool: RewardPool, keys, what: str, timeout_s: float = 60.0) -> dict:
    """Collects until every key in `keys` completed (a bounded wait that names what it waited for)."""
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while not set(keys) <= set(got):
        got.update(pool.collect())
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}; still missing {sorted(set(keys) - set(got))}")
        time.sleep(0.01)
    return got


def wait_until(condition, what: str, timeout_s: float = 30.0, poll=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.01)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_every_outcome_keeps_its_reason(make_pool, tmp_path, kind):
    pool = make_pool(kind, workers=2)
    texts = ["19", "18", "raise", "nan", "big", "str", "dict"]
    for i, text in enumerate(texts):
        pool.submit(text, problem(tmp_path, i), Response(text))
    assert pool.pending() == len(texts)
    got = wait_for(pool, texts, f"{len(texts)} reward calls")
    assert pool.pending() == 0
    assert (got["19"].reward, got["19"].error) == (1.0, None) and got["18"].reward == 0.0
    assert {t: got[t].error for t in ("raise", "nan", "big", "str")} == {
        "raise": "exception", "nan": "not_finite", "big": "out_of_range", "str": "bad_type"}
    assert "RuntimeError: grader crashed" in got["raise"].detail
    assert all(got[t].reward == 0.0 and got[t].components == {} for t in ("raise", "nan", "big", "str"))
    assert got["dict"].components == {"score": 0.75, "correct": 0.5} and got["dict"].reward == 0.75


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_call_past_its_timeout_scores_zero_and_the_pool_keeps_working(make_pool, tmp_path, kind):
    pool = make_pool(kind, workers=2, timeout_s=1.0)
    pool.submit("slow", problem(tmp_path, 0), Response("stuck"))
    got = wait_for(pool, ["slow"], "the stuck call's timeout")
    assert (got["slow"].error, got["slow"].reward) == ("timeout", 0.0) and "within 1 s" in got["slow"].detail
    keys = [f"after-{i}" for i in range(6)]  # more than the workers: the stuck one's place was refilled
    for i, key in enumerate(keys):
        pool.submit(key, problem(tmp_path, 10 + i), Response("19"))
    got = wait_for(pool, keys, "the calls after a timeout")
    assert all(got[k].reward == 1.0 and got[k].error is None for k in keys)
    assert pool.counters()["workers_replaced"] == 1
    if kind == "thread":  # the stuck thread lives on (a thread cannot be killed), counted
        assert pool.counters()["threads_stuck"] == 1
        (tmp_path / "release").touch()
        wait_until(lambda: pool.counters()["threads_stuck"] == 0, "the released thread to end")
    else:  # its worker was killed
        pid = int((tmp_path / "pid-0").read_text())
        wait_until(lambda: pid_gone(pid), f"the timed-out worker (pid {pid}) to be gone", poll=pool.collect)
        assert pid not in pool.worker_pids() and len(pool.worker_pids()) == 2


def test_a_runaway_loop_is_killed_with_its_worker(make_pool, tmp_path):
    pool = make_pool("process", workers=1, timeout_s=1.0)
    pool.submit("loop", problem(tmp_path, 0), Response("loop"))
    got = wait_for(pool, ["loop"], "the runaway call's timeout")
    pid = int((tmp_path / "pid-0").read_text())
    assert got["loop"].error == "timeout" and f"pid {pid}" in got["loop"].detail
    wait_until(lambda: pid_gone(pid), f"the runaway worker (pid {pid}) to be killed", poll=pool.collect)
    pool.submit("next", problem(tmp_path, 1), Response("19"))
    assert wait_for(pool, ["next"], "a call after the kill")["next"].reward == 1.0


def test_a_worker_that_dies_is_replaced(make_pool, tmp_path):
    pool = make_pool("process", workers=2)
    wait_until(lambda: len(pool.worker_pids()) == 2, "two worker processes")
    before = set(pool.worker_pids())
    pool.submit("exit", problem(tmp_path, 0), Response("exit"))
    got = wait_for(pool, ["exit"], "the dying worker's call")
    assert (got["exit"].error, got["exit"].reward) == ("pool", 0.0)
    assert "exited (code 3) while scoring problem 0; it was replaced" in got["exit"].detail
    keys = [f"after-{i}" for i in range(4)]
    for i, key in enumerate(keys):
        pool.submit(key, problem(tmp_path, 1 + i), Response("19"))
    got = wait_for(pool, keys, "the calls after a worker died")
    assert all(got[k].reward == 1.0 for k in keys)
    after = set(pool.worker_pids())
    assert len(after) == 2 and len(before - after) == 1 and pool.counters()["workers_replaced"] == 1


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_calls_run_workers_at_a_time(make_pool, tmp_path, kind):
    workers = 4
    pool = make_pool(kind, workers=workers, timeout_s=60.0)
    keys = [f"meet-{i}" for i in range(2 * workers)]
    for i, key in enumerate(keys):
        pool.submit(key, problem(tmp_path, i, workers=workers), Response("meet"))
    got = wait_for(pool, keys, f"{len(keys)} calls of 0.3 s", timeout_s=120)
    assert all(got[k].reward == 1.0 for k in keys), got
    seen = [int((tmp_path / f"seen-{i}").read_text()) for i in range(len(keys))]
    assert max(seen) == workers, seen  # reached the worker count, never more


def test_close_stops_every_worker_process(make_pool, tmp_path):
    pool = make_pool("process", workers=2, timeout_s=60.0)
    pool.submit("loop", problem(tmp_path, 0), Response("loop"))
    wait_until(lambda: (tmp_path / "pid-0").exists(), "the looping call to start", poll=pool.collect)
    pids = pool.worker_pids() + [int((tmp_path / "pid-0").read_text())]
    pool.close()
    assert pool.pending() == 0 and pool.worker_pids() == []
    assert all(pid_gone(pid) for pid in pids)  # close() waited for them: not even zombies
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit("late", problem(tmp_path, 1), Response("19"))


def test_keys_are_unique_until_collected(make_pool, tmp_path):
    pool = make_pool("thread", workers=1)
    pool.submit("a", problem(tmp_path, 0), Response("19"))
    with pytest.raises(ValueError, match="'a' is already pending"):
        pool.submit("a", problem(tmp_path, 0), Response("19"))
    wait_for(pool, ["a"], "call a")
    pool.submit("a", problem(tmp_path, 0), Response("19"))  # collected: the key is free again
    assert wait_for(pool, ["a"], "call a again")["a"].reward == 1.0


def test_when_every_thread_is_stuck_calls_fail_as_pool(make_pool, tmp_path):
    pool = make_pool("thread", workers=1, timeout_s=0.5, max_stuck=0)
    pool.submit("stuck", problem(tmp_path, 0), Response("stuck"))
    assert wait_for(pool, ["stuck"], "the stuck call's timeout")["stuck"].error == "timeout"
    pool.submit("next", problem(tmp_path, 1), Response("19"))
    got = wait_for(pool, ["next"], "a call with no thread left")
    assert got["next"].error == "pool" and "use task.reward.pool: process" in got["next"].detail
    (tmp_path / "release").touch()  # the stuck call returns: its thread works again
    wait_until(lambda: pool.counters()["threads_stuck"] == 0, "the released thread to end its call")
    pool.submit("again", problem(tmp_path, 2), Response("19"))
    assert wait_for(pool, ["again"], "a call after the thread came back")["again"].reward == 1.0


def test_a_worker_that_cannot_build_its_scorer_fails_calls_as_pool(tmp_path):
    with RewardPool(RewardCfg(fn=f"{tmp_path / 'missing.py'}:score", pool="process", workers=1)) as pool:
        pool.submit("a", problem(tmp_path, 0), Response("19"))
        got = wait_for(pool, ["a"], "the call to a pool whose worker cannot start")
    assert got["a"].error == "pool" and "cannot start a worker" in got["a"].detail
    assert "missing.py not found" in got["a"].detail


def test_collect_looks_for_timed_out_calls_once_per_scan_period_not_at_every_call(make_pool, tmp_path, monkeypatch):
    # the rollout collects after every decode step; with hundreds of calls waiting on a slow
    # verifier, a scan of all of them each time cost its trainer ~12% (bench/bench_reward.py)
    from laminar_hpc.tasks.rewards import reward_pool
    pool = make_pool("thread", workers=8, timeout_s=60.0)
    for i in range(8):
        pool.submit(f"stuck-{i}", problem(tmp_path, i), Response("stuck"))
    wait_until(lambda: len(list(tmp_path.glob("pid-*"))) == 8, "8 calls running")
    # the clock stopped where it is now (the calls started a moment ago, well within their 60 s): a
    # fixed value such as 1000.0 lies past their budget on a machine up for less than ~15 minutes
    now = [time.monotonic()]
    monkeypatch.setattr(reward_pool.time, "monotonic", lambda: now[0])

    class Scans(dict):
        n = 0

        def values(self):
            Scans.n += 1
            return super().values()

    impl = pool._impl
    impl._running = Scans(impl._running)
    for _ in range(100):
        assert pool.collect() == []
    assert Scans.n == 1  # one scan, then none until the period is over
    now[0] += reward_pool.SCAN_EVERY_S
    pool.collect()
    assert Scans.n == 2
