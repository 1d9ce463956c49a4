"""The partial-response pool's queue (controller/trajqueue.py): a deque of unique ids whose
membership test is a set lookup, kept in step through every way the data plane changes it."""
from __future__ import annotations

import pickle
import random

import pytest

from laminar_hpc.controller.trajqueue import TrajQueue


def test_membership_follows_every_change():
    q = TrajQueue(["a", "b"])
    q.append("c")
    q.appendleft("z")
    assert list(q) == ["z", "a", "b", "c"] and all(x in q for x in "zabc") and "y" not in q
    assert q.popleft() == "z" and "z" not in q
    q.remove("b")
    assert "b" not in q and list(q) == ["a", "c"]
    assert q.pop() == "c" and "c" not in q
    del q[0]
    assert "a" not in q and len(q) == 0
    q.extend(["d", "e"])
    q.clear()
    assert "d" not in q and not q


def test_an_id_is_queued_once():
    q = TrajQueue(["a"])
    with pytest.raises(ValueError):
        q.append("a")
    with pytest.raises(ValueError):
        TrajQueue(["b", "b"])
    with pytest.raises(TypeError):
        q[0] = "x"


def test_random_operations_agree_with_a_plain_deque():
    rng = random.Random(0)
    q, ref = TrajQueue(), []
    for i in range(3000):
        op = rng.random()
        if op < 0.4:
            (q.append if rng.random() < 0.5 else q.appendleft)(f"t{i}")
            ref.append(f"t{i}") if q[-1] == f"t{i}" else ref.insert(0, f"t{i}")
        elif op < 0.6 and ref:
            assert q.popleft() == ref.pop(0)
        elif op < 0.8 and ref:
            x = rng.choice(ref)
            q.remove(x)
            ref.remove(x)
        probe = f"t{rng.randrange(i + 1)}"
        assert (probe in q) == (probe in ref) and list(q) == ref


def test_it_pickles_and_copies_with_its_ids():
    q = TrajQueue(["a", "b"])
    for other in (pickle.loads(pickle.dumps(q)), q.copy()):
        assert type(other) is TrajQueue and list(other) == ["a", "b"] and "b" in other
