"""The allowed-senders table of transport/authz.py: complete, matching who really sends what (read
from the source), and the identity rules. (The same rules enforced by a keyed Server over real
sockets: tests/integration/test_auth.py.)"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO
from laminar_hpc.transport import authz, protocol
from laminar_hpc.transport.authz import KINDS, SENDERS, identity_refusal, kind_of, refusal

PKG = Path(REPO) / "laminar_hpc"


def test_every_message_type_has_its_senders():
    assert set(SENDERS) == set(protocol.TYPE_NAMES.values())
    assert all(kinds <= set(KINDS) for kinds in SENDERS.values())
    # what only the controller sends, no server accepts from anyone
    for tag in ("assign", "migrate", "update_weights", "resume", "weights_synced", "groups", "hello_ack", "stop"):
        assert SENDERS[tag] == frozenset(), tag


def test_only_the_launcher_stops_and_only_the_trainer_trains():
    assert SENDERS["stop_all"] == SENDERS["role_down"] == {"launcher"}
    for tag in ("train_step", "published", "trainer_done", "checkpoint_saved", "trainer_sync", "publish"):
        assert SENDERS[tag] == {"trainer"}, tag
    for tag in ("stream", "finished", "want_work", "migrated", "resync"):
        assert SENDERS[tag] == {"rollout"}, tag
    assert SENDERS["version_ready"] == {"relay"}
    assert authz.ADMITS["relay"] == ("trainer",)  # the hand-off takes the trainer only


def sent_messages(path: Path) -> set[str]:
    """The protocol classes `path` sends: `X.send(Cls(...))` and the supervisor's `_tell(Cls(...))`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("send", "_tell")
                and node.args and isinstance(node.args[0], ast.Call)):
            fn = node.args[0].func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if isinstance(getattr(protocol, name or "", None), type) and issubclass(getattr(protocol, name), protocol.Message):
                out.add(name)
    return out


SENDING_CODE = {  # where each kind's messages are sent from
    "rollout": ["rollout/**/*.py", "startup/role.py"],
    "trainer": ["trainer/**/*.py", "startup/role.py"],
    "relay": ["relay/**/*.py", "startup/role.py"],
    "launcher": ["launch/supervisor.py"],
    "shard": ["controller/shard.py", "startup/role.py"],
    "judge": ["judge/**/*.py", "startup/role.py"],
}


@pytest.mark.parametrize("kind", KINDS)
def test_the_table_allows_what_each_role_really_sends(kind):
    """A message a role sends that the table does not allow would be dropped by every keyed server."""
    sent = set()
    for pattern in SENDING_CODE[kind]:
        for path in PKG.glob(pattern):
            sent |= sent_messages(path)
    assert sent, f"found no sends for {kind}: the source scan is broken"
    for name in sorted(sent):
        assert kind in SENDERS[getattr(protocol, name).__struct_config__.tag], f"{kind} sends {name}"


@pytest.mark.parametrize("identity,kind", [
    ("rollout-3", "rollout"), ("rollout-3.hb", "rollout"), ("trainer-0", "trainer"), ("trainer-0.hb", "trainer"),
    ("launcher-0", "launcher"), ("relay-12", "relay"), ("relay-1.hb", "relay"),
    ("rollout-3.judge12", "rollout"), ("rollout-3.judge", None), ("rollout-3.judgex", None),
    ("controller-0", None), ("rollout", None), ("rollout-", None), ("rollout-x", None), ("rollout-3.hbx", None),
    ("Rollout-3", None), ("rollout-3 ", None), ("launcher-probe", None), ("", None), ("rollout-3\n", None),
])
def test_kind_of(identity, kind):
    assert kind_of(identity) == kind


def test_refusals():
    assert refusal("rollout", "rollout-3", protocol.Finished) is None
    assert refusal("rollout", "rollout-3.hb", protocol.Heartbeat) is None
    assert refusal("launcher", "launcher-0", protocol.StopAll) is None
    assert refusal("trainer", "trainer-0", protocol.Publish) is None
    # a rollout's key cannot act as the launcher or the trainer, by identity or by message type
    assert "not a rollout's" in identity_refusal("rollout", "launcher-0")
    assert "not a rollout's" in refusal("rollout", "trainer-0", protocol.TrainStep)
    assert "may not send 'stop_all'" in refusal("rollout", "rollout-3", protocol.StopAll)
    assert "may not send 'train_step'" in refusal("rollout", "rollout-3", protocol.TrainStep)
    assert "may not send 'hello'" in refusal("launcher", "launcher-0", protocol.Hello)
    # a heartbeat thread's socket only beats
    assert "may only send 'heartbeat'" in refusal("trainer", "trainer-0.hb", protocol.TrainStep)
    # a reward call's socket to a judge only asks for verdicts: a rollout's, or the trainer's (its
    # warm-up's evaluation); no other role's
    assert refusal("rollout", "rollout-3.judge7", protocol.JudgeRequest) is None
    assert refusal("trainer", "trainer-0.judge1", protocol.JudgeRequest) is None
    assert "may only send 'judge_request'" in refusal("rollout", "rollout-3.judge7", protocol.WantWork)
    assert "may not send 'judge_request'" in refusal("relay", "relay-0", protocol.JudgeRequest)
    assert refusal("rollout", "rollout-3", protocol.JudgeVerdict) is not None  # only a judge answers
    # nobody sends what only the controller sends
    for kind in KINDS:
        assert refusal(kind, f"{kind}-0", protocol.Assign) is not None
    assert identity_refusal("unknown", "rollout-0") is not None  # no User-Id: nothing is admitted
