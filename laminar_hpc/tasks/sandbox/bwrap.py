"""The python tool's outer wall: bubblewrap (`bwrap`) namespaces and a seccomp filter around the
sandbox's child (tasks/sandbox/python_tool.py), so that what holds does not depend on the code it runs.

    argv, fds = bwrap_command(disk_bytes, child_files)   # prefix of the child's command line, up to python

What the child gets from bwrap (each a kernel mechanism, none a Python object the code can reach):
- its own PID namespace (`--unshare-pid`): nothing it starts, `setsid` included, outlives the
  call, since the namespace's init dies with bwrap (`--die-with-parent`) and takes every member;
  no process outside it can be named, so no signal or pidfd reaches one;
- its own network namespace (`--unshare-net`, a loopback of its own): no TCP or UDP peer; and a
  mount namespace holding only read-only system directories, the interpreter and the two sandbox
  files, plus the call's working directory at /work: no UNIX socket of the node (the run
  directory's, /run, /tmp) exists in it, and abstract ones belong to the network namespace;
- its own IPC, UTS and cgroup namespaces, and a user namespace in which it is uid/gid 65534,
  with no capability;
- a clean environment (`--clearenv`: PATH, HOME, TMPDIR, and PWD=/work from bwrap's --chdir) and
  a new session (no TIOCSTI);
- a seccomp filter (built with libseccomp through pyseccomp) refusing with EPERM: ptrace and
  process_vm_*, new namespaces (unshare, setns, clone and clone3 with CLONE_NEW* flags), mount
  and pivot_root, bpf, perf_event_open, keyrings, userfaultfd, io_uring, kernel modules,
  open_by_handle_at, pidfd_getfd, and the rest of the administrator's calls.
Inside, the child still sets its rlimits (processes included), Landlock and the audit hook.

bubblewrap >= 0.5 (`--clearenv`, `--size`) is required; `tools/install.sh` installs it (Debian's
`bubblewrap`). Without it the call fails closed (SandboxError) with one line saying how to install
it: there is no other isolation.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

MIN_VERSION = (0, 5)
INSIDE_UID = 65534  # nobody, inside the user namespace
INSIDE_DIR = "/work"  # the call's working directory, as the child sees it
INSIDE_FILES = "/sandbox"  # python_tool.py and landlock.py, read-only
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime")

# refused with EPERM, whatever their arguments
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "open_by_handle_at", "name_to_handle_at", "reboot", "swapon", "swapoff", "acct", "quotactl",
    "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "sethostname", "setdomainname",
    "syslog", "vhangup", "iopl", "ioperm", "lookup_dcookie", "nfsservctl",
)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_NEW_BITS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)


class BwrapUnavailable(RuntimeError):
    """bubblewrap cannot be used here: the message says what is missing."""


@functools.lru_cache(maxsize=1)
def bwrap_path() -> str:
    """The bwrap executable, checked once per process: present, recent enough, and able to make
    its namespaces on this machine."""
    path = shutil.which("bwrap")
    if path is None:
        raise BwrapUnavailable("bubblewrap (bwrap) is not installed (tools/install.sh installs it; Debian: "
                               "apt-get install bubblewrap)")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.split()
    try:
        version = tuple(int(x) for x in out[-1].split(".")[:2])
    except (IndexError, ValueError):
        raise BwrapUnavailable(f"{path} --version printed {' '.join(out)!r}, not a version") from None
    if version < MIN_VERSION:
        raise BwrapUnavailable(f"{path} is bubblewrap {'.'.join(map(str, version))}; the sandbox needs >= "
                               f"{'.'.join(map(str, MIN_VERSION))}")
    probe = subprocess.run([path, *_namespaces(), "--ro-bind", "/", "/", "--", "/bin/true"],
                           capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        raise BwrapUnavailable(f"bubblewrap cannot make its namespaces here: {probe.stderr.strip()[:300]}")
    return path


def _namespaces() -> list[str]:
    return ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID)]


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The filter as a BPF program (bwrap --seccomp takes it from a descriptor)."""
    try:
        import pyseccomp as seccomp
    except ImportError:
        raise BwrapUnavailable("the pyseccomp package is not installed (pip install -c constraints.txt pyseccomp)") \
            from None
    import errno
    import tempfile
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    deny = seccomp.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(deny, name)
        except (RuntimeError, ValueError, OSError):
            pass  # a call this architecture does not have
    for bit in CLONE_NEW_BITS:  # a clone that asks for any new namespace
        f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, bit, bit))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # its flags sit behind a pointer: libc falls back to clone
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def bwrap_command(disk_bytes: int, child_files: dict[str, str]) -> tuple[list[str], list[int]]:
    """(argv prefix up to and including the interpreter, descriptors to pass). The working
    directory is a tmpfs of `disk_bytes`; `child_files`: name -> path of a file the child needs
    (bound read-only under INSIDE_FILES). The caller closes the descriptors once bwrap started."""
    path = bwrap_path()
    program = seccomp_program()
    python = os.path.realpath(sys.executable)
    argv = [path, *_namespaces(), "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", INSIDE_DIR, "--setenv", "TMPDIR", INSIDE_DIR]
    for d in SYSTEM_DIRS:
        argv += ["--ro-bind-try", d, d]
    prefix = os.path.realpath(sys.base_prefix)  # the interpreter and its standard library
    if not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    if not python.startswith((prefix + "/", "/usr/", "/bin/")):
        argv += ["--ro-bind", python, python]
    for name, source in child_files.items():
        argv += ["--ro-bind", source, f"{INSIDE_FILES}/{name}"]
    argv += ["--size", str(disk_bytes), "--tmpfs", INSIDE_DIR, "--chdir", INSIDE_DIR, "--proc", "/proc",
             "--dev", "/dev"]
    r, w = os.pipe()  # the program fits a pipe's buffer: written whole before bwrap reads it
    try:
        os.write(w, program)
    finally:
        os.close(w)
    argv += ["--seccomp", str(r), "--", python]
    return argv, [r]
