"""The per-run secret of the control plane: ZeroMQ CURVE keypairs kept in `run_dir/secrets/`.

Off a loopback address every connection must prove the run's secret. At run start the launcher
calls `ensure_keys(run_dir)`, which writes a server and a client keypair (files 0600 in a 0700
directory; kept as they are on a resumed run). Each role then asks `channel_keys` and hands the
result to `Server`/`Client`: the server accepts only the run's client key, so a process that
cannot read the run directory cannot talk to (or impersonate) any role.

    keys = ensure_keys(run_dir)                                   # launcher, once
    keys = channel_keys(run_dir, cfg.controller)                  # each role: Keys, or None
    server = Server(cfg.controller.host, keys=keys)
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import zmq

from laminar_hpc.rundir import RunDir

SERVER_KEY_FILE = "curve_server.key"
CLIENT_KEY_FILE = "curve_client.key"
_Z85_KEY_LEN = 40  # a 32-byte Curve25519 key in Z85


class KeyFileError(RuntimeError):
    """A key file of the run is missing or unreadable; the message names it and the fix."""


@dataclass(frozen=True)
class Keys:
    """The run's CURVE keys, Z85-encoded bytes as `zmq.curve_keypair()` returns them."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never print secrets into logs or tracebacks
        return f"Keys(server_public={self.server_public!r}, client_public={self.client_public!r}, secrets=...)"


def ensure_keys(run_dir: Path) -> Keys:
    """The run's keys, created on first use; existing ones (a resumed run) are kept."""
    sdir = _secrets_dir(run_dir)
    sdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(sdir, 0o700)  # mkdir's mode is masked by the umask, and an old dir may be looser
    for name in (SERVER_KEY_FILE, CLIENT_KEY_FILE):
        path = sdir / name
        if path.exists():
            os.chmod(path, 0o600)
        else:
            _create_keypair_file(path)
    return load_keys(run_dir)


def load_keys(run_dir: Path) -> Keys:
    server_public, server_secret = _read_keypair(_secrets_dir(run_dir) / SERVER_KEY_FILE)
    client_public, client_secret = _read_keypair(_secrets_dir(run_dir) / CLIENT_KEY_FILE)
    return Keys(server_public, server_secret, client_public, client_secret)


def auth_enabled(controller_cfg) -> bool:
    """Whether the control plane must authenticate: `curve`, or `auto` off loopback."""
    if controller_cfg.auth == "curve":
        return True
    if controller_cfg.auth == "none":
        return False
    return not is_loopback(controller_cfg.host)


def channel_keys(run_dir: Path, controller_cfg) -> Keys | None:
    """Keys for `Server`/`Client` of this run, or None when authentication is off."""
    return load_keys(run_dir) if auth_enabled(controller_cfg) else None


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


def _create_keypair_file(path: Path) -> None:
    public, secret = zmq.curve_keypair()
    text = json.dumps({"public": public.decode(), "secret": secret.decode()}) + "\n"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # link, not rename: if another process created the file meanwhile, its key wins and
        # both processes read that one, so they never end up holding different keys
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def _read_keypair(path: Path) -> tuple[bytes, bytes]:
    try:
        data = json.loads(path.read_text())
        public, secret = data["public"].encode("ascii"), data["secret"].encode("ascii")
    except FileNotFoundError:
        raise KeyFileError(f"CURVE key file {path} is missing: the launcher writes it at run start "
                           f"(laminar_hpc.transport.security.ensure_keys(run_dir)); start this role "
                           f"through the launcher with the same run directory, or set controller.auth: "
                           f"none for a loopback-only run") from None
    except PermissionError:
        raise KeyFileError(f"cannot read CURVE key file {path}: permission denied; run this role as the "
                           f"user that owns the run directory") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise KeyFileError(f"CURVE key file {path} is unreadable ({type(err).__name__}: {err}); delete "
                           f"{path.parent} to make new keys (every role must then be restarted)") from None
    try:  # a damaged or hand-edited file: fail here, naming it, not deep inside a socket option
        matches = len(public) == _Z85_KEY_LEN and zmq.curve_public(secret) == public
    except (zmq.ZMQError, ValueError):
        matches = False
    if not matches:
        raise KeyFileError(f"CURVE key file {path} holds a malformed or mismatched keypair; delete "
                           f"{path.parent} to make new keys (every role must then be restarted)")
    return public, secret
