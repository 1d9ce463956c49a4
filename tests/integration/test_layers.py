"""The commands that only read a run directory import no torch: `laminar status` and
`laminar trace ...` answer at once on a login node, where importing torch takes seconds (or
torch is not installed at all). Each command runs in a fresh interpreter, so what this test
process imported does not count."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from laminar_hpc.metrics.status import Status, write_status
from laminar_hpc.metrics.trace import Tracer
from laminar_hpc.rundir import RunDir

from helpers import REPO

HEAVY = ("torch", "transformers", "vllm", "megatron")

# runs the CLI as `laminar` does, then prints which heavy modules the command imported
RUN_CLI = """
import json, sys
from laminar_hpc.cli import main
code = main(sys.argv[1:])
print("HEAVY=" + json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
sys.exit(code)
""".format(heavy=HEAVY)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A small finished run: config, run.json, status, a checkpoint, metrics and trace files of
    the controller, a rollout and the trainer, all written where the roles write them."""
    rd = RunDir(tmp_path_factory.mktemp("run"))
    rd.config.write_text("name: layers\nrollout: {count: 1, max_batch: 2}\n")
    rd.record_start("layers0")
    write_status(rd.status, Status(t=time.time(), step=2, total_steps=2, trainer_version=3, trajectories_per_s=1.5,
                                   phase="done", rollout_versions={0: 3}))
    ckpt = rd.checkpoint(2)
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "version": 3}))
    (ckpt / "COMPLETE").write_text("")
    rd.metrics.write_text("".join(json.dumps({"step": s, "trajectories": 2, "tokens": 20, "reward_mean": 0.5,
                                               "staleness_mean": 0.0, "staleness_max": 0, "wait_s": 0.1}) + "\n"
                                  for s in (1, 2)))
    for role, events in {
        "controller-0": [("role_start", {"pid": 1})],
        "rollout-0": [("role_start", {"pid": 2}), ("traj_started", {"traj": "1.0", "version": 0, "prompt_tokens": 3,
                                                                     "resumed_tokens": 0}),
                      ("traj_finished", {"traj": "1.0", "version": 0, "t_start": 0.0, "t_end": 0.0, "tokens": 9,
                                         "reward": 1.0})],
        "trainer-0": [("role_start", {"pid": 3}), ("train_step", {"step": 1, "version": 1, "train_s": 0.1,
                                                                   "wait_s": 0.1, "tokens": 20, "loss": 0.0,
                                                                   "staleness_mean": 0.0, "reward": 0.5})],
    }.items():
        tracer = Tracer(rd, role)
        for name, fields in events:
            tracer.emit(name, **fields)
        tracer.close()
    return rd


def _laminar(*argv: str) -> tuple[str, list[str]]:
    """(stdout, heavy modules imported) of `laminar ARGV` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", RUN_CLI, *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, _, heavy = proc.stdout.rpartition("HEAVY=")
    return out, json.loads(heavy)


def test_status_imports_no_torch(run_dir):
    out, heavy = _laminar("status", str(run_dir))
    assert f"checkpoint  {run_dir.checkpoint(2)} (step 2, version 3)" in out  # it read the checkpoint folders
    assert "trainer     step 2/2, version 3" in out and "starts      1" in out
    assert heavy == []


@pytest.mark.parametrize("argv, says", [
    (["summary"], "1 trajectories, 9 tokens"),
    (["summary", "--json"], '"trajectories": 1,'),
    (["compare", "{run}"], ["tokens", "9", "9", "1.00"]),  # a row; column widths follow the timed figures
    (["export", "-o", "{run}/trace.json"], " trace events)"),
])
def test_trace_commands_import_no_torch(run_dir, argv, says):
    argv = [a.format(run=run_dir) for a in argv]
    out, heavy = _laminar("trace", argv[0], str(run_dir), *argv[1:])
    if isinstance(says, list):
        assert says in [line.split() for line in out.splitlines()]  # it analysed the trace
    else:
        assert says in out  # it analysed the trace
    assert heavy == []
