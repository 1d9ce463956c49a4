"""Landlock (Linux >= 5.13) for the Python sandbox's child: after `restrict`, the process and
everything it starts see no file outside the paths it allows.

Landlock is an unprivileged LSM: a process restricts itself, with no root, no user namespace and
no setuid helper, so it works for root and for every user on a typical HPC node, which often
forbids unprivileged user namespaces. The rules are path-beneath: a right granted on a directory
holds for everything under it; every right this kernel's ABI knows is handled, so what is not
granted is denied. With ABI 4 TCP bind and connect are denied too, and with ABI 6 signals and
abstract UNIX sockets outside the sandbox (defence in depth for the network namespace).

    allowed = sandbox_paths(workdir)            # the working directory; read-only libraries
    restrict(allowed)                           # after PR_SET_NO_NEW_PRIVS; raises LandlockError

Stdlib and ctypes only: the sandbox's child loads this file by path (it runs `python -I -S`).
Calls go through syscall(2) with the generic syscall numbers (444-446 on every architecture
Landlock supports), since glibc has no wrappers.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1

# filesystem rights, by the ABI that introduced them
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the rights a rule on a file may carry
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ = READ_FILE | READ_DIR
# readable by the sandboxed code: the shared libraries the interpreter and its extension modules
# load (lazily, at import), the dynamic loader's cache, time zones; never /etc, /home, /root,
# /proc, /dev/shm or /tmp as a whole
SYSTEM_READ = ("/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/local/lib",
               "/usr/share/zoneinfo", "/etc/ld.so.cache", "/etc/localtime")
DEVICES = {"/dev/null": READ_FILE | WRITE_FILE | TRUNCATE, "/dev/zero": READ_FILE, "/dev/urandom": READ_FILE,
           "/dev/random": READ_FILE}


class LandlockError(RuntimeError):
    """Landlock cannot restrict this process; the message says why and what the sandbox needs."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # packed in the kernel's uapi header: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _unavailable(why: str) -> LandlockError:
    return LandlockError(f"the Python tool's sandbox needs Landlock to hide files from the code it runs, and {why} "
                         f"(kernel {platform.release()}; Landlock needs Linux >= 5.13 built with "
                         "CONFIG_SECURITY_LANDLOCK and 'landlock' in the lsm= boot parameter, and a container "
                         "runtime whose seccomp profile allows the landlock_* system calls); the tool refuses to run "
                         "without it")


def abi_version() -> int:
    """This kernel's Landlock ABI (1, 2, ...); LandlockError when there is none."""
    libc = _libc()
    abi = libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    if abi < 0:
        err = ctypes.get_errno()
        reason = {38: "this kernel has no Landlock", 95: "Landlock is disabled at boot"}.get(err, os.strerror(err))
        raise _unavailable(f"it is not available here: {reason}")
    return int(abi)


def sandbox_paths(workdir: str) -> dict[str, int]:
    """path -> rights for the sandbox: everything in `workdir` but executing and device ioctls;
    reading the interpreter's standard library (sys.path), SYSTEM_READ and this process's own
    /proc entry; the usual devices. Called in the process that restricts itself."""
    allowed = {p: READ for p in SYSTEM_READ}
    for entry in sys.path:  # -I -S: the standard library, its zip and lib-dynload only
        if entry and os.path.isabs(entry):
            allowed[entry] = READ
    allowed.update(DEVICES)
    allowed[f"/proc/{os.getpid()}"] = READ  # its own process only (/proc/self now): not its parent's
    allowed[workdir] = FS_BY_ABI[5] & ~(EXECUTE | IOCTL_DEV)
    return allowed


def restrict(allowed: dict[str, int]) -> int:
    """Restrict this process (and what it starts) to `allowed` (path -> rights); paths that do
    not exist are skipped. Needs PR_SET_NO_NEW_PRIVS set before. Returns the ABI used."""
    abi = abi_version()
    fs = FS_BY_ABI[min(abi, 5)]
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)  # the fields this ABI knows
    libc = _libc()
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _unavailable(f"creating a ruleset failed ({os.strerror(ctypes.get_errno())})")
    try:
        for path, rights in allowed.items():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # /lib32 on a system without it
            try:
                if not os.path.isdir(path):
                    rights &= FILE_RIGHTS
                rule = _PathBeneathAttr(rights & fs, fd)
                if libc.syscall(SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise LandlockError(f"Landlock refused the rule for {path} ({os.strerror(ctypes.get_errno())})")
            finally:
                os.close(fd)
        if libc.syscall(SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise LandlockError(f"Landlock could not restrict the sandbox ({os.strerror(ctypes.get_errno())}); "
                                "PR_SET_NO_NEW_PRIVS must be set first")
    finally:
        os.close(ruleset)
    return abi
