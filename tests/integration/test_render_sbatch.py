"""`laminar render-sbatch` from the command line. The scripts under slurm/ are golden files: each
names the command that rendered it, and rendering again must give exactly the same text."""
from __future__ import annotations

import shlex
import subprocess

import pytest

from laminar_hpc.config import load_config

from helpers import REPO


GOLDEN = sorted((REPO / "slurm").glob("*.sbatch"))


@pytest.mark.parametrize("path", GOLDEN, ids=[p.name for p in GOLDEN])
def test_examples_are_exactly_what_render_sbatch_prints(path, laminar):
    text = path.read_text()
    line = next(ln for ln in text.splitlines() if "rendered by: laminar render-sbatch" in ln)
    args = shlex.split(line.split("rendered by: laminar ", 1)[1])
    out = laminar(*args, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == text, f"{path.name} is stale: regenerate it with `laminar {' '.join(args)}`"


def test_rendered_script_is_valid_bash_with_the_sbatch_options():
    text = (REPO / "slurm" / "hetjob.sbatch").read_text()
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH hetjob" in sbatch and "#SBATCH --requeue" in sbatch
    # the time-limit warning goes to the role steps (the trainer checkpoints), not the batch shell
    assert any(ln.startswith("#SBATCH --signal=USR2@") for ln in sbatch)
    assert text.rstrip().splitlines()[-1].startswith("exec ")
    cfg = load_config(REPO / "configs" / "quickstart-slurm.yaml", ["slurm.hetjob=true"])
    assert f"#SBATCH --partition={cfg.slurm.partition}" in sbatch and f"#SBATCH --time={cfg.slurm.time_min}" in sbatch


def test_render_sbatch_rejects_a_bad_layout_in_one_line(laminar):
    out = laminar("render-sbatch", "configs/quickstart-slurm.yaml", "slurm.layout.rollout_nodes=9", timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "rollout_nodes=9" in out.stderr
