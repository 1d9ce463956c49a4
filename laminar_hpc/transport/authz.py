"""Who may say what on the control plane: role kinds, the identities they may use, the message
types they may send, and which server admits which kinds.

Every client proves a role KIND with its CURVE key (transport/security.py keeps one keypair per
kind in `run_dir/secrets/`); a keyed `Server` learns the kind from the ZAP handler (the frame's
`User-Id`) and, for each frame, checks with `refusal` that the DEALER identity the peer chose
belongs to that kind and that the kind may send the message type. A frame that fails is dropped
and counted, never handled: a rollout's key cannot act as the trainer or the launcher, and a
heartbeat thread's socket can only beat.

    kind_of("rollout-3.hb")                      # -> "rollout"
    refusal("rollout", "rollout-3", StopAll)     # -> "a rollout may not send 'stop_all'"

The table is derived from who sends what (grep `.send(` in laminar_hpc/): a new message type
must be placed here, or every keyed server drops it (tests/unit/test_authz.py checks that every
type of transport/protocol.py has an entry).

| message type                                   | sent by                          |
|------------------------------------------------|----------------------------------|
| heartbeat                                      | launcher, trainer, rollout, relay, shard, judge |
| hello                                          | trainer, rollout, relay, shard, judge |
| log_event                                      | trainer, relay, shard            |
| want_work, stream, finished, weights_loaded,   | rollout                          |
| resync, rollout_state, migrated, migrate_reject|                                  |
| want_groups, train_step, trainer_sync,         | trainer                          |
| published, checkpoint_saved, trainer_done,     |                                  |
| publish (to the master relay's hand-off)       |                                  |
| version_ready                                  | relay                            |
| role_down, stop_all, join                      | launcher                         |
| leaving                                        | rollout                          |
| leaf_subscribe (to the master relay's leaf server) | relay                        |
| relayed (a stream shard's rollouts' frames)    | shard                            |
| fetch (to a stream shard)                      | trainer, shard                   |
| judge_request (to a judge, laminar_hpc/judge/) | rollout, trainer (a reward call's socket, `rollout-N.judgeK`; the trainer's: its warm-up's evaluation) |
| assign, migrate, update_weights, resume,       | nobody (the controller sends     |
| weights_synced, groups, hello_ack, stop,       | them; no server accepts them)    |
| joined, leaf_header, leaf_chunk, leaf_trailer, | (the master relay sends the leaf_*, |
| fetched, judge_verdict                         | a shard `fetched`, a judge its verdicts) |

A heartbeat thread's socket (identity `<role>-<rank>.hb`) may send `heartbeat` only. The
launcher's heartbeat is the liveness probe of bench/bench_controller.py.
"""
from __future__ import annotations

import re
from functools import lru_cache

from laminar_hpc.transport import protocol

# the role kinds a client key proves; each has its own keypair
KINDS = ("launcher", "trainer", "rollout", "relay", "shard", "judge")

# server -> the client kinds it admits at the CURVE handshake. The controller's control plane
# takes every role; the master relay's hand-off socket takes only the trainer's `publish`.
ADMITS: dict[str, tuple[str, ...]] = {
    "controller": KINDS,
    "relay": ("trainer",),
    "relay_leaves": ("relay",),  # the master relay's server for joiners' leaf relays (relay/leaf_server.py)
    # a stream shard (controller/shard.py): its rollouts, the trainer and other shards fetching
    "shard": ("rollout", "trainer", "shard"),
    "judge": ("rollout", "trainer"),  # a judge (laminar_hpc/judge/): reward calls of the rollouts and of the warm-up's evaluation
}

_ALL = frozenset(KINDS)
SENDERS: dict[str, frozenset[str]] = {
    "heartbeat": _ALL,
    "hello": frozenset({"trainer", "rollout", "relay", "shard", "judge"}),
    "log_event": frozenset({"trainer", "relay", "shard"}),
    **{t: frozenset({"rollout"}) for t in ("want_work", "stream", "finished", "weights_loaded", "resync",
                                          "rollout_state", "migrated", "migrate_reject")},
    **{t: frozenset({"trainer"}) for t in ("want_groups", "train_step", "trainer_sync", "published",
                                          "checkpoint_saved", "trainer_done", "publish")},
    "version_ready": frozenset({"relay"}),
    "role_down": frozenset({"launcher"}),
    "join": frozenset({"launcher"}),
    "leaving": frozenset({"rollout"}),
    "leaf_subscribe": frozenset({"relay"}),
    "stop_all": frozenset({"launcher"}),
    "relayed": frozenset({"shard"}),
    "fetch": frozenset({"trainer", "shard"}),
    "judge_request": frozenset({"rollout", "trainer"}),
    **{t: frozenset() for t in ("assign", "migrate", "update_weights", "resume", "weights_synced", "groups", "drops",
                               "hello_ack", "stop", "joined", "leaf_header", "leaf_chunk", "leaf_trailer",
                               "fetched", "judge_verdict")},
}
HEARTBEAT_ONLY = ".hb"  # the identity suffix of a role's heartbeat-thread socket
JUDGE_CALL = ".judge"  # the identity suffix (and a number) of a reward call's socket to a judge

# `.judgeK`: one of a rollout's reward calls asking a judge (each thread or pool process its own socket)
_IDENTITY = re.compile(r"(?P<kind>[a-z]+)-(?P<rank>[0-9]+)(?P<hb>\.hb|\.judge[0-9]+)?")
# message class -> kinds that may send it; a type missing from SENDERS fails here, at import
_BY_CLASS: dict[type, frozenset[str]] = {cls: SENDERS[name] for cls, name in protocol.TYPE_NAMES.items()}


def kind_of(identity: str) -> str | None:
    """The role kind an identity names ('rollout-3', 'trainer-0.hb' -> 'rollout', 'trainer'), or
    None for anything not of the form `<kind>-<rank>[.hb|.judgeK]` with a known kind."""
    m = _IDENTITY.fullmatch(identity)
    return m["kind"] if m and m["kind"] in _ALL else None


@lru_cache(maxsize=4096)  # a few identities per run, checked for every frame
def identity_refusal(kind: str, identity: str) -> str | None:
    """Why a peer authenticated as `kind` may not use `identity`, or None when it may."""
    if kind_of(identity) != kind:
        return f"identity {identity!r} is not a {kind}'s (a {kind} key may only use '{kind}-<rank>[.hb|.judgeK]')"
    return None


def type_refusal(kind: str, identity: str, msg_type: type) -> str | None:
    """Why `kind`, using `identity` (already checked by `identity_refusal`), may not send a message
    of class `msg_type`; None when it may."""
    if identity.endswith(HEARTBEAT_ONLY) and msg_type is not protocol.Heartbeat:
        return f"a heartbeat socket ({identity}) may only send 'heartbeat', not '{_name(msg_type)}'"
    if JUDGE_CALL in identity and msg_type is not protocol.JudgeRequest:
        return f"a reward call's socket ({identity}) may only send 'judge_request', not '{_name(msg_type)}'"
    if kind not in _BY_CLASS.get(msg_type, ()):
        return f"a {kind} may not send '{_name(msg_type)}'"
    return None


def _name(msg_type: type) -> str:
    return protocol.TYPE_NAMES.get(msg_type, msg_type.__name__)


def refusal(kind: str, identity: str, msg_type: type) -> str | None:
    """Why a peer authenticated as `kind`, using `identity`, may not send a message of class
    `msg_type`; None when it may."""
    return identity_refusal(kind, identity) or type_refusal(kind, identity, msg_type)
