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


# -- every value stays one literal word --------------------------------------------------------
def sbatch_options(text: str) -> list[list[str]]:
    """The #SBATCH lines as sbatch reads them: only those before the first command (sbatch stops
    reading there), each split with shell quoting, where an unquoted '#' starts a comment."""
    lines = text.split("\n")  # bash and sbatch break lines only there (str.splitlines also at \x1c, \x85, ...)
    end = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert not [ln for ln in lines[end:] if ln.startswith("#SBATCH")], "an #SBATCH line after the first command"
    return [shlex.split(ln[len("#SBATCH"):], comments=True) for ln in lines[1:end] if ln.startswith("#SBATCH")]


def run_script(tmp_path, text: str, env: dict | None = None) -> list[str]:
    """Run the rendered script with `bash`; its last line execs the interpreter, here a stand-in
    that records its arguments. Returns them."""
    script, argv_out = tmp_path / "job.sbatch", tmp_path / "argv"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    fake = tmp_path / "fake-python"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$ARGV_OUT"\n')
    fake.chmod(0o755)
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LAMINAR_PYTHON": str(fake),
                              "ARGV_OUT": str(argv_out), **(env or {})})
    assert res.returncode == 0, res.stderr
    return argv_out.read_text().split("\0")[:-1]


HOSTILE = "$(touch PWNED) `touch PWNED` ${HOME} it's \"q\" \\ ~ * #x; touch PWNED"


def test_values_with_shell_syntax_stay_literal_in_the_script(tmp_path):
    from laminar_hpc.launch.submit import render_sbatch
    overrides = ["slurm.partition=gpu queue#1", "slurm.account=$(touch PWNED)", "slurm.job_name=it's `touch PWNED`",
                 "slurm.additional_parameters.comment=a b; touch PWNED", "slurm.constraint='a|b'"]
    cfg = load_config(REPO / "configs" / "quickstart-slurm.yaml", overrides)
    run_dir = f"runs/{HOSTILE}"
    text = render_sbatch(cfg, "configs/quickstart-slurm.yaml", overrides, run_dir=run_dir)
    opts = sbatch_options(text)
    assert all(len(words) == 1 for words in opts if words != ["hetjob"]), opts  # one option per line
    got = dict(words[0].split("=", 1) for words in opts if "=" in words[0])
    assert got["--partition"] == "gpu queue#1" and got["--account"] == "$(touch PWNED)"
    assert got["--job-name"] == "it's `touch PWNED`" and got["--comment"] == "a b; touch PWNED"
    assert got["--constraint"] == "a|b"
    argv = run_script(tmp_path, text)
    assert argv == ["-m", "laminar_hpc.cli", "drive", "configs/quickstart-slurm.yaml", *overrides, "--run-dir", run_dir]
    assert run_script(tmp_path, text, {"RUN_DIR": HOSTILE})[-1] == HOSTILE  # the user's RUN_DIR wins
    assert not (tmp_path / "PWNED").exists(), "a value ran as a command"


def test_the_configured_python_is_one_word(tmp_path):
    from laminar_hpc.launch.submit import render_sbatch
    fake_dir = tmp_path / "my envs; touch PWNED"
    fake_dir.mkdir()
    python = fake_dir / "python"
    python.write_text('#!/bin/sh\nprintf "%s" "$0" > "$ARGV_OUT"\n')
    python.chmod(0o755)
    text = render_sbatch(load_config(REPO / "configs" / "quickstart-slurm.yaml", [f"slurm.python={python}"]),
                         "c.yaml", [], run_dir="runs/x")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    res = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "ARGV_OUT": str(tmp_path / "argv")})
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "argv").read_text() == str(python) and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("yaml_text,key", [
    ('slurm: {partition: "debug\\n#SBATCH --wrap=evil"}', "slurm.partition"),
    ('slurm: {additional_parameters: {"x\\ntouch PWNED": 1}}', "slurm.additional_parameters"),
    ('name: "run\\nrm -rf ~"', "name"),
])
def test_a_line_break_in_a_config_value_is_refused_in_one_line(tmp_path, laminar, yaml_text, key):
    cfg = tmp_path / "c.yaml"
    cfg.write_text((REPO / "configs" / "quickstart-slurm.yaml").read_text() + "\n" + yaml_text + "\n")
    out = laminar("render-sbatch", str(cfg), timeout=60)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and f"key '{key}'" in out.stderr and "remove it" in out.stderr


@pytest.mark.parametrize("args,what", [
    (["--run-dir", "runs/a\ntouch PWNED"], "--run-dir"),
    (["slurm.partition='x\ny'"], "override"),
])
def test_a_line_break_from_the_command_line_is_refused_in_one_line(laminar, args, what):
    out = laminar("render-sbatch", "configs/quickstart-slurm.yaml", *args, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and what in out.stderr and "control character" in out.stderr
