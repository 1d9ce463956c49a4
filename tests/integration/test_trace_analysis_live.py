"""`laminar trace summary` of a live run, while a role's process still writes its trace."""
from __future__ import annotations

import subprocess
import sys

from laminar_hpc.cli import main as cli

from helpers import REPO


# -- the same run as real trace files -------------------------------------------------------------


LIVE_WRITER = """
import sys
from laminar_hpc.metrics.trace import Tracer
tr = Tracer(sys.argv[1], "rollout-0")
tr.emit("util", busy_s=0.0, weight_wait_s=0.0, running=0, kv=0)
for i in range(20):
    tr.emit("traj_finished", traj=f"{i}.0", version=0, t_start=0.0, t_end=0.0, tokens=i, reward=0.0)
tr.emit("util", busy_s=0.001, weight_wait_s=0.0, running=0, kv=0)
tr.flush()
print("flushed", flush=True)
sys.stdin.readline()  # alive (the file open for writing) until the test is done
"""


def test_a_live_run_is_summarised_while_its_roles_write(tmp_path, capsys):
    proc = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "flushed"
        assert cli(["trace", "summary", str(tmp_path)]) == 0
        assert "20 trajectories" in capsys.readouterr().out
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
