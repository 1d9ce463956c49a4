"""The Python tool: run untrusted code (a model's tool call) in a child process with limits and
without network, and return what it printed.

    result = await run_python("print(sum(range(10)))", SandboxLimits(cpu_s=1, wall_s=3))
    result.text, result.outcome          # ("45\\n", "ok")
    run_python_sync("while True: pass").outcome     # "cpu_limit" (outside an event loop)

`outcome`: "ok" (exit 0); "error" (an exception, a syntax error, a nonzero exit: `text` ends with the
traceback, trimmed to the user's frames); "timeout" (`wall_s` passed: the process group was killed);
"cpu_limit" (RLIMIT_CPU: SIGXCPU at `cpu_s` rounded up to whole seconds, SIGKILL one second later);
"memory" (MemoryError under RLIMIT_AS = `mem_mb`, or an abort for lack of memory). `text` is
stdout and stderr merged (unbuffered, so in order), head and tail kept within `max_output_chars`
around a "... [output truncated: N chars omitted] ..." marker, plus a "[sandbox: ...]" line saying
which limit ended the run. `exit_code` is the return code as `subprocess` gives it (-9: SIGKILL).
`isolation` is "bwrap+seccomp+landlock+audit" (the default: `SandboxLimits.isolation` "bwrap",
tasks/bwrap.py puts the child in bubblewrap's namespaces and a seccomp filter first), or with
"landlock" "netns+landlock+audit" / "landlock+audit" ("none" if the child died before its set-up
finished). What follows are the layers inside.

What the child gets: `sys.executable -I -S -B -u` (no site-packages, no PYTHON* variables), a fresh
temporary working directory that is removed afterwards (HOME and TMPDIR point there), an
environment of PATH, HOME and TMPDIR only, stdin from /dev/null, its own session, so the wall-clock
kill (`os.killpg`, SIGKILL) takes every process it started. The child is this file run as a
script: before the user's code it sets, in order,
- a network namespace without interfaces: ctypes `unshare(CLONE_NEWNET)` (Python 3.11 has no
  `os.unshare`), which needs CAP_SYS_ADMIN (root); else `unshare(CLONE_NEWUSER | CLONE_NEWNET)` with
  its own uid and gid mapped (unprivileged user namespaces); else no namespace ("audit" only);
- no capabilities (no_new_privs, bounding set, capset to zero), so a root caller's child cannot
  raise its limits, kill other users' processes or re-enter the host's network namespace;
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (16 MiB per file), RLIMIT_CORE 0, RLIMIT_NOFILE 128.
  RLIMIT_NPROC is NOT set: it counts every process of the user, the kernel ignores it for uid 0,
  and for other users it would also forbid threads; process creation is refused by the hook below;
- Landlock (tasks/landlock.py; unprivileged, Linux >= 5.13): no file outside the working directory
  can be opened, read, listed or written, except the standard library and the system's shared
  libraries, read-only, and /dev/null, /dev/zero, /dev/urandom: not the run directory, its
  `secrets/`, the home directory, /etc, /proc or /dev/shm. TCP bind/connect (ABI 4) and signals
  and abstract UNIX sockets outside the sandbox (ABI 6) are refused too. Without Landlock the
  child does not run the code: the call raises SandboxError saying why (fail closed);
- an audit hook (`sys.addaudithook`), always, raising PermissionError for `_DENIED_EVENTS` (every
  socket, AF_UNIX too: a namespace does not hide filesystem sockets; processes, signals, ctypes,
  rlimits, links), `_DENIED_IMPORTS`, and writes outside the working directory (`_WRITE_EVENTS`).
  (`os.open` for writing needs an absolute path: its audit event does not show `dir_fd`.)
Audit hooks are not a security boundary on their own (determined code can reach around them); the
kernel's limits, the namespace, Landlock and the process-group kill are. A root caller's child is
still uid 0 (without capabilities); Landlock is what keeps it from root's files.

`run_python` is cancel-safe: when the awaiting task is cancelled (a tool runner's own timeout),
the child's process group is killed and reaped and its directory removed before the cancellation
propagates.
"""
from __future__ import annotations

import codecs
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sys
import tempfile

# No asyncio (nor subprocess) at module level: the child runs this file, and an imported
# `_posixsubprocess` could fork past the audit hook (the child refuses to start if it finds it).

_SETUP_EXIT = 118  # the child's set-up failed (reported on the status pipe)
_MEMORY_EXIT = 117  # the user's code ran out of memory (a `sys.exit(117)` of its own reads the same)
_NETNS_METHODS: tuple[str, ...] = ("netns", "userns")  # tried in order (tests narrow this)
_REAP_S = 5.0  # after SIGKILL, the longest wait for the exit to be reported
_CHILD_PATH = "/usr/bin:/bin"
_CODE_FILE = ".sandbox_main.py"  # written by the parent, read and deleted by the child
_LANDLOCK_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "landlock.py")  # loaded by the child
_FILENAME = "main.py"  # the user's code in tracebacks
ISOLATIONS = ("bwrap", "landlock")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the user's code): the child could not be set up."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 2.0  # CPU seconds, rounded up to whole seconds (the kernel's granularity)
    mem_mb: int = 256  # address space of the child, MiB
    wall_s: float = 5.0  # wall-clock seconds from the start of the child
    max_output_chars: int = 2000
    # bwrap: the child inside bubblewrap's namespaces and a seccomp filter (tasks/bwrap.py), then
    # the layers below; landlock: those layers alone (a machine without bubblewrap, on purpose)
    isolation: str = "bwrap"
    max_processes: int = 32  # RLIMIT_NPROC inside bwrap's user namespace

    def __post_init__(self) -> None:
        if not (self.cpu_s > 0 and self.wall_s > 0 and self.mem_mb >= 32 and self.max_output_chars >= 200
                and self.isolation in ISOLATIONS and self.max_processes >= 1):
            raise ValueError(f"sandbox limits {self}: cpu_s and wall_s must be > 0, mem_mb >= 32, "
                             f"max_output_chars >= 200, max_processes >= 1 and isolation one of {ISOLATIONS}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    text: str
    outcome: str  # "ok" | "error" | "timeout" | "cpu_limit" | "memory"
    exit_code: int | None
    isolation: str  # "netns+audit" | "audit" | "none"


class _Output:
    """Stdout+stderr as they arrive: the first and last `keep` characters and the total, never more."""

    def __init__(self, keep: int):
        self.keep, self.total, self.head, self.tail = keep, 0, "", ""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        self.total += len(text)
        if len(self.head) < self.keep:
            self.head += text[:self.keep - len(self.head)]
        self.tail = (self.tail + text)[-self.keep:]

    def clipped(self, budget: int) -> str:
        if self.total <= budget:  # budget <= keep: all of it is in `head`
            return self.head
        marker = "\n... [output truncated: {} chars omitted] ...\n"
        room = budget - len(marker.format(self.total))  # `total` has at least the digits of `omitted`
        head_n = room // 2
        tail_n = room - head_n
        return (self.head[:head_n] + marker.format(self.total - room)
                + (self.tail[-tail_n:] if tail_n > 0 else ""))


class _Protocol:
    """The asyncio subprocess protocol (duck-typed: asyncio is imported lazily, see above)."""

    def __init__(self, loop, output: _Output):
        self.output = output
        self.closed = loop.create_future()  # the child was reaped and its pipe reached EOF

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.output.feed(data)

    def connection_lost(self, exc) -> None:  # asyncio calls it once both happened
        if not self.closed.done():
            self.closed.set_result(None)

    connection_made = pipe_connection_lost = process_exited = lambda self, *args: None  # noqa: E731


@functools.cache
def _libc():
    """The C library through ctypes, loaded once per process (the child imports ctypes during its
    set-up, before the audit hook refuses it)."""
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


def _dies_with_caller():
    """A `preexec_fn` that has the sandbox's outer process (bwrap, or the child itself) killed when
    its caller dies: bwrap's `--die-with-parent` ties the sandboxed code to bwrap, but nothing tied
    bwrap to the rollout or test that started it, and a caller killed mid-call (SIGKILL, OOM) left
    it running until its code ended, for ever for one that blocks (seen: a bwrap 51 minutes past
    its caller). libc is loaded here, before the fork; the child only calls prctl. (The signal
    follows the forking thread: the event loop's, which awaits the call until it ends.)"""
    prctl = _libc().prctl
    caller = os.getpid()

    def set_death_signal() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != caller:  # the caller died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGKILL)
    return set_death_signal


def _remove_tree(path: str) -> None:
    """Remove the working directory even where the code took permissions away from its folders."""
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _classify(rc: int | None, timed_out: bool, output: _Output, limits: SandboxLimits) -> tuple[str, str]:
    """(outcome, the note for the model) of a finished run."""
    if timed_out:
        return "timeout", f"wall-clock limit of {limits.wall_s:g}s reached; the process was killed"
    if rc == 0:
        return "ok", ""
    if rc == _MEMORY_EXIT:
        return "memory", f"memory limit of {limits.mem_mb} MiB reached"
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit", f"CPU time limit of {math.ceil(limits.cpu_s)}s reached; the process was killed"
    if rc is not None and rc < 0:
        if rc == -signal.SIGABRT and "memory" in output.tail[-500:].lower():
            return "memory", f"memory limit of {limits.mem_mb} MiB reached"
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
        return "error", f"the process was killed by {name}"
    # 1 is Python's exit after an uncaught exception, whose traceback says enough
    return "error", f"the process exited with code {rc}" if rc != 1 else ""


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a sandboxed child process (module docstring); raises SandboxError only when the
    sandbox itself fails, never for what the code does."""
    import asyncio
    import subprocess
    if not sys.executable:
        raise SandboxError("sys.executable is unknown: cannot start the sandbox's interpreter")
    loop = asyncio.get_running_loop()
    workdir = tempfile.mkdtemp(prefix="laminar-sandbox-")
    try:
        with open(os.path.join(workdir, _CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        status_r, status_w = os.pipe()
        try:
            config = {"status_fd": status_w, "cpu_s": limits.cpu_s, "mem_mb": limits.mem_mb,
                      "netns": list(_NETNS_METHODS), "landlock": _LANDLOCK_FILE, "nproc": None, "outer": ""}
            argv, extra_fds, me = [sys.executable], [], os.path.abspath(__file__)
            if limits.isolation == "bwrap":
                from laminar_hpc.tasks.bwrap import INSIDE_FILES, BwrapUnavailable, bwrap_command
                try:
                    argv, extra_fds, _ = bwrap_command(workdir, {"sandbox.py": me, "landlock.py": _LANDLOCK_FILE})
                except BwrapUnavailable as err:
                    raise SandboxError(f"{err}; or set env.python.isolation=landlock to run the python tool "
                                       "under Landlock and an audit hook alone, on purpose") from None
                me = f"{INSIDE_FILES}/sandbox.py"
                # bwrap made the network namespace; the child limits its processes in its user namespace
                config.update(netns=[], landlock=f"{INSIDE_FILES}/landlock.py", nproc=limits.max_processes,
                              outer="bwrap+seccomp+")
            output = _Output(limits.max_output_chars)
            try:
                transport, proto = await loop.subprocess_exec(
                    lambda: _Protocol(loop, output), *argv, "-I", "-S", "-B", "-u",
                    me, json.dumps(config), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
                    env={"PATH": _CHILD_PATH, "HOME": workdir, "TMPDIR": workdir}, pass_fds=(status_w, *extra_fds),
                    preexec_fn=_dies_with_caller())
            finally:
                os.close(status_w)  # the child holds the only write end: EOF once it is gone
                for fd in extra_fds:
                    os.close(fd)
            timed_out = False
            try:
                try:  # shield: wait_for must not cancel the protocol's future on timeout
                    await asyncio.wait_for(asyncio.shield(proto.closed), limits.wall_s)
                except TimeoutError:
                    timed_out = True
            finally:  # also on cancellation: no child outlives the call
                try:
                    if not proto.closed.done():
                        # safe from pid reuse: an unreaped leader, or the members still holding the
                        # pipe, keep the group id in use
                        try:
                            os.killpg(transport.get_pid(), signal.SIGKILL)
                        except ProcessLookupError:
                            pass  # already gone
                        try:
                            await asyncio.wait_for(asyncio.shield(proto.closed), _REAP_S)
                        except TimeoutError:
                            pass  # a process outside the group holds the pipe: closing it below ends that
                finally:
                    transport.close()
            output.feed(b"", final=True)
            os.set_blocking(status_r, False)  # a child that outlived its kill must not block us here
            try:
                status = os.read(status_r, 4096).decode("utf-8", "replace")
            except BlockingIOError:
                status = ""
        finally:
            os.close(status_r)
    finally:
        _remove_tree(workdir)
    rc = transport.get_returncode()
    if limits.isolation == "bwrap" and rc is not None and rc > 128 and not timed_out:
        rc = 128 - rc  # bwrap exits 128 + N for a child killed by signal N: as subprocess gives it, -N
    if not status.startswith("ok ") and not timed_out:
        raise SandboxError(f"the sandbox's child failed to start (exit code {rc}): "
                           f"{status.removeprefix('fail ') or output.clipped(limits.max_output_chars)}")
    isolation = status[3:].strip() if status.startswith("ok ") else "none"
    outcome, note = _classify(rc, timed_out, output, limits)
    note = f"[sandbox: {note}]" if note else ""
    text = output.clipped(limits.max_output_chars - len(note) - 1)
    if note:
        text += ("" if not text or text.endswith("\n") else "\n") + note
    return SandboxResult(text=text, outcome=outcome, exit_code=rc, isolation=isolation)


def run_python_sync(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """`run_python` for callers without an event loop (in a loop: `await run_python(...)`)."""
    import asyncio
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python(code, limits))
    raise RuntimeError("run_python_sync was called inside a running event loop; await run_python(...) instead")


# ---- the child: this file run as a script ------------------------------------------------------

def _isolate_network(methods: list[str]) -> str:
    libc = _libc()
    clone_newnet, clone_newuser = 0x40000000, 0x10000000
    uid, gid = os.getuid(), os.getgid()
    for method in methods:
        flags = clone_newnet if method == "netns" else clone_newnet | clone_newuser
        if libc.unshare(flags) != 0:
            continue  # EPERM/EINVAL: no such namespace for us; try the next way
        if method == "userns":  # map our own ids, else files we create would belong to nobody
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        return "netns"
    return ""


def _drop_capabilities() -> None:
    import ctypes
    libc = _libc()
    pr_set_no_new_privs, pr_capbset_drop = 38, 24
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    for cap in range(last_cap + 1):
        libc.prctl(pr_capbset_drop, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: nothing to drop then

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:  # version 3: all zero
        raise OSError(ctypes.get_errno(), "capset")


def _set_limits(cpu_s: float, mem_mb: int, nproc: int | None) -> None:
    import resource
    cpu = max(1, math.ceil(cpu_s))
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem_mb << 20, mem_mb << 20),
              (resource.RLIMIT_FSIZE, 16 << 20, 16 << 20), (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_NOFILE, 128, 128)]
    if nproc is not None:  # only in bwrap's user namespace, where this uid is the sandbox's alone
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


# the audit events the hook refuses (by prefix), grouped by the reason the code is told
_DENIED_EVENTS = {
    "network access is disabled in the sandbox": ("socket.",),
    "starting processes is not allowed": ("subprocess.", "os.system", "os.exec", "os.fork", "os.posix_spawn",
                                          "os.spawn"),
    "sending signals is not allowed": ("os.kill", "signal.pthread_kill"),  # os.kill covers os.killpg
    "ctypes is not allowed": ("ctypes.",),
    "changing the sandbox's limits is not allowed": ("resource.setrlimit", "resource.prlimit"),
    "reaching into the interpreter is not allowed": ("code.__new__", "gc.get_objects", "gc.get_referrers",
                                                     "gc.get_referents", "sys.remote_exec"),
    "creating links is not allowed": ("os.symlink", "os.link"),
    "namespaces are not allowed": ("os.unshare", "os.setns"),
}
# modules the hook cannot watch once loaded: importing them is refused (and the child will not
# start if one is loaded already)
_DENIED_IMPORTS = {"_posixsubprocess": "starting processes is not allowed", "_testcapi": "C test hooks are not allowed",
                   "_testinternalcapi": "C test hooks are not allowed",
                   "_xxsubinterpreters": "subinterpreters are not allowed (the audit hook does not reach them)",
                   "_xxinterpchannels": "subinterpreters are not allowed (the audit hook does not reach them)"}
# writing events -> (path index, dir_fd index or None) of each path they write to
_WRITE_EVENTS = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
                 "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
                 "shutil.rmtree": ((0, 1),), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),)}


def _install_audit_hook(root: str) -> None:
    import pathlib
    # the hook keeps its own references, so code that patches `os` cannot change its checks
    getcwd, readlink, fsdecode = os.getcwd, os.readlink, os.fsdecode
    plain_paths = (pathlib.PosixPath, pathlib.PurePosixPath)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied = {prefix: reason for reason, prefixes in _DENIED_EVENTS.items() for prefix in prefixes}
    prefixes, denied_imports, write_events = tuple(denied), dict(_DENIED_IMPORTS), dict(_WRITE_EVENTS)

    def check_write(path: object, dir_fd: object) -> None:
        if type(path) is int:
            return  # an open descriptor: it was checked when it was opened
        if type(path) in (str, bytes) or type(path) in plain_paths:  # not a custom __fspath__
            text = fsdecode(path)
        else:
            raise PermissionError(f"sandbox: writing through a {type(path).__name__} path is not allowed")
        if text == "/dev/null":
            return
        if not text.startswith("/"):
            base = getcwd() if type(dir_fd) is not int or dir_fd < 0 else readlink(f"/proc/self/fd/{dir_fd}")
            text = f"{base}/{text}"
        parts: list[str] = []
        for seg in text.split("/"):  # lexical: no symlinks can exist inside (creating them is refused)
            if seg == "..":
                parts = parts[:-1]
            elif seg not in ("", "."):
                parts.append(seg)
        full = "/" + "/".join(parts)
        if full != root and not full.startswith(root + "/"):
            raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {full}")

    def hook(event: str, args: tuple) -> None:
        if event.startswith(prefixes):
            reason = next(r for p, r in denied.items() if event.startswith(p))
            raise PermissionError(f"sandbox: {reason} ({event})")
        if event == "import" and args[0] in denied_imports:
            raise PermissionError(f"sandbox: {denied_imports[args[0]]} (import {args[0]})")
        if event == "open":
            if (args[2] or 0) & write_flags:
                if args[1] is None and type(args[0]) is not int and not fsdecode(args[0]).startswith("/"):
                    # os.open (mode None) does not tell its dir_fd: a relative path could be anywhere
                    raise PermissionError("sandbox: os.open for writing needs an absolute path")
                check_write(args[0], None)
        elif event in write_events:
            for p, d in write_events[event]:
                check_write(args[p], None if d is None else args[d])

    sys.addaudithook(hook)


def _run_user_code(code: str) -> None:
    import builtins
    import linecache
    import traceback
    import types
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main  # the user's classes and pickles belong to a clean __main__
    sys.argv = [_FILENAME]
    linecache.cache[_FILENAME] = (len(code), None, code.splitlines(True), _FILENAME)  # source in tracebacks
    try:
        exec(compile(code, _FILENAME, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: B036 - the user's code may raise anything; report it like Python
        try:
            report = traceback.TracebackException(type(e), e, e.__traceback__)
            # the bootstrap's and the audit hook's frames tell the model nothing
            report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
            sys.stderr.write("".join(report.format()))
        except MemoryError:
            sys.stderr.write(f"{type(e).__name__}\n")
        if isinstance(e, MemoryError):
            sys.stderr.flush()
            os._exit(_MEMORY_EXIT)
        sys.exit(1)


def _load_file_module(name: str, path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child_main(config_text: str) -> None:
    config = json.loads(config_text)
    status_fd = config["status_fd"]
    try:
        loaded = set(_DENIED_IMPORTS).intersection(sys.modules)
        if loaded:  # the hook could not stop these: refuse to run at all
            raise RuntimeError(f"modules loaded before the audit hook: {sorted(loaded)}")
        with open(_CODE_FILE, encoding="utf-8") as f:
            code = f.read()
        os.unlink(_CODE_FILE)
        root = os.path.realpath(os.getcwd())
        landlock = _load_file_module("_sandbox_landlock", config["landlock"])  # before it hides its own file
        netns = _isolate_network(config["netns"])
        _drop_capabilities()  # sets no_new_privs, which Landlock needs
        _set_limits(config["cpu_s"], config["mem_mb"], config["nproc"])
        landlock.restrict(landlock.sandbox_paths(root))  # raises when unavailable: no code runs then
    except BaseException as e:  # noqa: B036 - any failure is the sandbox's, reported to the parent
        os.write(status_fd, f"fail {type(e).__name__}: {e}".encode())
        os._exit(_SETUP_EXIT)
    os.write(status_fd, f"ok {config['outer']}{netns + '+' if netns else ''}landlock+audit".encode())
    os.close(status_fd)
    _install_audit_hook(root)
    _run_user_code(code)


if __name__ == "__main__":
    _child_main(sys.argv[1])
