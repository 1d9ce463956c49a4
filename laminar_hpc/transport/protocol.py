"""The control-plane message protocol: msgpack maps with a `type`, checked against a schema.

Every frame that crosses a socket goes through `decode`, which enforces a size limit and the
schema of its type; anything else raises `DecodeError`, which receivers log and drop (a bad
frame never crashes a role). The table below is the whole protocol; docs/architecture.md
draws who sends what.

    frame = encode({"type": "want_work", "credit": 8, "version": 3})
    msg = decode(frame)          # -> dict, or DecodeError
"""
from __future__ import annotations

from typing import Any

import msgpack

MAX_FRAME_BYTES = 64 << 20

# field kinds
INT, FLOAT, STR, BOOL, MAP = "int", "float", "str", "bool", "map"
INTS, FLOATS, MAPS, STRS = "list[int]", "list[float]", "list[map]", "list[str]"
OPT = "?"  # suffix: the field may be missing or None

TRAJECTORY = {  # one finished (or partial, when migrating) trajectory
    "traj_id": STR, "group_id": INT, "problem": INT, "version": INT, "prompt": INTS,
    "tokens": INTS, "logprobs": FLOATS, "reward": FLOAT + OPT, "rollout": INT,
    "t_start": FLOAT, "t_end": FLOAT + OPT, "finish": STR + OPT,
    "version_last": INT + OPT,  # partial-rollout only: the version of its last tokens (`version`: its first)
}
WORK = {  # one trajectory to generate, controller -> rollout
    "traj_id": STR, "group_id": INT, "problem": INT, "prompt": INTS, "max_new_tokens": INT,
    "tokens": INTS + OPT, "logprobs": FLOATS + OPT, "version": INT + OPT,
}

# offset: tokens of the trajectory before this chunk (a lost chunk is detected, never glued over)
STREAM_ITEM = {"traj_id": STR, "tokens": INTS, "logprobs": FLOATS, "version": INT, "offset": INT + OPT}

SCHEMA: dict[str, dict[str, str]] = {
    # any role -> controller
    "hello": {"role": STR, "rank": INT, "pid": INT},
    # role -> controller with its pid (a restarted controller learns who is there); controller ->
    # role with its epoch (a role that sees a new epoch re-sends its state: resync, trainer_sync)
    # echo: the role's `t` this answers (round trip and clock offset, for aligned traces)
    "heartbeat": {"t": FLOAT, "pid": INT + OPT, "epoch": STR + OPT, "echo": FLOAT + OPT},
    "log_event": {"event": STR, "fields": MAP},
    # rollout -> controller
    "want_work": {"credit": INT, "version": INT},  # credit: slots freed since the last ask
    "stream": {"items": MAPS},  # {"traj_id", "tokens", "logprobs", "version"}
    "finished": {"trajectory": MAP},
    "weights_loaded": {"version": INT, "pull_s": FLOAT},
    # to a restarted controller: the trajectories this rollout holds and its free slots
    "resync": {"held": STRS, "free": INT, "version": INT, "pid": INT},
    # batch and KV of a replica, for the rollout manager's repack; utilisation counters (wall s)
    "rollout_state": {"version": INT, "waiting": INT, "running": INT, "kv_tokens": INT, "kv_peak": INT,
                      "traj_ids": STRS, "busy_s": FLOAT, "weight_wait_s": FLOAT},
    "migrated": {"dest": INT, "trajectories": MAPS},  # repack: running trajectories handed back
    "migrate_reject": {"traj_ids": STRS},  # repack work whose version this replica no longer holds
    # controller -> rollout
    "assign": {"work": MAPS},
    "migrate": {"traj_ids": STRS, "dest": INT},  # repack: hand these to replica `dest`
    "update_weights": {"version": INT},  # barrier modes, partial-rollout: load this version (or newer) now
    "resume": {"version": INT},  # partial-rollout: every rollout holds this version: continue
    # controller -> trainer
    "weights_synced": {"version": INT},  # partial-rollout: the global weight update is complete
    # trainer -> controller
    "want_groups": {"n": INT, "reset": BOOL + OPT},  # reset: n replaces the credit (after a resync)
    # groups: trained in this step; stale: dropped for staleness since the last step
    "train_step": {"metrics": MAP, "groups": INTS + OPT, "stale": INTS + OPT},
    # the trainer's lineage after it (re)started or the controller restarted: every group its
    # weights were trained on (the first committed_n are in its checkpoint) and what it holds
    "trainer_sync": {"consumed": INTS, "committed_n": INT, "held": INTS, "step": INT, "version": INT},
    "published": {"version": INT, "stall_s": FLOAT},
    "checkpoint_saved": {"step": INT, "version": INT, "path": STR, "groups": INTS + OPT},
    "trainer_done": {"steps": INT},
    # controller -> trainer
    "groups": {"groups": MAPS},  # {"group_id", "problem", "trajectories": [TRAJECTORY]}
    # relay -> controller
    "version_ready": {"rank": INT, "version": INT, "nbytes": INT, "bcast_s": FLOAT},
    # trainer <-> master relay (weight hand-off)
    "publish": {"version": INT, "slot": INT, "nbytes": INT, "layout": STR, "t": FLOAT},
    "released": {"slot": INT, "version": INT},
    # launcher / campaign driver -> controller
    "role_down": {"role": STR, "code": INT},
    "stop_all": {"reason": STR},
    # controller -> any role
    "stop": {"reason": STR},
    "hello_ack": {"run_id": STR, "max_version": INT + OPT},  # newest version any trainer published
}


class DecodeError(ValueError):
    """A frame that does not follow the protocol (too big, not msgpack, wrong fields)."""


def encode(msg: dict[str, Any]) -> bytes:
    check(msg)
    return msgpack.packb(msg, use_bin_type=True)


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    if len(frame) > max_bytes:
        raise DecodeError(f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several types for garbage input
        raise DecodeError(f"not a msgpack frame: {type(err).__name__}: {err}") from None
    check(msg)
    return msg


def check(msg: Any) -> None:
    if not isinstance(msg, dict):
        raise DecodeError(f"message must be a map, got {type(msg).__name__}")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise DecodeError(f"unknown message type {kind!r}")
    _check_fields(msg, SCHEMA[kind], kind)
    if kind == "finished":
        _check_fields(msg["trajectory"], TRAJECTORY, "finished.trajectory")
    elif kind == "assign":
        for w in msg["work"]:
            _check_fields(w, WORK, "assign.work")
    elif kind == "migrated":
        for t in msg["trajectories"]:
            _check_fields(t, TRAJECTORY, "migrated.trajectory")
    elif kind == "groups":
        for g in msg["groups"]:
            _check_fields(g, {"group_id": INT, "problem": INT, "trajectories": MAPS}, "groups.group")
            for t in g["trajectories"]:
                _check_fields(t, TRAJECTORY, "groups.trajectory")
    elif kind == "stream":
        for it in msg["items"]:
            _check_fields(it, STREAM_ITEM, "stream.item")


def _check_fields(obj: Any, spec: dict[str, str], where: str) -> None:
    if not isinstance(obj, dict):
        raise DecodeError(f"{where}: expected a map, got {type(obj).__name__}")
    for name, kind in spec.items():
        optional = kind.endswith(OPT)
        kind = kind.rstrip(OPT)
        if name not in obj or obj[name] is None:
            if optional:
                continue
            raise DecodeError(f"{where}: missing field '{name}'")
        if not _is(obj[name], kind):
            raise DecodeError(f"{where}: field '{name}' must be {kind}, got {type(obj[name]).__name__}")


_EXACT = {INT: {int}, FLOAT: {float, int}, STR: {str}, BOOL: {bool}, "map": {dict}}


def _is(value: Any, kind: str) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == FLOAT:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == MAP:
        return isinstance(value, dict)
    if not isinstance(value, list):
        return False
    elem = kind[5:-1]
    # the common case in C (set of the element types): token and log-prob lists are long, and a
    # Python-level check per element cost the controller a quarter of its time under load
    if set(map(type, value)) <= _EXACT.get(elem, set()):
        return True
    if elem == "map":
        return all(isinstance(v, dict) for v in value)
    return all(_is(v, elem) for v in value)
