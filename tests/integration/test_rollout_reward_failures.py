"""A reward call that fails scores 0 with its reason, through a real rollout: a `Rollout`
in-process (the emulated engine, its controller an in-process channel, weights in a real weight
store) scoring with the user's reward module (task.reward.fn=path.py:function) in a thread or a
process pool. Each way a reward can fail (it raises, hangs past timeout_s, returns NaN, a value
outside task.reward.range, or no number) gives that trajectory reward 0.0 and `reward_error` =
the reason; the rollout goes on serving (work assigned after the failure scores normally); each
failure is traced as `reward_failed` with the trajectory, the reason and whether it was evaluation
work (`eval`); and the trainer's step metrics count it as `reward_failed.<reason>`. Never a crash,
never a silent zero.

    pytest -q tests/unit/test_rollout_reward_failures.py
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import FakeChannel, close_rollout, role_context, work_item

from laminar_hpc.metrics.trace import role_events
from laminar_hpc.rollout.main import Rollout
from laminar_hpc.trainer.reward_stats import reward_metrics
from laminar_hpc.transport.protocol import Assign, Finished, Group, Stop, Trajectory, WantWork, WorkItem
from laminar_hpc.transport.weight_store import WeightStore, checksum, digest_to_int

CONFIG = "configs/tiny-emulated.yaml"
BAD = 7  # the problem index the reward fails on (work_item: problem = group; the validation split's index i too)
TIMEOUT_S = 0.5  # task.reward.timeout_s: small, so that the timeout case is fast, yet far above a good call's time
SERVE_S = 60.0  # a rollout that has not finished its work by then is stuck: the test fails

# the body of the reward on problem BAD, by the reason it must give (every other problem scores 1)
FAILURES = {
    "exception": "raise KeyError('no answer found in the response')",
    "timeout": "time.sleep(60)\n        return 1.0",  # a thread cannot be killed: it returns, late, and is dropped
    "not_finite": "return float('nan')",
    "out_of_range": "return 2.5",  # task.reward.range is [0, 1]
    "bad_type": "return 'correct'",
}


def reward_module(tmp_path: Path, body: str) -> Path:
    code = tmp_path / "user_reward.py"
    code.write_text("import time\n\n\n"
                    "def score(problem, response):\n"
                    f"    if problem.index == {BAD}:\n"
                    f"        {body}\n"
                    "    return 1.0\n")
    return code


class WaitingChannel(FakeChannel):
    """A FakeChannel whose `recv` waits out its timeout when there is nothing to receive, as the
    real channel does: the rollout's loop waits for its rewards instead of spinning."""

    def recv(self, timeout_s: float):
        msg = super().recv(timeout_s)
        if msg is None:
            time.sleep(timeout_s)
        return msg


@pytest.fixture
def make(tmp_path):
    made, stores = [], []

    def build(code: Path, pool: str) -> Rollout:
        """An emulated rollout scoring with `code`'s `score` in a `pool` pool, version 0 published."""
        ctx = role_context("rollout", 0, tmp_path, config=CONFIG, overrides=(
            f"task.reward.fn={code}:score", f"task.reward.pool={pool}", "task.reward.workers=2",
            f"task.reward.timeout_s={TIMEOUT_S}"))
        ctx.ctrl = WaitingChannel()
        r = Rollout(ctx, relay=0)
        made.append(r)
        store = WeightStore.create(r.weights.path, 2, r.layout.nbytes)  # what the node's relay does
        stores.append(store)
        slot, view = store.begin(0)
        view = view[:r.layout.nbytes]
        store.commit(slot, 0, r.layout.nbytes, checksum(view), digest_to_int(r.layout.digest))
        return r

    yield build
    for r in made:
        close_rollout(r)
    for s in stores:
        s.close()


def serve(r: Rollout, *batches: list[WorkItem]) -> dict[str, Trajectory]:
    """`run` as the process runs it; the controller assigns batch i + 1 only once every
    trajectory of batch i came back (so a later batch is served after an earlier failure), and
    says stop after the last. Returns the trajectories by id."""
    pending, done_ids, deadline = list(batches), set(), time.monotonic() + SERVE_S

    def controller(ch: FakeChannel):
        assert time.monotonic() < deadline, f"the rollout did not finish its work within {SERVE_S:g} s"
        done_ids.update(m.trajectory.traj_id for m in ch.of(Finished))
        served = len(batches) - len(pending)
        if served and not {w.traj_id for w in batches[served - 1]} <= done_ids:
            return []
        if pending and len(ch.of(WantWork)) > served:
            return [Assign(work=pending.pop(0))]
        if not pending:
            return [Stop(reason="done")]
        return []

    r.ctx.ctrl.script = controller
    r.run({})  # returns only on the controller's stop: nothing raised out of the loop
    finished = [m.trajectory for m in r.ctx.ctrl.of(Finished)]
    ids = {w.traj_id for b in batches for w in b}
    assert len(finished) == len({t.traj_id for t in finished}) == len(ids)  # each exactly once
    return {t.traj_id: t for t in finished}


def assert_scored(t: Trajectory, eos_id: int, reward: float, error: str | None) -> None:
    """Generated in full (its tokens kept) and scored `reward`, with `error` as the reason."""
    assert t.finish in ("eos", "length") and t.tokens and len(t.tokens) == len(t.logprobs), t.finish
    assert (t.finish == "eos") == (t.tokens[-1] == eos_id)
    assert t.reward == reward and t.reward_error == error, (t.traj_id, t.reward, t.reward_error)


def failed_events(r: Rollout) -> list[dict]:
    r.ctx.tracer.flush()
    return [e for e in role_events(r.ctx.run_dir, "rollout-0") if e["ev"] == "reward_failed"]


@pytest.mark.parametrize("pool", ["thread", "process"])
@pytest.mark.parametrize("reason", list(FAILURES))
def test_a_failing_reward_scores_0_with_its_reason_traced_and_counted_and_the_rollout_goes_on(
        make, tmp_path, reason, pool):
    r = make(reward_module(tmp_path, FAILURES[reason]), pool)
    first = [work_item(i, group=g, prompt=(5, 6), max_new_tokens=64) for g in (6, BAD) for i in range(2)]
    later = [work_item(i, group=8, prompt=(5, 6), max_new_tokens=64) for i in range(2)]
    done = serve(r, first, later)

    bad = {f"{BAD}.0", f"{BAD}.1"}
    for traj_id, t in done.items():
        assert_scored(t, r.tok.eos_id, 0.0 if traj_id in bad else 1.0, reason if traj_id in bad else None)
    assert r.errors == 0 and r.scoring.failures == 2  # no trajectory failed as an error result

    events = failed_events(r)
    assert sorted(e["traj"] for e in events) == sorted(bad)
    for e in events:
        assert e["reason"] == reason and e["eval"] is False and e["detail"], e
    if reason == "timeout":
        assert f"did not return within {TIMEOUT_S:g} s" in events[0]["detail"]

    by_group: dict[int, list[Trajectory]] = {}
    for t in done.values():
        by_group.setdefault(t.group_id, []).append(t)
    m = reward_metrics([Group(group_id=g, problem=g, trajectories=ts) for g, ts in sorted(by_group.items())])
    assert m["reward_failed"] == 2 and m[f"reward_failed.{reason}"] == 2
    assert not {k for k in m if k.startswith("reward_failed.")} - {f"reward_failed.{reason}"}


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_an_evaluation_items_failed_reward_is_traced_as_evaluation(make, tmp_path, pool):
    """The same failure on training work and on evaluation work (controller/evaluation.py: the
    validation split's problem BAD): both score 0 with the reason; the trace tells them apart."""
    r = make(reward_module(tmp_path, FAILURES["exception"]), pool)
    train = work_item(0, group=BAD, prompt=(5, 6), max_new_tokens=64)
    evals = [WorkItem(traj_id=f"eval-e-0.{p}.0", group_id=-1, problem=p, prompt=[5, 6], max_new_tokens=64,
                      eval_round=0, greedy=True) for p in (3, BAD)]
    done = serve(r, [train, *evals])
    assert_scored(done[train.traj_id], r.tok.eos_id, 0.0, "exception")
    assert_scored(done[evals[0].traj_id], r.tok.eos_id, 1.0, None)
    assert_scored(done[evals[1].traj_id], r.tok.eos_id, 0.0, "exception")
    assert done[evals[1].traj_id].eval_round == 0

    got = {e["traj"]: (e["reason"], e["eval"]) for e in failed_events(r)}
    assert got == {train.traj_id: ("exception", False), evals[1].traj_id: ("exception", True)}
