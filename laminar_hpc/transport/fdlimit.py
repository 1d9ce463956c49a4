"""Every role raises its soft limit of open files to the hard limit at start.

Batch jobs often get a soft limit of 1,024 (the hard one is higher): each connection to a server
holds one descriptor, authenticated or not, so a local user who opens a thousand idle TCP
connections to the controller could leave it none for its status, log and checkpoint files (the
controller then died on EMFILE). Raising the soft limit needs no privilege; the hard limit is
left alone. Writers also treat EMFILE as transient (rundir.TRANSIENT_ERRORS), and servers close
connections whose handshake does not complete (transport/channel.py HANDSHAKE_S).

    soft, hard = raise_fd_limit(log)
"""
from __future__ import annotations

import logging
import resource

UNLIMITED_CAP = 1 << 20  # the kernel's default fs.nr_open: what an "unlimited" hard limit becomes


def raise_fd_limit(log: logging.Logger | None = None) -> tuple[int, int]:
    """Set this process's soft RLIMIT_NOFILE to its hard limit (its children inherit it); the
    (soft, hard) limits in force afterwards. A refusal is logged, never raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            (log or logging.getLogger(__name__)).warning(
                "could not raise the open-file limit from %d to %d (%s): a flood of connections may exhaust it",
                soft, target, err)
    return soft, hard
