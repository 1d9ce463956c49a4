"""The Python tool: run untrusted code (a model's tool call) in a child process with limits and
without network, and return what it printed.

    result = await run_python("print(sum(range(10)))", SandboxLimits(cpu_s=1, wall_s=3))
    result.text, result.outcome          # ("45\\n", "ok")
    run_python_sync("while True: pass").outcome     # "cpu_limit" (outside an event loop)

`outcome`: "ok" (exit 0); "error" (an exception, a syntax error, a nonzero exit: `text` ends with the
traceback, trimmed to the user's frames); "timeout" (`wall_s` passed: the call was killed);
"cpu_limit" (RLIMIT_CPU: SIGXCPU at `cpu_s` rounded up to whole seconds, SIGKILL one second later);
"memory" (the call's memory limit: a MemoryError under RLIMIT_AS, an abort for lack of memory, or a
process of the call killed at its cgroup's limit); "processes" (a fork refused at the call's process
limit); "disk" (the call's working directory full). A limit of the call as a whole ends the call at
once, every process of it killed (tasks/sandbox/call_limits.py). `text` is stdout and stderr merged
(unbuffered, so in order), head and tail kept within `max_output_chars` around a "... [output
truncated: N chars omitted] ..." marker, plus a "[sandbox: ...]" line saying which limit ended the
run. `exit_code` is the return code as `subprocess` gives it (-9: SIGKILL). `isolation` names the
layers that held, "bwrap+seccomp+landlock+audit", and how the call's processes and memory were
bounded ("+cgroup1", "+cgroup2" or "+rlimits"); "none" if the child died before its set-up finished.

The outer wall is bubblewrap (tasks/sandbox/bwrap.py): namespaces (pid, network, mount, IPC, UTS, user) and
a seccomp filter, the working directory a tmpfs of `disk_mb` at /work inside. There is no other
isolation: without bubblewrap the call fails closed with one line saying how to install it (a
Landlock-only mode ran the code as the caller's uid in its session, and was removed: round 4,
docs/reliability.md). The call's processes and memory are bounded for the call as a whole by a
cgroup of its own where one can be made, else by rlimits under an unprivileged uid
(tasks/sandbox/call_limits.py).

What the child gets: `sys.executable -I -S -B -u` (no site-packages, no PYTHON* variables), the
tmpfs as its working directory (HOME and TMPDIR too), stdin from /dev/null, its own session and
PID namespace, the code on a sealed memory file descriptor (no file of the host holds it). The
child is this file run as a script: before the user's code it sets, in order,
- no capabilities (no_new_privs, bounding set, capset to zero);
- RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (16 MiB per file), RLIMIT_CORE 0, RLIMIT_NOFILE 128, and
  RLIMIT_NPROC (`max_processes`), which the kernel counts per uid outside bwrap's user namespace;
- Landlock (tasks/sandbox/landlock.py; Linux >= 5.13): no file outside the working directory can be
  opened, read, listed or written, except the standard library and the system's shared libraries,
  read-only, and /dev/null, /dev/zero, /dev/urandom; TCP bind/connect (ABI 4) and signals and
  abstract UNIX sockets outside the sandbox (ABI 6) are refused too. Without Landlock the child does
  not run the code: the call raises SandboxError saying why (fail closed);
- an audit hook (`sys.addaudithook`), always, raising PermissionError for `_DENIED_EVENTS` (every
  socket, processes, signals, ctypes, rlimits, links), `_DENIED_IMPORTS`, and writes outside the
  working directory (`_WRITE_EVENTS`). Audit hooks are not a security boundary on their own
  (determined code can reach around them); the kernel's layers are.

`run_python` is cancel-safe: when the awaiting task is cancelled (a tool runner's own timeout),
every process of the call is killed and reaped before the cancellation propagates.
"""
from __future__ import annotations

import codecs
import dataclasses
import functools
import json
import math
import os
import signal
import sys

# No asyncio (nor subprocess) at module level: the child runs this file, and an imported
# `_posixsubprocess` could fork past the audit hook (the child refuses to start if it finds it).
# The call's limits are imported by the parent only (the child has no package to import from).
if __name__ != "__main__":
    from laminar_hpc.tasks.sandbox.call_limits import WATCH_S, CallCgroup, fallback_uid

_SETUP_EXIT = 118  # the child's set-up failed (reported on the status pipe)
_MEMORY_EXIT = 117  # the user's code ran out of memory (a `sys.exit(117)` of its own reads the same)
_REAP_S = 5.0  # after SIGKILL, the longest wait for the exit to be reported
_LANDLOCK_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "landlock.py")  # loaded by the child
_FILENAME = "main.py"  # the user's code in tracebacks
ISOLATIONS = ("bwrap",)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the user's code): the child could not be set up."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_s: float = 2.0  # CPU seconds per process, rounded up to whole seconds (the kernel's granularity)
    mem_mb: int = 256  # memory of the call (its cgroup), and address space of each process, MiB
    wall_s: float = 5.0  # wall-clock seconds from the start of the child
    max_output_chars: int = 2000
    # bubblewrap's namespaces and seccomp filter (tasks/sandbox/bwrap.py), then the layers inside: the only
    # isolation there is (kept as a field so that a config naming it still reads)
    isolation: str = "bwrap"
    max_processes: int = 32  # processes of the call at once (its cgroup's pids.max, RLIMIT_NPROC)
    disk_mb: int = 64  # what the call may write in all: its working directory is a tmpfs of this size

    def __post_init__(self) -> None:
        if not (self.cpu_s > 0 and self.wall_s > 0 and self.mem_mb >= 32 and self.max_output_chars >= 200
                and self.isolation in ISOLATIONS and self.max_processes >= 1 and self.disk_mb >= 1):
            raise ValueError(f"sandbox limits {self}: cpu_s and wall_s must be > 0, mem_mb >= 32, "
                             f"max_output_chars >= 200, max_processes >= 1, disk_mb >= 1 and isolation one of "
                             f"{ISOLATIONS}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    text: str
    outcome: str  # "ok" | "error" | "timeout" | "cpu_limit" | "memory" | "processes" | "disk"
    exit_code: int | None
    isolation: str  # "bwrap+seccomp+landlock+audit+cgroup1" (the layers that held) | "none"


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


def _preexec(cgroup: CallCgroup | None, uid: int | None):
    """The `preexec_fn` of the call's first process (bwrap), run after the fork, before the exec:
    - it dies with its caller (PR_SET_PDEATHSIG): bwrap's `--die-with-parent` ties the sandboxed
      code to bwrap, but nothing tied bwrap to the rollout or test that started it, and a caller
      killed mid-call (SIGKILL, OOM) left it running until its code ended (seen: a bwrap 51 minutes
      past its caller). The signal follows the forking thread: the event loop's, which awaits the
      call until it ends;
    - it joins the call's cgroup, so every process of the call is counted there;
    - with `uid` (a root caller without a cgroup), it drops to that unprivileged uid, so that
      RLIMIT_NPROC holds inside bwrap's user namespace (tasks/sandbox/call_limits.py).
    libc is loaded here, before the fork; the child only calls prctl and writes."""
    prctl = _libc().prctl
    caller = os.getpid()

    def run() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != caller:  # the caller died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGKILL)
        if cgroup is not None:
            cgroup.join()
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
    return run


def _code_fd(code: str) -> int:
    """A sealed memory file holding `code`: the child reads it from its descriptor, and no file of
    the host (nor of the call's tmpfs) ever holds the code."""
    import fcntl
    fd = os.memfd_create("laminar-sandbox-code", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    data = code.encode("utf-8", "surrogateescape")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    os.lseek(fd, 0, os.SEEK_SET)  # the child reads from the start
    return fd


def _open_workdir(outer_pid: int, cgroup: CallCgroup | None, disk_bytes: int) -> int | None:
    """A descriptor of the call's working directory (a tmpfs of `disk_bytes` in its own mount
    namespace), opened through a process of the call (/proc/PID/cwd): it keeps the tmpfs readable
    after the call ends, so a full disk is known then too. None when no process shows it."""
    pids = cgroup.pids() if cgroup is not None else [c for k in _children(outer_pid) for c in (k, *_children(k))]
    for pid in pids:
        try:
            fd = os.open(f"/proc/{pid}/cwd", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue  # gone, or not ours to read
        st = os.fstatvfs(fd)
        if st.f_blocks * st.f_frsize == disk_bytes:  # the call's tmpfs, not a directory of the host
            return fd
        os.close(fd)
    return None


def _children(pid: int) -> list[int]:
    """The processes `pid`'s threads started (CONFIG_PROC_CHILDREN)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass
    return out


def _tree_size(pid: int) -> int:
    """The processes of the call without a cgroup: bwrap's and every descendant."""
    seen, todo = 0, [pid]
    while todo and seen < 100_000:
        seen += 1
        todo += _children(todo.pop())
    return seen


class _Handshake:
    """The parent's side of the child's start: once the child reports its set-up ("ok ..." or
    "fail ...") on the status pipe, open the call's working directory and let the child go on."""

    def __init__(self, status_r: int, go_w: int, cgroup: CallCgroup | None, disk_bytes: int):
        self.status_r, self.go_w, self.cgroup, self.disk_bytes = status_r, go_w, cgroup, disk_bytes
        self.status, self.workdir_fd, self.pid = b"", None, 0

    def readable(self) -> None:  # the event loop's reader callback
        try:
            data = os.read(self.status_r, 4096)
        except BlockingIOError:
            return
        self.status += data
        if self.status.startswith(b"ok ") and self.go_w >= 0:
            self.workdir_fd = _open_workdir(self.pid, self.cgroup, self.disk_bytes)
            self.go()
        elif not data:
            self.go()  # EOF: the child is gone

    def go(self) -> None:
        if self.go_w >= 0:
            try:
                os.write(self.go_w, b"g")
            except OSError:
                pass  # the child is gone
            os.close(self.go_w)
            self.go_w = -1

    def disk_full(self) -> bool:
        return self.workdir_fd is not None and os.fstatvfs(self.workdir_fd).f_bavail == 0

    def close(self) -> None:
        self.go()
        if self.workdir_fd is not None:
            os.close(self.workdir_fd)  # the tmpfs goes with its last reference
            self.workdir_fd = None


_NOTES = {"processes": "process limit of {max_processes} reached",
          "memory": "memory limit of {mem_mb} MiB reached",
          "disk": "disk limit of {disk_mb} MiB reached"}


def _classify(rc: int | None, timed_out: bool, hit: str | None, output: _Output,
              limits: SandboxLimits) -> tuple[str, str]:
    """(outcome, the note for the model) of a finished run; `hit`: the call's limit the kernel
    enforced (tasks/sandbox/call_limits.py), which ended it."""
    if hit is not None:
        return hit, _NOTES[hit].format(**dataclasses.asdict(limits)) + "; every process of the call was killed"
    if timed_out:
        return "timeout", f"wall-clock limit of {limits.wall_s:g}s reached; the process was killed"
    if rc == 0:
        return "ok", ""
    if rc == _MEMORY_EXIT:
        return "memory", _NOTES["memory"].format(mem_mb=limits.mem_mb)
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit", f"CPU time limit of {math.ceil(limits.cpu_s)}s reached; the process was killed"
    if rc is not None and rc < 0:
        if rc == -signal.SIGABRT and "memory" in output.tail[-500:].lower():
            return "memory", _NOTES["memory"].format(mem_mb=limits.mem_mb)
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
        return "error", f"the process was killed by {name}"
    # 1 is Python's exit after an uncaught exception, whose traceback says enough
    return "error", f"the process exited with code {rc}" if rc != 1 else ""


_said_rlimits = False  # the log says once per process that calls are bounded without a cgroup


def _bounds(limits: SandboxLimits) -> tuple[CallCgroup | None, int | None, str]:
    """How this call's processes and memory are bounded: (its cgroup, or None; the unprivileged uid
    a root caller drops to where there is no cgroup, or None; the isolation string's part)."""
    global _said_rlimits
    cgroup = CallCgroup.make(max_processes=limits.max_processes, mem_mb=limits.mem_mb)
    if cgroup is not None:
        return cgroup, None, f"cgroup{cgroup.version}"
    uid = fallback_uid() if os.geteuid() == 0 else None
    if not _said_rlimits:
        _said_rlimits = True
        import logging
        logging.getLogger(__name__).warning(
            "python tool: no cgroup can be made here (no delegated cgroup v2, no writable cgroup v1): each call's "
            "processes are bounded by RLIMIT_NPROC (%s), its memory per process, at most %d x %d MiB",
            f"as the unprivileged uid {uid}" if uid is not None else "of this user", limits.max_processes,
            limits.mem_mb)
    return None, uid, "rlimits"


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a sandboxed child process (module docstring); raises SandboxError only when the
    sandbox itself fails, never for what the code does."""
    import asyncio
    import subprocess

    from laminar_hpc.tasks.sandbox.bwrap import INSIDE_FILES, BwrapUnavailable, bwrap_command
    if not sys.executable:
        raise SandboxError("sys.executable is unknown: cannot start the sandbox's interpreter")
    loop = asyncio.get_running_loop()
    disk_bytes = limits.disk_mb << 20
    try:
        argv, extra_fds = bwrap_command(disk_bytes, {"python_tool.py": os.path.abspath(__file__),
                                                     "landlock.py": _LANDLOCK_FILE})
    except BwrapUnavailable as err:
        raise SandboxError(f"the python tool runs only inside bubblewrap: {err}") from None
    cgroup, uid, bounds = _bounds(limits)
    code_fd = _code_fd(code)
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    shake = _Handshake(status_r, go_w, cgroup, disk_bytes)
    hit, timed_out = None, False
    try:
        config = {"status_fd": status_w, "code_fd": code_fd, "go_fd": go_r, "cpu_s": limits.cpu_s,
                  "mem_mb": limits.mem_mb, "landlock": f"{INSIDE_FILES}/landlock.py", "nproc": limits.max_processes}
        output = _Output(limits.max_output_chars)
        try:
            transport, proto = await loop.subprocess_exec(
                lambda: _Protocol(loop, output), *argv, "-I", "-S", "-B", "-u", f"{INSIDE_FILES}/python_tool.py",
                json.dumps(config), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd="/", start_new_session=True, env={"PATH": "/usr/bin:/bin"},
                pass_fds=(status_w, code_fd, go_r, *extra_fds), preexec_fn=_preexec(cgroup, uid))
        finally:
            for fd in (status_w, code_fd, go_r, *extra_fds):  # the child holds its own copies
                os.close(fd)
        shake.pid = transport.get_pid()
        os.set_blocking(status_r, False)
        loop.add_reader(status_r, shake.readable)
        try:
            deadline = loop.time() + limits.wall_s
            while True:  # the call's end, its wall-clock limit, or a limit of the call as a whole
                left = deadline - loop.time()
                if left <= 0:
                    timed_out = True
                    break
                try:  # shield: wait_for must not cancel the protocol's future on timeout
                    await asyncio.wait_for(asyncio.shield(proto.closed), min(WATCH_S, left))
                    break
                except TimeoutError:
                    if cgroup is not None:
                        hit = cgroup.hit()
                    elif _tree_size(shake.pid) >= limits.max_processes:  # RLIMIT_NPROC refuses the next fork
                        hit = "processes"
                    hit = hit or ("disk" if shake.disk_full() else None)
                    if hit is not None:
                        break
        finally:  # also on cancellation: no process of the call outlives it
            try:
                if cgroup is not None:
                    cgroup.kill()  # every process of the call, wherever it went
                if not proto.closed.done():
                    # safe from pid reuse: an unreaped leader, or the members still holding the
                    # pipe, keep the group id in use; bwrap's PID namespace takes the rest
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
                loop.remove_reader(status_r)
                shake.readable()  # what is left in the pipe
                # what the kernel enforced, read after the call too: a call ended by its own code after
                # a refused fork, a kill at the memory limit or a full disk ends with that limit
                hit = hit or (cgroup.hit() if cgroup is not None else None) or ("disk" if shake.disk_full() else None)
                shake.close()
                if cgroup is not None:
                    cgroup.close()
        output.feed(b"", final=True)
        status = shake.status.decode("utf-8", "replace")
    finally:
        os.close(status_r)
        shake.close()
        if cgroup is not None:  # also when cancelled while the process was being started
            cgroup.close()
    rc = transport.get_returncode()
    if rc is not None and rc > 128 and not timed_out:
        rc = 128 - rc  # bwrap exits 128 + N for a child killed by signal N: as subprocess gives it, -N
    if not status.startswith("ok ") and not timed_out and hit is None:
        why = (status.removeprefix("fail ") or output.clipped(limits.max_output_chars)).strip()
        if uid is not None:  # fail closed, saying why: the unprivileged uid could not reach what it needs
            why += (f" (without a cgroup, a root campaign's python tool runs as the unprivileged uid {uid}, which "
                    f"must be able to read the interpreter under {sys.base_prefix} and the laminar_hpc package; "
                    "make them readable to others, or run the campaign where it can make a cgroup)")
        raise SandboxError(f"the sandbox's child failed to start (exit code {rc}): {why}")
    isolation = f"bwrap+seccomp+{status[3:].strip()}+{bounds}" if status.startswith("ok ") else "none"
    outcome, note = _classify(rc, timed_out, hit, output, limits)
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


def _set_limits(cpu_s: float, mem_mb: int, nproc: int) -> None:
    import resource
    cpu = max(1, math.ceil(cpu_s))
    # RLIMIT_NPROC: counted per uid outside bwrap's user namespace (the caller's, or the unprivileged
    # uid a root caller drops to without a cgroup; for uid 0 the kernel ignores it, the cgroup holds)
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem_mb << 20, mem_mb << 20),
              (resource.RLIMIT_FSIZE, 16 << 20, 16 << 20), (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_NOFILE, 128, 128), (resource.RLIMIT_NPROC, nproc, nproc)]
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
        with os.fdopen(config["code_fd"], "rb") as f:
            code = f.read().decode("utf-8", "surrogateescape")
        root = os.path.realpath(os.getcwd())
        landlock = _load_file_module("_sandbox_landlock", config["landlock"])  # before it hides its own file
        _drop_capabilities()  # sets no_new_privs, which Landlock needs
        _set_limits(config["cpu_s"], config["mem_mb"], config["nproc"])
        landlock.restrict(landlock.sandbox_paths(root))  # raises when unavailable: no code runs then
    except BaseException as e:  # noqa: B036 - any failure is the sandbox's, reported to the parent
        os.write(status_fd, f"fail {type(e).__name__}: {e}".encode())
        os._exit(_SETUP_EXIT)
    os.write(status_fd, b"ok landlock+audit")
    os.close(status_fd)
    # the parent opens the working directory (its disk stays countable after the call) and says go
    if os.read(config["go_fd"], 1) != b"g":
        os._exit(_SETUP_EXIT)
    os.close(config["go_fd"])
    _install_audit_hook(root)
    _run_user_code(code)


if __name__ == "__main__":
    _child_main(sys.argv[1])
