"""Where a role's server socket lives: an ipc:// path no other user can reach when every role is
on this machine, TCP otherwise (`controller.transport`, config/schema.py).

Roles that bind a server: the controller (`controller`), the master relay (`relay_master`,
which takes the trainer's publish notices, and `relay_leaves`, which feeds joiners' leaf relays:
relay/leaf.py), each stream shard (`shard-N`) and each judge (`judge-N`, laminar_hpc/judge/). `auto` binds ipc:// when `controller.host` is loopback
(a loopback TCP socket is reachable only from this machine, so every role is here anyway): the
socket file is `endpoints/<name>.sock` in the run directory, which only its owner may enter
(startup/ownership.py checks it at every start), or, when that path is over the 107 bytes of an
AF_UNIX path, `<name>.sock` in the start's private shared-memory directory (transport/shm_dir.py:
0700, created exclusively). No other local user can connect at all, so none can hold the
server's descriptors; CURVE still authenticates every peer. A Slurm run across nodes binds TCP on
the node's address, as before. A restarted server binds the same address: the same path, or its
old TCP port.

    server = bind(rd, cfg, "controller", server_keys(rd.path, "controller", cfg.controller))
    publish_endpoint(rd, "controller", server.address)
"""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from laminar_hpc.config.schema import Config, ControllerCfg
from laminar_hpc.rundir import RunDir, RunDirError, read_json
from laminar_hpc.transport.channel import AF_UNIX_PATH_MAX, AddressInUse, Server
from laminar_hpc.transport.security import ServerKeys, is_loopback
from laminar_hpc.transport.shm_dir import open_private_dir

SERVER_ENDPOINTS = ("controller", "relay_master", "relay_leaves")  # the endpoint names of the roles that bind a server
log = logging.getLogger(__name__)


RANKED_SERVERS = ("shard", "judge")  # roles of which each rank binds a server: stream shards, judges


def is_shard(name: str) -> bool:
    """A stream shard's endpoint name ('shard-3', controller/shard.py)."""
    kind, _, rank = name.partition("-")
    return kind == "shard" and rank.isdigit()


def is_ranked_server(name: str) -> bool:
    """A stream shard's or a judge's endpoint name ('shard-3', 'judge-0': laminar_hpc/judge/)."""
    kind, _, rank = name.partition("-")
    return kind in RANKED_SERVERS and rank.isdigit()


def socket_name(name: str) -> str:
    return f"{name}.sock"


def uses_ipc(controller_cfg: ControllerCfg) -> bool:
    t = controller_cfg.transport
    return t == "ipc" or (t == "auto" and is_loopback(controller_cfg.host))


def ipc_path(rd: RunDir, name: str = "controller") -> Path:
    """The ipc:// path of server `name`: in the run directory, else in the start's private
    shared-memory directory; RunDirError (one line) when neither fits an AF_UNIX path."""
    first = Path(os.path.abspath(rd.endpoints_dir)) / socket_name(name)
    if _fits(first):
        first.parent.mkdir(mode=0o700, exist_ok=True)  # (made with the run directory by the launcher)
        return first
    shm = Path(os.path.abspath(rd.shm_run_dir))
    second = shm / socket_name(name)
    if _fits(second):
        os.close(open_private_dir(shm, create=True))  # ours alone (0700), or refused naming who made it
        return second
    raise RunDirError(f"the {name} socket path {first} (and {second}) is over the {AF_UNIX_PATH_MAX} bytes of a "
                      "Unix socket path: use a shorter run directory (or relay.shm_dir), or set "
                      "controller.transport: tcp")


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= AF_UNIX_PATH_MAX


def own_address_towards(host: str) -> str:
    """This node's address on the route to `host` (the controller's): where a server on a node
    other than the controller's binds, so that the controller's side of the cluster reaches it.
    A UDP socket's connect sends nothing; it only picks the route and its source address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def bind(rd: RunDir, cfg: Config, name: str, keys: ServerKeys | None, *, own_node: bool = False) -> Server:
    """Server `name` (one of SERVER_ENDPOINTS) of this run: ipc:// or TCP, as `uses_ipc` says; on TCP a
    restart binds the port its endpoint file names. TCP binds the controller's host, or with
    `own_node` (a judge, which may run on a node of its own) this node's address towards it."""
    if name not in SERVER_ENDPOINTS and not is_ranked_server(name):
        raise ValueError(f"{name!r} is not a server of a run ({', '.join(SERVER_ENDPOINTS)}, shard-N, judge-N)")
    ctl = cfg.controller
    max_frame = int(ctl.max_frame_mb * 2**20)
    if uses_ipc(ctl):
        rd = RunDir(rd.path, shm_dir=cfg.relay.shm_dir, run_id=rd.run_id)  # (its shared memory: the fallback)
        return Server(ctl.host, max_frame, keys=keys, ipc=ipc_path(rd, name))
    host = own_address_towards(ctl.host) if own_node and not is_loopback(ctl.host) else ctl.host
    old = read_json(rd.endpoint(name)) or {}
    address = str(old.get("address", ""))
    port = int(address.rsplit(":", 1)[1]) if address.startswith("tcp://") else None  # a restart keeps its address
    if port is None or not address.startswith(f"tcp://{host}:"):  # (a judge restarted on another node: any port)
        return Server(host, max_frame, keys=keys)
    try:
        return Server(host, max_frame, port=port, keys=keys)
    except AddressInUse:  # another process (another user's, on a shared node) took it meanwhile
        server = Server(host, max_frame, keys=keys)
        log.warning("%s: its port %d is taken by another process: bound %s instead; the roles read it from %s "
                    "when they reconnect", name, port, server.address, rd.endpoint(name))
        return server
