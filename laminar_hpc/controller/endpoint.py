"""Where the controller's socket lives: an ipc:// path no other user can reach when every role
is on this machine, TCP otherwise (`controller.transport`, config/schema.py).

`auto` binds ipc:// when `controller.host` is loopback (a loopback TCP socket is reachable only
from this machine, so every role is here anyway): the socket file is `endpoints/controller.sock`
in the run directory, which only its owner may enter (launch/ownership.py checks it at every
start), or, when that path is over the 107 bytes of an AF_UNIX path, `controller.sock` in the
start's private shared-memory directory (transport/shm_dir.py: 0700, created exclusively). No
other local user can connect at all, so none can hold the controller's descriptors; CURVE still
authenticates every peer. A Slurm run across nodes binds TCP on the node's address, as before.
A restarted controller binds the same address: the same path, or its old TCP port.

    server = bind(rd, cfg)          # -> transport.channel.Server; publish server.address
"""
from __future__ import annotations

import os
from pathlib import Path

from laminar_hpc.rundir import RunDir, RunDirError, read_json
from laminar_hpc.transport.channel import AF_UNIX_PATH_MAX, Server
from laminar_hpc.transport.security import is_loopback, server_keys
from laminar_hpc.transport.shm_dir import open_private_dir

SOCKET_NAME = "controller.sock"


def uses_ipc(controller_cfg) -> bool:
    t = controller_cfg.transport
    return t == "ipc" or (t == "auto" and is_loopback(controller_cfg.host))


def ipc_path(rd: RunDir) -> Path:
    """The controller's ipc:// path: in the run directory, else in the start's private
    shared-memory directory; RunDirError (one line) when neither fits an AF_UNIX path."""
    first = Path(os.path.abspath(rd.endpoints_dir)) / SOCKET_NAME
    if _fits(first):
        first.parent.mkdir(mode=0o700, exist_ok=True)  # (made with the run directory by the launcher)
        return first
    shm = Path(os.path.abspath(rd.shm_run_dir))
    second = shm / SOCKET_NAME
    if _fits(second):
        os.close(open_private_dir(shm, create=True))  # ours alone (0700), or refused naming who made it
        return second
    raise RunDirError(f"the controller's socket path {first} (and {second}) is over the {AF_UNIX_PATH_MAX} bytes of "
                      "a Unix socket path: use a shorter run directory (or relay.shm_dir), or set "
                      "controller.transport: tcp")


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= AF_UNIX_PATH_MAX


def bind(rd: RunDir, cfg) -> Server:
    ctl = cfg.controller
    keys = server_keys(rd.path, "controller", ctl)
    max_frame = int(ctl.max_frame_mb * 2**20)
    if uses_ipc(ctl):
        rd = RunDir(rd.path, shm_dir=cfg.relay.shm_dir, run_id=rd.run_id)  # (its shared memory: the fallback)
        return Server(ctl.host, max_frame, keys=keys, ipc=ipc_path(rd))
    old = read_json(rd.endpoint("controller")) or {}
    address = str(old.get("address", ""))
    port = int(address.rsplit(":", 1)[1]) if address.startswith("tcp://") else None  # a restart keeps its address
    return Server(ctl.host, max_frame, port=port, keys=keys)
