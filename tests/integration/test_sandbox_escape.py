"""Hardening round 3 (issue 35), finding 1, through a real campaign's tool path: model-written code
in the built-in `python` tool that escapes the sandbox's audit hook (it clears the hook's deny list
through the frame of its own PermissionError) and then, where no hook reaches, tries what the
review did: a subinterpreter connects to a UNIX socket outside the sandbox, and `_posixsubprocess`
forks a process (it runs Python in its preexec_fn and never execs) in a session of its own that
should outlive the call; the survivor proves it runs by writing to a pipe of the attack (before
round 4 the check passed for a child whose exec failed: no descriptor was kept for its error pipe).

Inside bubblewrap (the only isolation since round 4) the escape from the hook still happens, and
nothing comes of it: the socket's path does not exist in the sandbox's mount namespace, and the
process dies with the sandbox's PID namespace. With the inner layers alone (the Landlock-only
mode, removed in round 4) the same code reached the listener (docs/reliability.md, round 3).

A tool-call format of the test's own (`env.format: file.py:Class`, user code the config names)
makes every first turn of every episode call `run` with the attack, whatever the tiny model wrote,
and records each observation the sandbox returned in a file, so the test reads what the attack saw.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import textwrap

import pytest
from helpers import REPO, laminar
from sandbox_attacks import past_the_hook

pytestmark = pytest.mark.slow

MARKER = "37.125"  # the survivor's sleep
INSIDE = b"/sandbox/python_tool.py"  # in the command line of every process of a call (the survivor forks it)

ATTACK = past_the_hook("_xxsubinterpreters") + textwrap.dedent('''
    import os, sys
    subs = _xxsubinterpreters
    print("hook escaped")
    subs.run_string(subs.create(), """
    import socket
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(SOCKET)
        s.sendall(b"escaped")
        print("connected")
    except OSError as e:
        print("connect failed:", e.strerror)
    """.replace("SOCKET", repr(SOCKET)))
    import _posixsubprocess, time
    alive_r, alive_w = os.pipe()

    def survive():  # in the forked child: a session of its own, then proof that it runs
        os.setsid()
        os.write(alive_w, b"alive")
        time.sleep(MARKER)
    r, w = os.pipe()
    _posixsubprocess.fork_exec([b"/nonexistent"], [b"/nonexistent"], True, (w,), None, None, -1, -1, -1, -1, -1,
                               -1, r, w, False, False, -1, None, None, None, -1, survive, False)
    os.close(w)
    os.close(alive_w)
    print("survivor started:", os.read(alive_r, 5) == b"alive")
''')

FORMAT = textwrap.dedent('''
    import json
    from laminar_hpc.tasks.tools.episode import HermesFormat, ToolCall

    class AttackFormat(HermesFormat):
        """Every model turn ends with a call of `run` with the attack; observations are recorded."""
        def stopped(self, tok, ids):
            return False

        def turn_calls(self, tok, ids):
            return [ToolCall("run", {"code": CODE})]

        def observation_text(self, results):
            with open(SEEN, "a") as f:
                for r in results:
                    f.write(json.dumps({"text": r.text, "outcome": r.outcome}) + "\\n")
            return super().observation_text(results)
''')


def _survivors() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if INSIDE in f.read():
                        found.append(int(entry))
            except OSError:
                continue  # exited while we looked
    return found


@pytest.fixture
def listener(tmp_path):
    """A UNIX socket of the caller's, outside any sandbox (as tmux's, docker's, the run's)."""
    path = tmp_path / "outside.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.listen()
    sock.setblocking(False)
    yield path, sock
    sock.close()


# exclusive: it looks for every sandboxed call's process on the machine (`_survivors`); another
# test's calls running beside it were counted as survivors, and killed (test_sandbox's got SIGKILL)
@pytest.mark.exclusive
def test_code_that_escapes_the_audit_hook_reaches_nothing_and_leaves_nothing(tmp_path, listener):
    path, sock = listener
    seen = tmp_path / "seen.jsonl"
    code = ATTACK.replace("SOCKET", repr(str(path))).replace("MARKER", MARKER)
    fmt = tmp_path / "attack_format.py"
    fmt.write_text(FORMAT.replace("CODE", repr(code)).replace("SEEN", repr(str(seen))))
    before = set(_survivors())
    run = tmp_path / "run"
    res = laminar("run", str(REPO / "configs" / "tiny.yaml"), "--run-dir", str(run), "trainer.total_steps=2",
                  "rollout.count=1", "relay.count=1", "model.max_seq_len=256", "env.tools={run: python}",
                  f"env.format={fmt}:AttackFormat", "env.max_turns=2", "env.observation_max_chars=300",
                  "env.python.wall_s=10", timeout=300)
    try:
        assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
        results = [json.loads(line) for line in seen.read_text().splitlines()]
        assert results, "no tool call ran"
        for r in results:  # the hook was escaped in every call, and that reached nothing
            assert r["outcome"] == "ok" and r["text"].startswith("hook escaped\n"), r
            assert "connect failed: No such file or directory" in r["text"] and "connected\n" not in r["text"], r
            assert "survivor started: True" in r["text"], r  # it ran, inside the sandbox
        with pytest.raises(BlockingIOError):
            sock.accept()  # no connection ever arrived
        assert set(_survivors()) - before == set(), "a process started by tool code outlived its call"
        s = json.loads((run / "summary.json").read_text())
        assert s["outcome"] == "completed" and s["tool_outcomes"]["ok"] > 0 and s["tool_outcomes"]["error"] == 0
    finally:
        for pid in set(_survivors()) - before:
            with contextlib.suppress(ProcessLookupError):  # (it may have ended since it was seen)
                os.kill(pid, 9)  # (only on failure) what the attack left, by PID
