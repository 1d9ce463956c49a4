"""The Python sandbox (tasks/sandbox/python_tool.py) with real child processes: no network, the limits end
runaway code with the right outcome (a call's processes, memory and disk counted for the call as a
whole, as root and as another user, with and without a cgroup: tests/sandbox_attacks.py), output is
bounded, nothing of the caller leaks in, no file outside its directory can be read (Landlock;
without it the tool refuses to run), nothing of the child is left behind (processes, descriptors,
cgroups, files), and cancellation is safe."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import textwrap
from pathlib import Path

import pytest

from sandbox_attacks import ATTACKS, as_caller, past_the_hook, plain_python

from laminar_hpc.tasks.sandbox import call_limits, python_tool
from laminar_hpc.tasks.sandbox.python_tool import SandboxLimits, run_python, run_python_sync

FAST = SandboxLimits(cpu_s=1, wall_s=3)
LAYERS = "bwrap+seccomp+landlock+audit+"  # then how the call is bounded: cgroup1, cgroup2 or rlimits


def _children() -> set[int]:
    """Pids whose parent is this process (zombies included: they count as left behind)."""
    kids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == os.getpid():
            kids.add(int(entry))
    return kids


def _call_descriptors() -> set[tuple[str, str]]:
    """This process's descriptors of the kinds a call opens (pipes, files, the seccomp program's
    memfd), as (number, target). Not sockets: a call opens none, and other parts of the process
    open and close theirs on their own (ZeroMQ's I/O thread reconnecting a socket an earlier test
    left: CI once saw one appear during a test here)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed while we looked (the listing's own descriptor among them)
        if not target.startswith(("socket:", "anon_inode:[eventpoll]", "anon_inode:[eventfd]")):
            out.add((fd, target))
    return out


def _call_cgroups() -> set[str]:
    """This process's calls' cgroups (tasks/sandbox/call_limits.py names them after its pid)."""
    return {str(p) for p in Path("/sys/fs/cgroup").rglob(f"laminar-call-{os.getpid()}-*")}


@pytest.fixture(autouse=True)
def nothing_left_behind(tmp_path, monkeypatch):
    """Every test: temporary files would go under tmp_path/sandboxes (a call writes none: its
    directory is a tmpfs of its own), and afterwards no child process, no extra descriptor and no
    cgroup of a call remains."""
    base = tmp_path / "sandboxes"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    kids, fds = _children(), _call_descriptors()
    yield base
    assert _children() - kids == set(), "a sandbox child process was left behind"
    assert _call_descriptors() - fds == set(), "a descriptor was left open"
    assert list(base.iterdir()) == [], "a file of the call was left on the host"
    assert _call_cgroups() == set(), "a call's cgroup was left behind"


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")  # a zombie still has its /proc entry


def _children_of(pid: int) -> set[int]:
    kids = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.add(int(entry))
        except OSError:
            continue
    return kids


def test_a_caller_killed_mid_call_takes_its_sandbox_with_it(tmp_path):
    """Before: `--die-with-parent` tied the code to bwrap, but nothing tied bwrap to its caller: a
    rollout killed mid-call left the call running until its code ended, for ever for code that
    blocks. Now the outer process gets SIGKILL when its caller dies."""
    caller_tmp = tmp_path / "caller"
    caller_tmp.mkdir()
    code = ("from laminar_hpc.tasks.sandbox.python_tool import SandboxLimits, run_python_sync\n"
            "run_python_sync('import time; time.sleep(300)', SandboxLimits(wall_s=300))\n")
    caller = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(caller_tmp)})
    outer: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not outer and time.monotonic() < deadline and caller.poll() is None:
            outer = _children_of(caller.pid)
            time.sleep(0.05)  # (polling /proc for the sandbox's start: no event to wait on)
        assert outer, f"the caller started no sandbox within 60 s (exit {caller.poll()})"
        caller.kill()
        caller.wait(timeout=30)
        deadline = time.monotonic() + 15
        while not all(map(_gone, outer)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(map(_gone, outer)), "the sandbox outlived its killed caller"
    finally:
        for pid in outer:  # (the old code's survivors, stopped by pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if caller.poll() is None:
            caller.kill()
            caller.wait(timeout=30)
        shutil.rmtree(caller_tmp, ignore_errors=True)


def test_a_plain_run():
    r = run_python_sync("print(sum(range(10)))\nimport sys\nprint('to stderr', file=sys.stderr)", FAST)
    assert (r.text, r.outcome, r.exit_code) == ("45\nto stderr\n", "ok", 0)
    assert r.isolation.startswith(LAYERS), r.isolation


def test_the_standard_library_works_without_site_packages():
    code = ("import dataclasses, fractions, json, math, re, statistics, threading\n"
            "@dataclasses.dataclass\nclass P:\n    x: int\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "print(P(2), fractions.Fraction(1, 3), statistics.mean([1, 2]), json.dumps({'a': math.pi}))")
    r = run_python_sync(code, FAST)
    assert r.outcome == "ok", r.text
    assert r.text == "thread\nP(x=2) 1/3 1.5 {\"a\": 3.141592653589793}\n"
    r = run_python_sync("import numpy", FAST)
    assert r.outcome == "error" and "ModuleNotFoundError" in r.text  # -S: no site-packages


def test_no_network_connection_reaches_a_listener_of_the_caller():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = ("import socket\n"
                "try:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "    print('connected')\n"
                "except OSError as e:\n"
                "    print('refused:', e)\n")
        r = run_python_sync(code, FAST)
        assert r.outcome == "ok" and "connected" not in r.text
        assert r.text.startswith("refused: sandbox: network access is disabled"), r.text
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever arrived


def test_the_network_namespace_has_no_way_out():
    r = run_python_sync("import os\nprint(os.readlink('/proc/self/ns/net'))\nprint(open('/proc/self/net/dev').read())",
                        FAST)
    assert r.outcome == "ok", r.text
    assert r.text.splitlines()[0] != os.readlink("/proc/self/ns/net")
    interfaces = [line.split(":")[0].strip() for line in r.text.splitlines()[3:] if ":" in line]
    assert interfaces == ["lo"]  # and that one is down: nothing to route through


def test_a_runaway_loop_ends_at_the_cpu_limit_and_the_child_is_gone():
    # the wall limit far away: the CPU limit must end it (the fixture sees bwrap and its namespace gone)
    r = run_python_sync("import os\nprint(os.getpid())\nwhile True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert r.outcome == "cpu_limit", r.text
    assert r.exit_code in (-24, -9)  # SIGXCPU, or SIGKILL at the hard limit
    assert r.text.endswith("[sandbox: CPU time limit of 1s reached; the process was killed]")


def test_a_sleeping_child_ends_at_the_wall_limit_and_its_group_is_killed():
    r = run_python_sync("import os, time\nprint(os.getpid())\ntime.sleep(60)", SandboxLimits(cpu_s=1, wall_s=2))
    assert (r.outcome, r.exit_code) == ("timeout", -9), r.text
    assert r.text.endswith("[sandbox: wall-clock limit of 2s reached; the process was killed]")


@pytest.mark.parametrize("code", ["x = bytearray(10**10)",
                                  "x = []\nwhile True:\n    x.append(bytearray(10**6))"])
def test_a_memory_bomb_ends_with_memory_and_the_caller_is_fine(code):
    r = run_python_sync(code, SandboxLimits(cpu_s=2, mem_mb=128, wall_s=10))
    assert (r.outcome, r.exit_code) == ("memory", python_tool._MEMORY_EXIT), r.text
    assert "MemoryError" in r.text and r.text.endswith("[sandbox: memory limit of 128 MiB reached]")
    assert run_python_sync("print('still fine')", FAST).text == "still fine\n"


def test_a_megabyte_of_output_is_truncated_to_the_limit_keeping_head_and_tail():
    r = run_python_sync("print('a' * 500_000 + 'b' * 500_000)", FAST)
    assert r.outcome == "ok" and len(r.text) <= 2000
    head, marker, tail = r.text.partition("\n... [output truncated: ")
    assert marker and head == "a" * len(head) and len(head) > 900
    omitted, _, tail = tail.partition(" chars omitted] ...\n")
    assert tail == "b" * (len(tail) - 1) + "\n" and len(tail) > 900
    assert len(head) + int(omitted) + len(tail) == 1_000_001  # everything accounted for
    r = run_python_sync("for i in range(20000):\n    print(i)", SandboxLimits(cpu_s=2, wall_s=10, max_output_chars=300))
    assert r.text.startswith("0\n1\n2\n") and r.text.endswith("19998\n19999\n") and len(r.text) <= 300


def test_errors_show_the_users_traceback_only():
    r = run_python_sync("def f(:\n    pass", FAST)
    assert (r.outcome, r.exit_code) == ("error", 1)
    assert 'File "main.py", line 1' in r.text and "SyntaxError: invalid syntax" in r.text
    r = run_python_sync("def f():\n    return 1 / 0\n\nf()", FAST)
    assert r.outcome == "error" and r.text.endswith("ZeroDivisionError: division by zero\n")
    assert "return 1 / 0" in r.text and "python_tool.py" not in r.text  # the source line, not our frames
    r = run_python_sync("import sys\nprint('partial')\nsys.exit(3)", FAST)
    assert (r.outcome, r.exit_code) == ("error", 3)
    assert r.text == "partial\n[sandbox: the process exited with code 3]"


def test_processes_ctypes_and_limit_changes_are_refused():
    attempts = ["import subprocess", "import os; os.system('true')", "import os; os.fork()",
                "import os; os.execv('/bin/true', ['true'])", "import os; os.posix_spawn('/bin/true', ['true'], {})",
                "import os, signal; os.kill(1, signal.SIGTERM)", "import ctypes; ctypes.CDLL(None)",
                "import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "import _posixsubprocess",
                "import gc; gc.get_objects()", "import os; os.symlink('/etc', 'etc')"]
    code = "results = []\n"
    for attempt in attempts:
        code += f"try:\n    {attempt}\n    print('ALLOWED', {attempt!r})\nexcept PermissionError as e:\n    print(e)\n"
    r = run_python_sync(code, FAST)
    assert r.outcome == "ok" and "ALLOWED" not in r.text, r.text
    lines = r.text.splitlines()
    assert len(lines) == len(attempts) and all(line.startswith("sandbox: ") for line in lines), r.text
    assert "starting processes is not allowed (os.fork)" in lines[2]


def test_the_callers_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("LAMINAR_TEST_SECRET", "s3cret-token-123")
    r = run_python_sync("import os\nprint(sorted(os.environ))\nprint(os.environ.get('LAMINAR_TEST_SECRET'))", FAST)
    names, value = r.text.splitlines()
    assert value == "None" and "s3cret" not in r.text
    # (PWD: bwrap's --chdir sets it to /work)
    assert set(eval(names)) <= {"PATH", "HOME", "TMPDIR", "LC_CTYPE", "PWD"}  # noqa: S307 - our own printed list


def test_writes_stay_in_the_working_directory_which_is_removed(tmp_path, nothing_left_behind):
    outside = tmp_path / "outside.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    code = ("import os, tempfile\n"
            "print(os.getcwd())\n"
            "open('inside.txt', 'w').write('ok')\n"
            "os.mkdir('sub'); open('sub/deeper.txt', 'w').write('ok'); os.chmod('sub', 0)\n"
            "fd, name = tempfile.mkstemp(); os.close(fd); print(os.path.dirname(name) == os.getcwd())\n"
            f"for attempt in (lambda: open({str(outside)!r}, 'w'), lambda: os.remove({str(keep)!r}),\n"
            "                lambda: open('../escape.txt', 'a'), lambda: os.rename('inside.txt', '/tmp/x'),\n"
            f"                lambda: os.open('dirfd.txt', os.O_WRONLY | os.O_CREAT, dir_fd=os.open({str(tmp_path)!r}, 0))):\n"
            "    try:\n        attempt()\n        print('ALLOWED')\n"
            "    except (PermissionError, FileNotFoundError) as e:\n        print(e)\n")
    r = run_python_sync(code, FAST)
    assert r.outcome == "ok", r.text
    lines = r.text.splitlines()
    # the call's own tmpfs at /work; nothing else of the caller's exists
    assert lines[0] == "/work" and lines[1] == "True"
    assert all(line.startswith("sandbox: writing outside the working directory") for line in lines[2:6]), r.text
    assert lines[6].startswith("[Errno 2] No such file or directory") and len(lines) == 7, r.text
    assert list(nothing_left_behind.iterdir()) == []  # nothing on the host, the unreadable folder included
    assert not outside.exists() and keep.read_text() == "mine" and not (tmp_path / "dirfd.txt").exists()
    assert not (nothing_left_behind / "escape.txt").exists()


def test_no_file_outside_the_working_directory_can_be_read(tmp_path):
    """Model-written code reading the run directory's keys, the home directory, shared memory,
    /etc and other processes: every one refused by Landlock (before issue 28 all were readable)."""
    from laminar_hpc.transport.security import ensure_keys, key_file
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "config.yaml").write_text("name: secret-run\n")
    ensure_keys(run)
    key = key_file(run, "launcher")
    shm = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="laminar-test-") if os.path.isdir("/dev/shm") else None
    targets = [("read", str(key)), ("read", str(run / "config.yaml")), ("list", str(run)),
               ("list", str(run / "secrets")), ("list", os.path.expanduser("~")), ("read", "/etc/passwd"),
               ("list", "/"), ("read", f"/proc/{os.getpid()}/environ")]
    if shm is not None:
        targets.append(("read", shm.name))
    code = ("import os\n"
            f"for how, path in {targets!r}:\n"
            "    try:\n"
            "        got = open(path, 'rb').read() if how == 'read' else os.listdir(path)\n"
            "        print('READ', path, repr(got)[:60])\n"
            "    except (PermissionError, FileNotFoundError) as e:\n"  # refused, or absent from bwrap's mounts
            "        print('refused', e.filename)\n"
            "print(sum(range(5)), open('/dev/null').read() == '', len(open('/dev/urandom', 'rb').read(8)))\n")
    try:
        r = run_python_sync(code, FAST)
    finally:
        if shm is not None:
            shm.close()
    assert r.outcome == "ok", r.text
    lines = r.text.splitlines()
    assert lines[:-1] == [f"refused {path}" for _, path in targets], r.text
    assert lines[-1] == "10 True 8"  # the standard library and the usual devices still work
    assert "secret" not in r.text.replace("secrets", "")


def test_without_landlock_the_tool_refuses_to_run_with_one_line(tmp_path, monkeypatch):
    """A kernel without Landlock (ENOSYS from landlock_create_ruleset, as a stub of the syscall
    gives it here): the child runs no code and the call raises SandboxError saying why."""
    stub = tmp_path / "no_landlock.py"  # the real module (bound into the sandbox as it), its syscall stubbed
    stub.write_text(Path(python_tool._LANDLOCK_FILE).read_text() + textwrap.dedent("""
        class _NoLandlock:
            def syscall(self, *args):
                ctypes.set_errno(38)  # ENOSYS: a kernel before 5.13
                return -1
        _libc = _NoLandlock
    """))
    monkeypatch.setattr(python_tool, "_LANDLOCK_FILE", str(stub))
    with pytest.raises(python_tool.SandboxError) as err:
        run_python_sync("print('the code ran')", FAST)
    msg = str(err.value)
    assert "\n" not in msg and "the code ran" not in msg
    assert "needs Landlock to hide files from the code it runs, and it is not available here: this kernel has no " \
           "Landlock" in msg and "Linux >= 5.13" in msg and "refuses to run without it" in msg


def test_several_sandboxes_at_once():
    async def main():
        codes = [f"print({i} * 1000 + sum(range(1000)))" for i in range(4)]
        return await asyncio.gather(*(run_python(c, FAST) for c in codes))
    results = asyncio.run(main())
    assert [r.outcome for r in results] == ["ok"] * 4
    assert [r.text for r in results] == [f"{i * 1000 + 499500}\n" for i in range(4)]


def test_cancellation_kills_and_reaps_the_child_and_removes_its_directory(nothing_left_behind):
    before = _children()

    async def main() -> set[int]:
        task = asyncio.create_task(run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=30)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not _children() - before:
            assert loop.time() < deadline, "the sandbox never started"
            assert not task.done(), task
            await asyncio.sleep(0.01)  # polling for the child to exist, bounded by the deadline
        started = _children() - before
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return started

    started = asyncio.run(main())
    assert started and all(_gone(pid) for pid in started)
    assert _call_cgroups() == set()


def test_a_callers_timeout_around_run_python_leaves_nothing():
    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_python("while True:\n    pass", SandboxLimits(cpu_s=30, wall_s=30)), 0.5)
    asyncio.run(main())  # the fixture checks: no child, no descriptor, no directory


def test_limits_are_validated_and_sync_refuses_a_running_loop():
    with pytest.raises(ValueError):
        SandboxLimits(mem_mb=8)
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)

    async def inside():
        with pytest.raises(RuntimeError, match="await run_python"):
            run_python_sync("print(1)")
    asyncio.run(inside())


# -- limits of a call as a whole (issue 45): processes, memory and disk, as root and as another user --

def _counted(text: str) -> int:
    """The children an attack got started ("children N refused M")."""
    return int(text.split("children ")[1].split()[0])


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_an_attack_on_a_limit_of_the_whole_call_ends_with_that_limit(attack):
    """As this process (root in CI, with a cgroup of each call): 100 children against 32, 4 x 200
    MiB in children against 256 MiB, 1000 MiB in files of 10 MiB each against 64 MiB. Before, each
    ran to its end (100 children, 800 MiB held, 1000 MiB written: rlimits are per process, and the
    kernel skips RLIMIT_NPROC for root). The fixture checks that nothing of the call is left."""
    r = run_python_sync(ATTACKS[attack], SandboxLimits(cpu_s=5, wall_s=20))
    bounds = r.isolation.rsplit("+", 1)[1]
    if attack == "memory" and bounds == "rlimits":
        pytest.skip("no cgroup can be made here: memory is bounded per process (test_without_a_cgroup...)")
    assert r.outcome == attack, r.text
    limit = {"processes": "process limit of 32", "memory": "memory limit of 256 MiB",
             "disk": "disk limit of 64 MiB"}[attack]
    assert r.text.endswith(f"[sandbox: {limit} reached; every process of the call was killed]"), r.text
    if attack == "processes" and "children" in r.text:  # (killed at the limit, perhaps before it printed)
        assert _counted(r.text) < 32


@pytest.mark.skipif(os.geteuid() != 0 or plain_python() is None,
                    reason="acting as another user needs root, and an interpreter of this version they may read")
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_without_a_cgroup_processes_and_disk_are_still_bounded_and_memory_per_process(user):
    """Where no cgroup can be made (another user without delegation; root where cgroups are not
    writable, forced here), the kernel's RLIMIT_NPROC bounds the call's processes: under the
    caller's own uid, or, for root, under an unprivileged uid of its own (before: root's call got
    its 100 children). Memory is then bounded per process (at most 32 x 256 MiB), which the result's
    isolation ("rlimits") and the log say."""
    got = as_caller(user, no_cgroup=user == "root")
    for attack, r in got.items():
        assert r["isolation"] == LAYERS + "rlimits", (attack, r)
    assert got["processes"]["outcome"] == "processes", got["processes"]["text"]
    assert _counted(got["processes"]["text"]) < 32
    assert got["disk"]["outcome"] == "disk", got["disk"]["text"]
    assert got["memory"]["outcome"] == "ok" and got["memory"]["text"] == "children [3, 4, 5, 6]\n"  # per process


def test_a_root_call_without_a_cgroup_whose_uid_cannot_read_the_interpreter_fails_closed(monkeypatch):
    """Root without a cgroup runs the call as an unprivileged uid: where that uid cannot reach the
    interpreter (this machine's lives under /root), the call refuses to run, saying why."""
    if os.geteuid() != 0:
        pytest.skip("a root caller's fallback")
    if all(os.stat(p).st_mode & 0o005 == 0o005 for p in Path(sys.base_prefix).parents if str(p) != "/"):
        pytest.skip(f"every user may read {sys.base_prefix} here")
    monkeypatch.setattr(call_limits.CallCgroup, "make", classmethod(lambda cls, **kw: None))
    with pytest.raises(python_tool.SandboxError) as err:
        run_python_sync("print('ran')", FAST)
    assert "\n" not in str(err.value) and "runs as the unprivileged uid" in str(err.value)
    assert "make them readable to others, or run the campaign where it can make a cgroup" in str(err.value)


def test_code_past_the_hook_reaches_no_keyring_no_file_mode_and_no_process_outside():
    """Round 4's findings against the Landlock-only mode (the code ran as the caller's uid in its
    session: it read the session keyring, chmodded a root file, signalled other processes), run
    under bubblewrap from a subinterpreter, where no audit hook is: seccomp refuses keyctl, the mount
    namespace is read-only outside /work, and the PID namespace holds no process of the caller."""
    code = past_the_hook("_xxsubinterpreters") + textwrap.dedent(f"""
        subs = _xxsubinterpreters
        subs.run_string(subs.create(), '''
        import ctypes, os, sys
        libc = ctypes.CDLL(None, use_errno=True)
        r = libc.syscall(250, 0, -3, 0)  # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING)
        print("keyctl", r, ctypes.get_errno())
        for path in (sys.executable, "/usr/bin/env"):
            try:
                os.chmod(path, 0o4755)
                print("chmod ALLOWED", path)
            except OSError as e:
                print("chmod", e.errno)
        try:
            os.kill({os.getpid()}, 0)
            print("signal ALLOWED")
        except OSError as e:
            print("signal", e.errno)
        ''')
    """)
    r = run_python_sync(code, FAST)
    assert r.outcome == "ok", r.text
    assert r.text.splitlines() == ["keyctl -1 1", "chmod 30", "chmod 30", "signal 3"], r.text  # EPERM, EROFS, ESRCH
    assert os.stat("/usr/bin/env").st_mode & 0o4000 == 0
