"""Helpers shared by several test modules (tests/ is on sys.path under pytest): nested-state
equality; protocol messages built from the structs' own type declarations (so a field added
to transport/protocol.py is sampled, mutated and fuzzed without touching the tests); and a role's
context with an in-process channel, to drive a role's message handling without processes."""
from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path
from typing import Callable

import msgspec.inspect as mi
from hypothesis import strategies as st

from laminar_hpc.config import load_config
from laminar_hpc.launch.role import RoleContext
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.transport import protocol
from laminar_hpc.transport.protocol import Group, Message, Trajectory, WorkItem, decode, encode

REPO = Path(__file__).resolve().parents[1]


def assert_nested_equal(a, b, path: str = "") -> None:
    """Bit-exact equality of nested state (state_dicts, optimizer state): tensors by dtype, shape
    and value; containers element by element; `path` names the first difference."""
    import torch
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_nested_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


# -- protocol messages from their declarations --------------------------------------------------
MESSAGE_TYPES = sorted(protocol.MESSAGE_TYPES, key=lambda t: protocol.TYPE_NAMES[t])
_SCALAR = {mi.IntType: 7, mi.FloatType: 1.25, mi.StrType: "abc", mi.BoolType: True, mi.NoneType: None}


def fields(cls: type) -> tuple:
    return mi.type_info(cls).fields


def sample_value(t, full: bool = True):
    """A valid value of type `t` (msgspec.inspect); lists get two elements, so nested records are
    exercised; `full`: nested structs carry their optional fields too."""
    if type(t) in _SCALAR:
        return _SCALAR[type(t)]
    if isinstance(t, mi.UnionType):
        return sample_value(next(x for x in t.types if not isinstance(x, mi.NoneType)), full)
    if isinstance(t, mi.ListType):
        return [sample_value(t.item_type, full) for _ in range(2)]
    if isinstance(t, mi.DictType):
        return {"k": sample_value(t.value_type, full)}
    if isinstance(t, mi.StructType):
        return sample(t.cls, full)
    raise TypeError(f"no sample for {t}: extend tests/helpers.py")


def sample(cls: type, full: bool = True):
    """An instance of struct `cls` with every field set (`full`) or only the required ones."""
    return cls(**{f.name: sample_value(f.type, full) for f in fields(cls) if full or f.required})


_INT = st.integers(-2**63, 2**63 - 1)
_SCALAR_STRATEGY = {mi.IntType: _INT, mi.FloatType: st.floats(allow_nan=False) | _INT.map(float),
                    mi.StrType: st.text(max_size=8), mi.BoolType: st.booleans(), mi.NoneType: st.none()}


def strategy(t):
    """Hypothesis strategy of valid values of type `t` (msgspec.inspect), structs included
    (each optional field present or not)."""
    if type(t) in _SCALAR_STRATEGY:
        return _SCALAR_STRATEGY[type(t)]
    if isinstance(t, mi.UnionType):
        return st.one_of(*(strategy(x) for x in t.types))
    if isinstance(t, mi.ListType):
        return st.lists(strategy(t.item_type), max_size=3)
    if isinstance(t, mi.DictType):
        return st.dictionaries(strategy(t.key_type), strategy(t.value_type), max_size=3)
    if isinstance(t, mi.StructType):
        fs = t.fields
        return st.fixed_dictionaries({f.name: strategy(f.type) for f in fs if f.required},
                                     optional={f.name: strategy(f.type) for f in fs if not f.required}
                                     ).map(lambda kw, cls=t.cls: cls(**kw))
    raise TypeError(f"no strategy for {t}: extend tests/helpers.py")


def messages():
    """Any valid protocol message."""
    return st.one_of(*(strategy(mi.type_info(cls)) for cls in MESSAGE_TYPES))


# -- trajectories and work items ------------------------------------------------------------------
def work_item(i: int = 0, *, group: int = 0, prompt=(1, 2, 3), max_new_tokens: int = 512, **over) -> WorkItem:
    return WorkItem(traj_id=f"{group}.{i}", group_id=group, problem=group, prompt=list(prompt),
                    max_new_tokens=max_new_tokens, **over)


def trajectory(i: int = 0, *, group: int = 0, version: int = 0, tokens=(4, 5, 6), reward: float = 1.0,
               **over) -> Trajectory:
    tokens = list(tokens)
    kw = dict(traj_id=f"{group}.{i}", group_id=group, problem=group, version=version, prompt=[1, 2, 3],
              tokens=tokens, logprobs=[-0.5] * len(tokens), rollout=0, t_start=10.0, reward=reward, t_end=11.0,
              finish="eos")
    return Trajectory(**{**kw, **over})


def group(group_id: int, *, n: int = 2, version: int = 0, rewards=None) -> Group:
    rewards = rewards or [float(i % 2) for i in range(n)]
    return Group(group_id=group_id, problem=group_id,
                 trajectories=[trajectory(i, group=group_id, version=version, reward=r) for i, r in enumerate(rewards)])


# -- a role in-process ----------------------------------------------------------------------------
class FakeChannel:
    """A role's channel to the controller, in-process. What the role sends goes through the real
    encode/decode (a message that would not survive the wire fails here) and is kept in `sent`;
    `inbox` feeds `recv`/`drain`, refilled from `script()` (the controller's side: it sees what
    was sent so far) whenever it is empty."""

    address = "tcp://127.0.0.1:9"  # for a heartbeat thread's own socket (tests keep it asleep)

    def __init__(self, script: Callable[["FakeChannel"], list[Message]] | None = None):
        self.sent: list[Message] = []
        self.inbox: deque[Message] = deque()
        self.script = script

    def send(self, msg: Message, timeout_s: float | None = None) -> None:
        self.sent.append(decode(encode(msg)))

    def _refill(self) -> None:
        if not self.inbox and self.script is not None:
            self.inbox.extend(self.script(self))

    def recv(self, timeout_s: float) -> Message | None:
        self._refill()
        return self.inbox.popleft() if self.inbox else None

    def drain(self) -> list[Message]:
        self._refill()
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def of(self, cls: type) -> list:
        return [m for m in self.sent if isinstance(m, cls)]

    def close(self, linger_ms: int = 0) -> None:
        pass


def role_context(role: str, rank: int, run_dir: Path, config: str = "configs/tiny-emulated.yaml",
                 overrides: tuple[str, ...] = ()) -> RoleContext:
    """The context `start_role` would give, with a FakeChannel as `ctrl`; shared memory under
    `run_dir`, no sleeping in emulated engines, heartbeat threads that never wake in a test."""
    cfg = load_config(REPO / config, [f"relay.shm_dir={run_dir}", "emulation.time_scale=0",
                                      "supervisor.heartbeat_interval_s=3600", *overrides])
    name = f"{role}-{rank}"
    tracer = Tracer(run_dir, name, enabled=True)  # on: an event outside the trace catalogue fails the test
    return RoleContext(role, rank, cfg, Path(run_dir), f"test{os.getpid()}", FakeChannel(), tracer,
                       logging.getLogger(name))
