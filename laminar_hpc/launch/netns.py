"""The local relay tier in a network namespace of its own, so that Open MPI listens nowhere another
user of the node can reach.

mpirun's out-of-band channel and its PMIx server bind TCP listeners on every interface, whatever
`oob_tcp_if_include` says (the interface lists choose where it sends, not where it binds); the
ranks' TCP transport is not loaded at all on one machine (`btl self,vader`, launch/local.py). In a
namespace with only its own loopback, those listeners exist but no socket of the node reaches them.
The tier needs no network: on one machine it talks to the controller, the trainer and joiners over
ipc:// sockets in the run directory (transport/endpoint.py), and to rollouts and its own ranks over
shared memory, all of which a network namespace leaves as they are.

    argv, why_not = private_network(["mpirun", "-n", "2", ...])   # why_not: None, or one line

As root, `unshare --net`; as a user, a user namespace too that maps the user to itself
(`--map-current-user`), keeping the capabilities it grants in that namespace long enough to bring
its loopback up. Run as `python -m laminar_hpc.launch.netns -- PROGRAM ARGS...` inside, this module
brings `lo` up (PMIx's listener needs an address) and execs the program, so the role's PID stays
the one the launcher started.
"""
from __future__ import annotations

import fcntl
import functools
import os
import shutil
import socket
import struct
import subprocess
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def unshare_argv() -> list[str]:
    path = shutil.which("unshare") or "unshare"
    if os.geteuid() == 0:
        return [path, "--net"]
    return [path, "--user", "--map-current-user", "--keep-caps", "--net"]


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when a private network namespace can be made here, else why not (one line)."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run([*unshare_argv(), "--", sys.executable, "-m", "laminar_hpc.launch.netns", "--",
                            "/bin/true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"no private network namespace here ({(probe.stderr.strip() or 'exit %d' % probe.returncode)[:200]})"
    return None


def private_network(argv: list[str]) -> tuple[list[str], str | None]:
    """`argv` run in a network namespace of its own, or `argv` as it is and why not."""
    why = unavailable()
    if why is not None:
        return argv, why
    return [*unshare_argv(), "--", sys.executable, "-m", "laminar_hpc.launch.netns", "--", *argv], None


def loopback_up() -> None:
    """Set IFF_UP on `lo` (SIOCSIFFLAGS), as `ip link set lo up` does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B


def network_of(address: str) -> str | None:
    """The CIDR of this host's IPv4 interface that holds `address` (e.g. '10.77.0.0/24'), or None.
    A multi-node relay tier's TCP transport is kept to it (`btl_tcp_if_include`, launch/slurm_driver.py):
    every node of the job reaches the others on the network of its NodeAddr."""
    import ipaddress
    try:
        address = socket.gethostbyname(address)  # a NodeAddr may be a host name
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, req)[20:24])
            except OSError:
                continue  # no IPv4 address on this interface
            if addr == address:
                return str(ipaddress.IPv4Network(f"{addr}/{mask}", strict=False))
    return None


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "--" or len(argv) < 2:
        sys.exit("usage: python -m laminar_hpc.launch.netns -- PROGRAM [ARGS...]")
    try:
        loopback_up()
    except OSError as err:
        sys.exit(f"laminar netns: cannot bring the namespace's loopback up: {err}")
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
