"""A start's private directory in node-local shared memory, and the checks on what is in it.

Names under /dev/shm are visible to every user of a node, and the run id is in them. So the
stores of a start live in one directory that only our user can enter (`RunDir.shm_run_dir`,
<shm_dir>/laminar-<run id>): the node's first writer makes it with mkdir (mode 0700); whatever
already has that name must be a real directory (not a symbolic link) of our effective user with
no group/other bits, else another user planted it, and a store in it would hand rollouts that
user's weights. Inside it no one else can create, rename or replace anything, so the stores'
own checks (weight_store.py) need only the file itself. Stdlib only: the launchers import it.

    fd = open_private_dir(rd.shm_run_dir, create=True)   # a writer; SharedMemoryError if planted
    check_private(os.fstat(store_fd), path, "weight store")
    remove_private_dir(rd.shm_run_dir)                   # the launcher's cleanup: ours only
"""
from __future__ import annotations

import os
import pwd
import shutil
import stat
from pathlib import Path

from laminar_hpc.rundir import RunDirError

PRIVATE_DIR_MODE = 0o700


class SharedMemoryError(RunDirError):
    """A shared-memory directory or store that is not ours alone; the message names the path, its
    owner and what to do."""


def user_name(uid: int) -> str:
    """'uid 1000 (alice)', for the messages that say who owns a path."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def check_private(st: os.stat_result, path: str | os.PathLike, what: str) -> None:
    """Refuse `path` (its stat, taken from the opened descriptor) unless our effective user owns it
    and neither group nor others have any access: else it is someone else's, or theirs to swap."""
    me = os.geteuid()
    if st.st_uid != me:
        raise SharedMemoryError(f"{path}: this {what} is owned by {user_name(st.st_uid)}, not by {user_name(me)} "
                                "who runs the campaign (another user created it first); remove it (as its owner or root) "
                                "and resume the run, or set relay.shm_dir to a directory only you can write")
    if st.st_mode & 0o077:
        raise SharedMemoryError(f"{path}: this {what} has mode {stat.S_IMODE(st.st_mode):04o}, so other users "
                                "may open it; it must have no group or other bits (0700 for the directory, 0600 "
                                "for a store); remove it and resume the run")


def open_private_dir(path: str | os.PathLike, create: bool = False) -> int:
    """A descriptor (O_DIRECTORY, close it) of the private directory `path`, checked after opening;
    with `create` made first if missing (a writer); FileNotFoundError if missing otherwise (a
    reader: nothing published yet). SharedMemoryError for a symbolic link, a file, or a directory
    of another user or with group/other bits."""
    path = Path(path)
    made = False
    if create:
        try:
            os.mkdir(path, PRIVATE_DIR_MODE)
            made = True
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise SharedMemoryError(f"{path.parent}: the shared-memory root does not exist; create it or set "
                                    "relay.shm_dir to a directory that exists on every node") from None
    st = os.lstat(path)  # lstat: a planted symbolic link is refused, not followed
    if stat.S_ISLNK(st.st_mode):
        raise SharedMemoryError(f"{path}: is a symbolic link (to {os.readlink(path)}), not this run's shared-memory "
                                "directory: someone planted it; remove it and resume the run")
    if not stat.S_ISDIR(st.st_mode):
        raise SharedMemoryError(f"{path}: is not a directory, so it is not this run's shared-memory directory; "
                                "remove it and resume the run")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
            raise SharedMemoryError(f"{path}: was replaced while it was being checked; remove it and resume the run")
        if made:  # ours for sure: drop bits a default ACL or a lax umask may have added
            os.fchmod(fd, PRIVATE_DIR_MODE)
            got = os.fstat(fd)
        check_private(got, path, "shared-memory directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_private_dir(path: str | os.PathLike) -> bool:
    """Remove a start's shared-memory directory with everything in it (stores, a killed writer's
    temporary files). Anything at that name that is not a real directory of our user is left
    alone: it is not ours to delete. True if something was removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():  # S_ISDIR is false for a symbolic link
        return False
    shutil.rmtree(path, ignore_errors=True)  # rmtree never follows symbolic links inside
    return True
