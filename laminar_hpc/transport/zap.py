"""The ZAP handler of a process's keyed servers (transport/channel.py): one pyzmq authenticator
thread per process; each server registers a ZAP domain that admits its clients' CURVE public
keys, and an admitted key's role kind becomes the connection's User-Id, which the server reads
per frame (`frame.get("User-Id")`) to authorize it (transport/authz.py).

    domain, admission = zap_register({public_key_z85: "rollout", ...})
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    admission.rejected.get(domain, 0)      # connections refused for an unknown key
    admission.errors                       # requests whose handling raised (refused, logged)
    admission.domains.pop(domain, None)    # the server closed
"""
from __future__ import annotations

import itertools
import logging
import os
import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("laminar_hpc.transport.channel")


class _Admission:
    """ZAP credentials provider: each keyed server's domain admits its clients' public keys; an
    admitted key's role kind becomes the connection's User-Id (keys are random per run, so one
    key names one kind in the whole process)."""

    def __init__(self):
        self.domains: dict[str, dict[bytes, str]] = {}  # zap domain -> client public key (Z85) -> kind
        self.kinds: dict[bytes, str] = {}
        self.rejected: dict[str, int] = {}
        self.errors = 0  # requests whose handling raised: answered "500", the handshake refused

    def callback(self, domain: str, key: bytes) -> bool:
        clients = self.domains.get(domain)  # one dict read: safe while a server closes meanwhile
        if clients is not None and key in clients:
            return True
        n = self.rejected[domain] = self.rejected.get(domain, 0) + 1
        if n == 1 or n % 1000 == 0:  # a rogue peer retries every ~100 ms: do not flood the log
            log.warning("rejected a CURVE connection with an unknown client key on %s (%d so far)", domain, n)
        return False


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler thread, with the role kind as the User-Id of an admitted CURVE peer
    (its documented hook for a custom user id), readable per frame as `frame.get("User-Id")`."""

    def __init__(self, admission: _Admission):
        super().__init__(zmq.Context.instance(), log=logging.getLogger(__name__ + ".zap"))
        self.admission = admission

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # one request that breaks the handling must not end this thread: every later handshake of
        # every keyed server of the process would then wait for an answer that never comes
        try:
            await super().handle_zap_message(msg)
        except Exception:  # noqa: BLE001 - counted and logged; the peer is refused
            self.admission.errors += 1
            n = self.admission.errors
            if n == 1 or n % 1000 == 0:
                log.exception("a ZAP request could not be handled (%d so far); the connection is refused", n)
            if len(msg) >= 2:
                self._send_zap_reply(msg[1], b"500", b"internal error")

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.admission.kinds.get(z85.encode(client_public_key), "")

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        # (a PLAIN peer's User-Id is its user name: the kind whose password it proved)
        allowed, reason = super()._authenticate_plain(domain, username, password)
        if not allowed:
            n = self.admission.rejected[domain] = self.admission.rejected.get(domain, 0) + 1
            if n == 1 or n % 1000 == 0:
                log.warning("rejected a PLAIN connection without a password of this run on %s (%d so far)", domain, n)
        return allowed, reason


_zap_lock = threading.Lock()
_zap: tuple[int, _Authenticator, _Admission] | None = None
_zap_domains = itertools.count()


def _handler() -> tuple[_Authenticator, _Admission]:
    """This process's ZAP handler thread (the caller holds `_zap_lock`)."""
    global _zap
    if _zap is not None and _zap[0] == os.getpid() and not _zap[1].is_alive():
        # (its handling never raises; a dead thread would leave every keyed server's handshakes
        # waiting without an answer, so say it rather than let a server start deaf)
        raise RuntimeError("this process's ZAP handler thread has stopped: keyed servers cannot admit any peer")
    if _zap is None or _zap[0] != os.getpid():  # Context.instance() is per process, after fork too
        admission = _Admission()
        auth = _Authenticator(admission)
        auth.start()
        _zap = (os.getpid(), auth, admission)
    return _zap[1], _zap[2]


def zap_register(clients: dict[bytes, str]) -> tuple[str, _Admission]:
    """A fresh ZAP domain admitting `clients` (public key -> kind), on this process's handler."""
    with _zap_lock:
        auth, admission = _handler()
        domain = f"laminar-{os.getpid()}-{next(_zap_domains)}"
        admission.kinds.update(clients)
        admission.domains[domain] = dict(clients)
        # providers are never removed (close only forgets the keys): the handler thread looks
        # the domain up without a lock
        auth.configure_curve_callback(domain, credentials_provider=admission)
        return domain, admission


def zap_register_plain(passwords: dict[str, str]) -> tuple[str, _Admission]:
    """A fresh ZAP domain admitting PLAIN peers that prove one of `passwords` (kind -> password):
    for ipc:// servers, which need authentication but no encryption (transport/security.py)."""
    with _zap_lock:
        auth, admission = _handler()
        domain = f"laminar-{os.getpid()}-{next(_zap_domains)}"
        auth.configure_plain(domain, passwords=dict(passwords))
        return domain, admission


