"""The control plane's per-run secrets: one ZeroMQ CURVE keypair per party, in `run_dir/secrets/`.

Every socket of the control plane authenticates, on loopback too: a shared login or compute
node has other users, and loopback is no trust boundary. `controller.auth: auto` (the default)
and `curve` both mean CURVE; `none` is an explicit opt-out that every process logs a warning
about.

There is one keypair per party, so that a key proves a role KIND (transport/authz.py): the
controller's server key, and one client key per kind: launcher, trainer, rollout, relay. The
master relay's hand-off server (the trainer's `publish`) serves with the relay's keypair. Each
keypair is two files, `curve_<name>.key` (public and secret) and `curve_<name>.pub` (public
only), 0600 in a 0700 directory. A process reads only its own secret and the public keys it
needs: a client its kind's secret and the server's public key; a server its secret and the
public keys of the kinds it admits (authz.ADMITS), each mapped to its kind.

    ensure_keys(run_dir)                                         # the launcher, at every start
    ctrl = Client(address, "rollout-3", keys=client_keys(run_dir, "rollout", cfg.controller))
    server = Server(cfg.controller.host, keys=server_keys(run_dir, "controller", cfg.controller))
    # the weight hand-off: the trainer's client and the master relay's server
    Client(address, "trainer-0", keys=client_keys(run_dir, "trainer", cfg.controller, server="relay"))
    Server(cfg.controller.host, keys=server_keys(run_dir, "relay", cfg.controller))

`client_keys`/`server_keys` return None under `auth: none` (sockets then run unkeyed). Keys
are created once and kept on a resumed run; a run directory from before per-kind keys (only
`curve_server.key`/`curve_client.key`) gets the missing ones at its next start.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.authz import ADMITS, KINDS

if TYPE_CHECKING:
    from laminar_hpc.config.schema import ControllerCfg

log = logging.getLogger(__name__)

SERVERS = tuple(ADMITS)  # "controller", "relay", "relay_leaves": whose server keys a client may need
KEYPAIRS = ("controller", *KINDS)  # the relay's doubles as the hand-off and leaf servers', a judge's serves its rollouts
# the relay's keypair serves joiners' leaf relays; the controller's its stream shards (a rollout's
# key reaches its shard as it reaches the controller)
SERVER_KEYPAIR = {"relay_leaves": "relay", "shard": "controller"}  # a server whose keypair is another's (default: its own name)
_Z85_KEY_LEN = 40  # a 32-byte Curve25519 key in Z85


class KeyFileError(RuntimeError):
    """A key file of the run is missing or unreadable; the message names it and the fix."""


@dataclass(frozen=True)
class ClientKeys:
    """What a client socket needs: the server's public key and its own kind's keypair (Z85)."""
    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)  # never printed into logs or tracebacks


@dataclass(frozen=True)
class ServerKeys:
    """What a server socket needs: its keypair and the admitted clients' public keys, each
    mapped to the role kind it proves (Z85 bytes -> 'rollout', ...)."""
    public: bytes
    secret: bytes = field(repr=False)
    clients: dict[bytes, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class PlainServerKeys:
    """An ipc:// server that authenticates its peers without encrypting (ZeroMQ PLAIN): each
    admitted kind's password (`plain_password`). On ipc:// nobody can read the bytes on the way
    (a socket in a 0700 directory, other users refused by ZMQ_IPC_FILTER_UID); what PLAIN adds is
    that a process of this user without the run's keys (tool code in its sandbox) is refused."""
    passwords: dict[str, str] = field(repr=False)


@dataclass(frozen=True)
class PlainClientKeys:
    """A PLAIN client: its kind (the user name) and that kind's password."""
    kind: str
    password: str = field(repr=False)


def plain_password(secret: bytes, server: str) -> str:
    """A kind's password on `server`: derived from its CURVE secret (never the secret itself)."""
    return hmac.new(secret, f"laminar PLAIN {server}".encode(), hashlib.sha256).hexdigest()


def plain_server_keys(run_dir: RunDir | Path, server: str,
                      controller_cfg: ControllerCfg | None = None) -> PlainServerKeys | None:
    """PLAIN passwords of the kinds `server` admits (authz.ADMITS), from their key files, which
    its process may read (the leaf relays' server: the relay's own); None under `auth: none`."""
    if server not in SERVERS:
        raise ValueError(f"no server keys for {server!r}: servers are {SERVERS}")
    if not _authenticating(controller_cfg):
        return None
    return PlainServerKeys(passwords={kind: plain_password(_read_keypair(key_file(run_dir, kind))[1], server)
                                      for kind in ADMITS[server]})


def plain_client_keys(run_dir: RunDir | Path, kind: str, server: str,
                      controller_cfg: ControllerCfg | None = None) -> PlainClientKeys | None:
    """A `Client`'s PLAIN credentials as `kind` on `server`; None under `auth: none`."""
    if kind not in KINDS or server not in SERVERS:
        raise ValueError(f"no client keys for kind {kind!r} and server {server!r}")
    if not _authenticating(controller_cfg):
        return None
    return PlainClientKeys(kind=kind, password=plain_password(_read_keypair(key_file(run_dir, kind))[1], server))


def key_file(run_dir: RunDir | Path, name: str) -> Path:
    return _secrets_dir(run_dir) / f"curve_{name}.key"


def public_file(run_dir: RunDir | Path, name: str) -> Path:
    return _secrets_dir(run_dir) / f"curve_{name}.pub"


def ensure_keys(run_dir: RunDir | Path) -> None:
    """Create every missing keypair of the run; keep existing ones (a resumed run), tighten their
    permissions, and rewrite each public file from its key file (the key file is the truth)."""
    sdir = _secrets_dir(run_dir)
    sdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(sdir, 0o700)  # mkdir's mode is masked by the umask, and an old dir may be looser
    for name in KEYPAIRS:
        path = key_file(run_dir, name)
        if path.exists():
            os.chmod(path, 0o600)
        else:
            _create_keypair_file(path)
        public, _ = _read_keypair(path)
        pub = public_file(run_dir, name)
        try:
            current = pub.read_bytes()
        except FileNotFoundError:
            current = None
        if current != public + b"\n":
            _write_private(pub, public + b"\n", exclusive=False)
        else:
            os.chmod(pub, 0o600)


def auth_enabled(controller_cfg: ControllerCfg) -> bool:
    """Whether the control plane authenticates: always, unless `controller.auth: none`."""
    return controller_cfg.auth != "none"


def client_keys(run_dir: RunDir | Path, kind: str, controller_cfg: ControllerCfg | None = None,
                server: str = "controller") -> ClientKeys | None:
    """Keys for a `Client` of role kind `kind` talking to `server` ('controller', or 'relay' for
    the master relay's hand-off); None under `auth: none` (no `controller_cfg`: keys)."""
    if kind not in KINDS or server not in SERVERS:
        raise ValueError(f"no client keys for kind {kind!r} and server {server!r}: kinds are {KINDS}, "
                         f"servers {SERVERS}")
    if not _authenticating(controller_cfg):
        return None
    public, secret = _read_keypair(key_file(run_dir, kind))
    server_pub = public_file(run_dir, SERVER_KEYPAIR.get(server, server))
    return ClientKeys(server_public=_read_public(server_pub), public=public, secret=secret)


def server_keys(run_dir: RunDir | Path, server: str = "controller",
                controller_cfg: ControllerCfg | None = None) -> ServerKeys | None:
    """Keys for a `Server` ('controller', or 'relay' for the master relay's hand-off): its keypair
    and the public keys of the kinds it admits; None under `auth: none` (no `controller_cfg`: keys)."""
    if server not in SERVERS:
        raise ValueError(f"no server keys for {server!r}: servers are {SERVERS}")
    if not _authenticating(controller_cfg):
        return None
    public, secret = _read_keypair(key_file(run_dir, SERVER_KEYPAIR.get(server, server)))
    clients = {_read_public(public_file(run_dir, kind)): kind for kind in ADMITS[server]}
    return ServerKeys(public=public, secret=secret, clients=clients)


_warned_open = False


def _authenticating(controller_cfg: ControllerCfg | None) -> bool:
    global _warned_open
    if controller_cfg is None or auth_enabled(controller_cfg):
        return True
    if not _warned_open:  # once per process: every role's log says it
        _warned_open = True
        log.warning("controller.auth: none: the control plane on %s accepts any process that can connect "
                    "(on loopback: every user of this machine), which can stop the campaign or feed it data; "
                    "remove the setting (auth: auto) to authenticate every connection with the run's keys",
                    controller_cfg.host)
    return False


def is_loopback(host: str) -> bool:
    """True only when `host` surely means this machine's loopback; anything unknown is not."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:  # a hostname (or interface name, or `*`): loopback only if it resolves there
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, UnicodeError, ValueError):
            return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1 is loopback, though ipaddress says otherwise before 3.13
    return addr.is_loopback


def _secrets_dir(run_dir: RunDir | Path) -> Path:
    return RunDir.of(run_dir).secrets_dir


def _write_private(path: Path, data: bytes, exclusive: bool) -> None:
    """Write `path` (0600) through a temp file: atomically replaced, or with `exclusive` linked
    only if absent (a concurrent creator's file wins, so every process reads the same key)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _create_keypair_file(path: Path) -> None:
    public, secret = zmq.curve_keypair()
    _write_private(path, (json.dumps({"public": public.decode(), "secret": secret.decode()}) + "\n").encode(),
                   exclusive=True)


def _missing(path: Path) -> KeyFileError:
    return KeyFileError(f"CURVE key file {path} is missing: the launcher writes it at run start "
                        f"(laminar_hpc.transport.security.ensure_keys(run_dir)); start this role through the "
                        f"launcher with the same run directory (controller.auth: none turns authentication "
                        f"off, for a trusted machine only)")


def _unreadable(path: Path) -> KeyFileError:
    return KeyFileError(f"cannot read CURVE key file {path}: permission denied; run this role as the user "
                        f"that owns the run directory")


def _damaged(path: Path, what: str) -> KeyFileError:
    return KeyFileError(f"CURVE key file {path} {what}; delete {path.parent} to make new keys at the next "
                        f"start (every role must then be restarted)")


def _read_keypair(path: Path) -> tuple[bytes, bytes]:
    try:
        data = json.loads(path.read_text())
        public, secret = data["public"].encode("ascii"), data["secret"].encode("ascii")
    except FileNotFoundError:
        raise _missing(path) from None
    except PermissionError:
        raise _unreadable(path) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise _damaged(path, f"is unreadable ({type(err).__name__}: {err})") from None
    try:  # a damaged or hand-edited file: fail here, naming it, not deep inside a socket option
        matches = len(public) == _Z85_KEY_LEN and zmq.curve_public(secret) == public
    except (zmq.ZMQError, ValueError):
        matches = False
    if not matches:
        raise _damaged(path, "holds a malformed or mismatched keypair")
    return public, secret


def _read_public(path: Path) -> bytes:
    try:
        public = path.read_bytes().strip()
    except FileNotFoundError:
        raise _missing(path) from None
    except PermissionError:
        raise _unreadable(path) from None
    except OSError as err:
        raise _damaged(path, f"is unreadable ({type(err).__name__}: {err})") from None
    try:
        valid = len(public) == _Z85_KEY_LEN and len(z85.decode(public)) == 32
    except (KeyError, ValueError, TypeError):
        valid = False
    if not valid:
        raise _damaged(path, "does not hold a Z85 public key")
    return public
