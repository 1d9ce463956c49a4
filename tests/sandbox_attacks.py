"""Round-4 attacks on the python tool's limits for a call as a whole (issue 45), shared by the
sandbox's tests: code that escapes the audit hook (it clears the hook's own list of denied imports
through the frame of its PermissionError) and then forks children through _posixsubprocess's
preexec_fn (a forked child runs Python there and never execs), so that only the kernel's limits
stand: 100 children against max_processes = 32, 4 x 200 MiB in children against mem_mb = 256,
1000 MiB written in files of 10 MiB each (each under the per-file limit).

`as_caller` runs them in a fresh interpreter that can be another user (`nobody`) or root without a
cgroup (the fallback), with an interpreter every user may read (/usr/bin/python3: this machine's
own Python lives under /root, which no other uid can enter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def past_the_hook(module: str) -> str:
    """Code that imports `module` although the sandbox's audit hook refuses it: it clears the hook's
    own list of denied imports through the frame of the PermissionError the hook raised."""
    return textwrap.dedent(f'''
        try:
            import {module}
        except PermissionError as e:
            tb = e.__traceback__
            while tb.tb_next:
                tb = tb.tb_next
            tb.tb_frame.f_locals["denied_imports"].clear()
            import {module}
    ''')


ESCAPE = past_the_hook("_posixsubprocess") + textwrap.dedent('''
    import os, sys, time

    def spawn(fn):
        """A child running fn() (forked, never exec'd): its pid, or the OSError of the fork."""
        def child():
            fn()
            os._exit(0)
        r, w = os.pipe()
        try:
            return _posixsubprocess.fork_exec([b"/nonexistent"], [b"/nonexistent"], True, (w,), None, None,
                                              -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, None,
                                              -1, child, False)
        except OSError as err:
            return err
        finally:
            os.close(r)
            os.close(w)
''')
FORK = ESCAPE + textwrap.dedent('''
    got = [spawn(lambda: time.sleep(30)) for _ in range(100)]
    live = [p for p in got if isinstance(p, int)]
    print("children", len(live), "refused", len(got) - len(live), flush=True)
    time.sleep(10)
''')
MEMORY = ESCAPE + textwrap.dedent('''
    def hold():
        b = bytearray(200 << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        time.sleep(30)
    print("children", [spawn(hold) for _ in range(4)], flush=True)
    time.sleep(10)
''')
DISK = textwrap.dedent('''
    for i in range(100):
        with open(f"f{i}", "wb") as f:
            for k in range(10):
                f.write(b"x" * (1 << 20))
    print("wrote 1000 MiB", flush=True)
''')
ATTACKS = {"processes": FORK, "memory": MEMORY, "disk": DISK}

_HARNESS = textwrap.dedent('''
    import json, os, pwd, sys
    sys.path[:0] = PATHS
    if USER != "root":
        u = pwd.getpwnam(USER)
        os.setgroups([]); os.setgid(u.pw_gid); os.setuid(u.pw_uid)
    from laminar_hpc.tasks.sandbox import call_limits
    from laminar_hpc.tasks.sandbox.python_tool import SandboxLimits, run_python_sync
    if NO_CGROUP:
        call_limits.CallCgroup.make = classmethod(lambda cls, **kw: None)
    out = {}
    for name, code in ATTACKS.items():
        r = run_python_sync(code, SandboxLimits(cpu_s=5, wall_s=20))
        out[name] = {"outcome": r.outcome, "text": r.text, "isolation": r.isolation}
    print(json.dumps(out))
''')


def plain_python() -> str | None:
    """An interpreter of this Python's version that every user may read, or None."""
    for exe in ("/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=30)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == str(tuple(sys.version_info[:2])):
            return exe
    return None


def as_caller(user: str, *, no_cgroup: bool, attacks: dict[str, str] = ATTACKS) -> dict:
    """Each attack's {outcome, text, isolation}, run by `user` (root or another) in a fresh interpreter."""
    import site
    exe = plain_python()
    assert exe is not None
    paths = [str(REPO), *site.getsitepackages()]
    code = (_HARNESS.replace("PATHS", repr(paths)).replace("USER", repr(user))
            .replace("NO_CGROUP", repr(no_cgroup)).replace("ATTACKS", repr(attacks)))
    res = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=300, cwd="/",
                         env={"PATH": "/usr/bin:/bin", "HOME": "/"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
