"""Whether a file could have been planted, or can be changed, by another user: the check before a
campaign runs code a config names or reuses what it finds in a shared place (a converted model).

A root campaign runs a config's reward, tool and environment files as root, and every role reads
what a cache directory holds: whoever else can write one of them, or rename a directory above it,
decides what the campaign runs. So such a path is used only when it and every directory above it,
as written and as resolved (symbolic links followed), is owned by root or by the effective user,
and none of them may be written by group or others (a directory with the sticky bit excepted, as
/tmp: there only a file's owner may rename it). Stdlib only: every layer may use it.

    why = untrusted(Path("rewards/my_reward.py"))   # None, or one line: what, whose, what to do
"""
from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

NOT_WRITABLE = 0o022  # no write bit for group or others


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _problem(path: Path, st: os.stat_result, me: int, what: str) -> str | None:
    if st.st_uid not in (0, me):
        return f"{what} {path} is owned by {user_name(st.st_uid)}, who could change it"
    if stat.S_ISLNK(st.st_mode):
        return None  # a link's own mode means nothing; where it leads is checked as resolved
    if st.st_mode & NOT_WRITABLE and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may change it"
    return None


def untrusted(path: str | os.PathLike) -> str | None:
    """Why another user could have put `path` there or could change it (the module's rule), in
    one line; None when only root and this process's user can."""
    me = os.geteuid()
    here = Path(os.path.abspath(path))
    real = Path(os.path.realpath(here))
    checks = [(here, "the file"), (real, "the file")] + [(d, "the directory") for d in dict.fromkeys(
        [*here.parents, *real.parents])]
    for p, what in dict.fromkeys(checks):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue  # absent: whoever reads it next says so
        if (why := _problem(p, st, me, what)) is not None:
            return why
    return None
