"""Where the trajectories of a dead rollout continue: a pure function, shared by the runtime,
the tests and the simulator.

Where a trajectory must finish on the version it started with (pure laminar, the barrier modes),
it keeps its tokens and behaviour log-probs only if it continues under that version: each goes
to a live replica that holds that version now (the least loaded first, spreading them out), or,
if none does, starts again from its prompt. Where versions are recorded per token span
(`any_version`: laminar's refresh in flight, partial-rollout), any live replica will do.

    place_detached([("4.1", 7), ("4.2", 7), ("5.0", 6)], replica_versions={0: 7, 2: 7, 3: 8},
                   load={0: 10, 2: 3})   # -> {"4.1": 2, "4.2": 2, "5.0": None}
(The controller's component that applies these decisions is controller/recovery.py.)
"""
from __future__ import annotations

from collections.abc import Mapping


def place_detached(trajs: list[tuple[str, int | None]], replica_versions: dict[int, int],
                   load: dict[int, int], max_batch: int | None = None,
                   any_version: bool = False, capacity: Mapping[int, int] | None = None) -> dict[str, int | None]:
    """trajs: (traj_id, version); replica_versions: live replicas and the version each holds;
    load: trajectories each replica runs or has queued. Returns traj_id -> replica, or None for
    "restart from the prompt". A replica takes at most `max_batch` in total, when given (or its
    own `capacity[rank]`: an elastic joiner's max_batch)."""
    load = {r: load.get(r, 0) for r in replica_versions}
    limit = {r: (capacity or {}).get(r, max_batch) for r in replica_versions}
    out: dict[str, int | None] = {}
    for tid, version in trajs:
        fits = [r for r, v in replica_versions.items()
                if version is not None and (any_version or v == version) and (limit[r] is None or load[r] < limit[r])]
        if not fits:
            out[tid] = None
            continue
        dest = min(fits, key=lambda r: (load[r], r))
        load[dest] += 1
        out[tid] = dest
    return out
