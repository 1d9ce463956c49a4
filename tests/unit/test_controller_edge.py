"""Frames and rows at the controller's edge, in-process: a real `Controller` behind a transport
that checks each frame it sends as the receiving role's client does (the size limit included),
driven with crafted but schema-valid frames. Nothing a peer sends may end the controller or
reach the trainer unchecked; nothing it sends may exceed the frame limit."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import msgpack
import msgspec
import pytest
import yaml
from helpers import REPO, result

from laminar_hpc.config import load_config
from laminar_hpc.controller import main
from laminar_hpc.controller.pools import MAX_REJECTIONS
from laminar_hpc.controller.wal import WriteAheadLog
from laminar_hpc.metrics.status import read_status, write_status
from laminar_hpc.transport import protocol
from laminar_hpc.transport.protocol import (PROTOCOL_VERSION, Assign, Drops, Finished, Groups, Heartbeat, Hello,
                                            LogEvent, Migrated, RolloutState, Stream, StreamItem, TrainStep,
                                            WantGroups, WantWork)

EMULATED = Path(REPO) / "configs" / "tiny-emulated.yaml"  # 4 rollouts x 8 slots, groups of 4, vocabulary 100
TORCH = Path(REPO) / "configs" / "tiny.yaml"  # model.max_seq_len 32


@pytest.fixture
def make(controller):
    return lambda config=EMULATED, *overrides: controller(load_config(config, list(overrides)))


def _ready(ctl: main.Controller, credit: int = 8) -> dict:
    """Every rollout joined and asked for `credit`; returns the work handed out, by trajectory id."""
    for r in range(ctl.cfg.rollout.count):
        ctl.handle(f"rollout-{r}", Hello(role="rollout", rank=r, pid=100 + r, protocol=PROTOCOL_VERSION))
        ctl.handle(f"rollout-{r}", WantWork(credit=credit, version=0))
    ctl.server.take()
    ctl.schedule()
    return {w.traj_id: w for _, m in ctl.server.take() if isinstance(m, Assign) for w in m.work}


def _finish(ctl, w, tokens, **over):
    rank = ctl.data_plane.partials[w.traj_id].rollout
    t = result(w, tokens, rollout=rank, reward=1.0, finish="eos", **over)
    ctl.receive(f"rollout-{rank}", Finished(trajectory=t))
    return t


# -- frames that pass the schema ---------------------------------------------------------------

@pytest.mark.parametrize("msg", [
    TrainStep(metrics={"step": "x", "loss": 0.5}), TrainStep(metrics={"step": math.nan}),
    TrainStep(metrics={"step": math.inf}), TrainStep(metrics={"step": 2.5}),
    LogEvent(event="relay", fields={"dropped_frames": "many"}), LogEvent(event="relay", fields={"dropped_frames": -math.inf}),
], ids=lambda m: f"{protocol.TYPE_NAMES[type(m)]}-{m.metrics if isinstance(m, TrainStep) else m.fields}")
def test_crafted_free_map_values_never_break_a_handler_or_the_status(make, msg, tmp_path):
    ctl = make()
    ctl.handle("trainer-0", msg)  # the typed maps let these through: the handler must cope
    st = ctl.status()
    assert st.step == 0 and st.relay_dropped_frames == 0 and st.handler_errors == 0
    write_status(tmp_path / "status.json", st)
    assert read_status(tmp_path / "status.json").step == 0


def test_a_handler_error_drops_the_frame_in_one_line_and_the_controller_goes_on(make, caplog, monkeypatch):
    ctl = make()

    def broken(state):
        raise ValueError("boom\nsecond line")

    monkeypatch.setattr(ctl.rollout_manager, "report", broken)
    state = RolloutState(version=0, waiting=0, running=0, kv_tokens=0, kv_peak=0, traj_ids=[], busy_s=0.0,
                         weight_wait_s=0.0)
    with caplog.at_level(logging.ERROR, logger="test-controller"):
        ctl.receive("rollout-1", state)
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line == "dropped a 'rollout_state' frame from rollout-1: handling it failed (ValueError: boom second line)"
    st = ctl.status()
    assert st.handler_errors == 1 and st.dropped_frames == 1
    ctl.receive("rollout-1", Heartbeat(t=5.0))  # the next frame is handled as ever
    ((to, hb),) = ctl.server.take()
    assert to == "rollout-1" and hb.echo == 5.0 and ctl.status().handler_errors == 1


def test_unknown_fields_are_neither_stored_nor_forwarded(make):
    ctl = make()
    work = _ready(ctl)
    group = [work[f"0.{j}"] for j in range(4)]
    for w in group:
        rank = ctl.data_plane.partials[w.traj_id].rollout
        traj = msgspec.to_builtins(result(w, [5, 6], rollout=rank, reward=1.0, finish="eos"), builtin_types=(bytes,))
        frame = msgpack.packb({"type": "finished", "smuggled": {"x": [1, 2]},
                               "trajectory": {**traj, "smuggled": "payload-xyz", "reward_override": 99.0}})
        ctl.receive(f"rollout-{rank}", protocol.decode(frame))
    ctl.handle("trainer-0", WantGroups(n=1))
    ctl.schedule()
    ((to, groups),) = ctl.server.take()
    assert to == "trainer-0" and [t.reward for t in groups.groups[0].trajectories] == [1.0] * 4
    assert b"smuggled" not in protocol.encode(groups) and b"payload-xyz" not in protocol.encode(groups)
    ctl.wal.flush()
    assert not any(b"smuggled" in p.read_bytes() for p in ctl.rd.wal_dir.iterdir())


# -- rows and trajectories ---------------------------------------------------------------------

def test_a_prompt_too_long_for_the_model_is_refused_at_admission_with_its_row(make, tmp_path, caplog):
    data = tmp_path / "d.jsonl"
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "z" * 40, "answer": "#### 1"},
            {"question": "2+2?", "answer": "#### 4"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = yaml.safe_load(TORCH.read_text())
    cfg["task"] = {"type": "jsonl", "path": str(data), "reward": "exact"}
    (tmp_path / "jsonl.yaml").write_text(yaml.safe_dump(cfg))
    with caplog.at_level(logging.WARNING, logger="test-controller"):
        ctl = make(tmp_path / "jsonl.yaml")
        work = _ready(ctl)
    assert work and all(w.problem % 3 != 1 for w in work.values())  # row 2 never reaches a rollout
    assert all(w.n_prompt + 1 <= 32 for w in work.values())
    st = ctl.status()
    assert st.prompts_refused >= 1 and st.refused_problems[0] == 1
    line = next(r.getMessage() for r in caplog.records if "refused the prompt" in r.getMessage())
    assert f"problem 1 ({data} line 2)" in line and "leave no room to generate within model.max_seq_len=32" in line


def test_garbage_from_a_rollout_never_reaches_the_trainer(make):
    ctl = make()
    work = _ready(ctl)
    group0 = [work[f"0.{j}"] for j in range(4)]
    for w in group0[1:]:
        _finish(ctl, w, [5, 6])
    bad = group0[0]
    rank = ctl.data_plane.partials[bad.traj_id].rollout
    ctl.receive(f"rollout-{rank}", Stream(items=[StreamItem(traj_id=bad.traj_id, tokens=[7], logprobs=[math.nan],
                                                            version=0, offset=0)]))
    assert not ctl.data_plane.partials[bad.traj_id].tokens
    for attempt in range(1, MAX_REJECTIONS + 1):
        _finish(ctl, bad, [5, 100])  # id 100: outside the vocabulary of 100
        ctl.receive(f"rollout-{rank}", WantWork(credit=1, version=0))  # its slot is free again
        ctl.handle("trainer-0", WantGroups(n=8))
        ctl.schedule()
        sent = ctl.server.take()
        assert not [m for to, m in sent if to == "trainer-0"]  # its group is never complete
        if attempt < MAX_REJECTIONS:  # generated again, from the prompt
            assert [(to, w.traj_id, w.tokens) for to, m in sent for w in m.work] == [(f"rollout-{rank}", bad.traj_id,
                                                                                       None)]
    st = ctl.status()
    assert st.trajectories_refused == MAX_REJECTIONS and st.stream_items_refused == 1 and st.groups_dropped == 1
    assert ctl.final_stats().ledger["groups_dropped"] == {"invalid_trajectory": 1}


def test_a_hand_back_for_a_replica_that_does_not_exist_restarts_its_trajectories(make):
    ctl = make()
    work = _ready(ctl)
    on0 = [w for w in work.values() if ctl.data_plane.partials[w.traj_id].rollout == 0][:2]
    ctl.receive("rollout-0", Migrated(dest=99, trajectories=[result(w, [5]) for w in on0]))
    assert ctl.server.take() == []  # nothing sent to a rollout-99
    assert list(ctl.data_plane.queue)[:2] == [w.traj_id for w in reversed(on0)]


# -- frames out: split by encoded size ---------------------------------------------------------

def test_an_oversized_delivery_is_split_and_a_group_too_big_alone_is_dropped_first(make):
    ctl = make(EMULATED, "controller.max_frame_mb=0.01")  # 10485-byte frames
    limit = ctl.server.max_frame_bytes
    work = _ready(ctl)
    for gid in range(8):
        n = 400 if gid == 2 else 100  # group 2: ~4 x 4 KB, over the limit alone
        for j in range(4):
            _finish(ctl, work[f"{gid}.{j}"], [5] * n)
    ctl.handle("trainer-0", WantGroups(n=8))
    ctl.schedule()  # old: one frame of ~40 KB, which the trainer would drop after it was logged as delivered
    sent = [m for to, m in ctl.server.take() if to == "trainer-0"]
    assert sent[0] == Drops(counts={"groups_dropped.oversize": 1})  # the trainer's next step reports it
    frames = sent[1:]
    assert len(frames) > 1 and all(isinstance(m, Groups) for m in frames)
    assert all(len(protocol.encode(m)) <= limit for m in frames)
    delivered = [g.group_id for m in frames for g in m.groups]
    assert delivered == [0, 1, 3, 4, 5, 6, 7]
    st = ctl.status()
    assert st.oversize_refused == 1 and st.frames_split == 1 and ctl.data_plane.ledger.dropped == {2: "oversize"}
    # what the write-ahead log says was delivered is exactly what was sent
    ctl.wal.flush()
    _, records = WriteAheadLog(ctl.rd.wal_dir).recover()
    assert [g for op, a in records if op == "deliver" for g in a["ids"]] == delivered
    assert [(op, a) for op, a in records if op == "drop"] == [("drop", {"ids": [2], "reason": "oversize"})]


def test_a_task_whose_every_prompt_is_too_long_stops_the_run_with_the_reason(make):
    ctl = make(TORCH, "model.max_seq_len=6", "rollout.max_new_tokens=4")  # every built-in prompt is longer
    _ready(ctl)
    for _ in range(10):
        ctl.schedule()
        if ctl.state.stop_reason:
            break
    assert ctl.data_plane.groups_started == 0 and ctl.status().prompts_refused >= main.ALL_REFUSED_STOP
    why = ctl.state.stop_reason
    assert why.startswith(f"the first {ctl.data_plane.refused['prompts']} prompts of the task were all refused")
    assert "raise model.max_seq_len" in why


def test_token_ids_are_checked_against_the_checkpoint_s_vocabulary(make, tmp_path):
    from helpers import QWEN25_7B

    from laminar_hpc.controller.validate import Limits
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN25_7B))
    ctl = make(TORCH, f"model.hf_path={hf}", "model.max_seq_len=64")  # the char tokenizer: 100 ids
    assert ctl.data_plane.limits == Limits(vocab_size=QWEN25_7B["vocab_size"], max_seq_len=64)


def test_work_too_big_for_any_frame_is_never_sent_and_its_group_dropped(make):
    ctl = make(EMULATED, "controller.max_frame_mb=0.001")  # 1048-byte frames
    work = _ready(ctl, credit=2)  # room left on every replica for what a dead one held
    on2 = [w for w in work.values() if ctl.data_plane.partials[w.traj_id].rollout == 2]
    big = on2[0]
    ctl.receive("rollout-2", Stream(items=[StreamItem(traj_id=big.traj_id, tokens=[5] * 150, logprobs=[-0.5] * 150,
                                                      version=0, offset=0)]))
    credits = dict(ctl.rollout_manager.credits)
    ctl.receive("launcher-0", protocol.RoleDown(role="rollout-2", code=-9))  # its work continues elsewhere...
    sent = ctl.server.take()  # (each frame passed the receiving side's limit)
    placed = [w.traj_id for _, m in sent if isinstance(m, Assign) for w in m.work]
    assert big.traj_id not in placed  # ...except what no frame can carry
    assert ctl.data_plane.ledger.dropped == {big.group_id: "oversize"} and ctl.status().oversize_refused == 1
    assert sum(ctl.rollout_manager.credits.values()) == sum(credits.values()) - len(placed)  # no slot charged for it
