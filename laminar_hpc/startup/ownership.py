"""A run directory that only its user can reach, checked at every start of a campaign and of every role.

A campaign trusts what its run directory holds: `config.yaml` names code the trainer and the
rollouts import (`task.reward.fn`, tools), `secrets/` holds the keys that let a peer stop the
campaign, `endpoints/` tells every role where to connect. Whoever else can write the directory,
or rename it, owns the campaign, and a root campaign runs their code as root. So, as
`transport/shm_dir.check_private` does for shared memory, a run directory is used only when:

- the run directory is a real directory (not a symbolic link), owned by the effective user
  running this process, with no group or other bits;
- `secrets/` likewise, and every key file in it too (a regular file, ours, no group or other bits);
- `config.yaml`, `endpoints/` and every endpoint file: ours, not symbolic links, and neither group
  nor others may write them (config and endpoints were written 0644: inside the 0700 run
  directory only we can reach them anyway);
- every directory above it, as written and as resolved (symbolic links followed), is owned by
  root or by us and is not writable by group or others unless it has the sticky bit (/tmp);
  anyone else who could write one could rename the run directory away and put theirs in its place.

Anything else is refused with one RunDirError line naming the path, who owns it or its mode, and
what to do. Stdlib only: every role calls it before it reads the config.

    check_run_dir(run_dir)          # the launcher (prepare_run_dir) and every role, first thing
    make_private_dir(run_dir)       # the launcher: create it 0700 (and missing parents 0755), checked
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from laminar_hpc.rundir import RunDir, RunDirError
from laminar_hpc.transport.shm_dir import user_name

__all__ = ["check_ancestors", "check_run_dir", "make_private_dir"]

PRIVATE = 0o077  # no bit for group or others
NOT_WRITABLE = 0o022  # no write bit for group or others


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def check_ancestors(run_dir: Path) -> None:
    """Every existing directory above `run_dir`, as written and as resolved: root's or ours, and
    not writable by group or others without the sticky bit."""
    me = os.geteuid()
    here = Path(os.path.abspath(run_dir))
    real = Path(os.path.realpath(here.parent))
    for above in dict.fromkeys([*here.parents, real, *real.parents]):  # in order, each once
        try:
            st = os.lstat(above)
        except FileNotFoundError:
            continue  # not made yet: prepare_run_dir makes it (ours, 0755) and checks again
        if st.st_uid not in (0, me):
            raise RunDirError(f"{above}: this directory above the run directory {run_dir} is owned by "
                              f"{user_name(st.st_uid)}, who could rename the run directory and put another in its "
                              f"place; use a --run-dir under directories that only you (or root) own")
        if stat.S_ISLNK(st.st_mode):
            continue  # a link's own mode means nothing; where it leads is checked as resolved
        if st.st_mode & NOT_WRITABLE and not st.st_mode & stat.S_ISVTX:
            raise RunDirError(f"{above}: this directory above the run directory {run_dir} has mode {_mode(st)}: "
                              "group or others may write it without the sticky bit, so they could rename the run "
                              f"directory and put another in its place; remove their write access (chmod go-w "
                              f"{above}) or use a --run-dir elsewhere")


def _check_entry(path: Path, what: str, *, directory: bool, forbidden: int, optional: bool = False) -> None:
    """`path` is a real directory (or regular file) of our effective user without `forbidden` bits."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if optional:
            return
        raise RunDirError(f"{path}: the {what} does not exist; check --run-dir") from None
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(f"{path}: the {what} is a symbolic link (to {os.readlink(path)}), which whoever can "
                          "change it can point elsewhere; use a real " + ("directory (pass the link's target as "
                                                                          "--run-dir)" if directory else "file"))
    if directory != stat.S_ISDIR(st.st_mode) or (not directory and not stat.S_ISREG(st.st_mode)):
        raise RunDirError(f"{path}: the {what} is not a {'directory' if directory else 'regular file'}; "
                          "remove it or use another --run-dir")
    me = os.geteuid()
    if st.st_uid != me:
        raise RunDirError(f"{path}: the {what} is owned by {user_name(st.st_uid)}, not by {user_name(me)} who runs the "
                          "campaign: another user made it and could change what the campaign reads and runs; "
                          "use a --run-dir you create yourself (or remove it as its owner)")
    if st.st_mode & forbidden:
        fix = "chmod go-rwx" if forbidden == PRIVATE else "chmod go-w"
        others = "read or change it" if forbidden == PRIVATE else "change it"
        raise RunDirError(f"{path}: the {what} has mode {_mode(st)}, so other users may {others}; "
                          f"make it private ({fix} {path}) or use another --run-dir")


def check_run_dir(run_dir: RunDir | str | os.PathLike) -> None:
    """Refuse (RunDirError, one line) a run directory that anyone but us could read, change or
    swap (the module doc); what does not exist yet (a new run's secrets) is not checked."""
    rd = RunDir.of(run_dir)
    check_ancestors(rd.path)
    _check_entry(rd.path, "run directory", directory=True, forbidden=PRIVATE)
    _check_entry(rd.secrets_dir, "run's secrets directory", directory=True, forbidden=PRIVATE, optional=True)
    if rd.secrets_dir.is_dir():
        for key in sorted(rd.secrets_dir.iterdir()):
            _check_entry(key, "key file", directory=False, forbidden=PRIVATE)
    _check_entry(rd.config, "run's config", directory=False, forbidden=NOT_WRITABLE, optional=True)
    _check_entry(rd.endpoints_dir, "endpoints directory", directory=True, forbidden=NOT_WRITABLE, optional=True)
    if rd.endpoints_dir.is_dir():
        for endpoint in rd.endpoints():
            _check_entry(endpoint, "endpoint file", directory=False, forbidden=NOT_WRITABLE)


def make_private_dir(run_dir: RunDir | str | os.PathLike) -> bool:
    """Create the run directory (mode 0700; missing parents 0755, ours) unless it exists, then
    check it (check_run_dir). True when this call created it."""
    path = RunDir.of(run_dir).path
    check_ancestors(path)  # before creating anything under a directory someone else controls
    missing = [p for p in reversed(path.parents) if not os.path.lexists(p)]
    for parent in missing:
        try:
            os.mkdir(parent, 0o755)  # the umask may take more away, never add
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
    made = False
    try:
        os.mkdir(path, 0o700)
        made = True
    except FileExistsError:
        pass
    if made:  # ours for sure: drop bits a default ACL may have added
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    check_run_dir(path)
    return made
