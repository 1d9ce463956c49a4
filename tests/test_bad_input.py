"""Bad input through the real command line: each case exits non-zero with ONE stderr line (no
traceback) that names the input and says what to do, and leaves an existing run directory
byte for byte as it was. Every case fails before a role starts, so no training runs here."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.launch.prepare import check_resume_model
from laminar_hpc.rundir import RunDirError

from conftest import REPO

CKPT = "step_000010"


def _cli(cwd, *args: str) -> str:
    """Run `laminar ARGS` as a user would; return its one-line error (asserting the contract)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "laminar_hpc.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it started a campaign: SIGTERM makes the CLI stop every role
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"`laminar {' '.join(args)}` did not refuse; it started a run:\n{err[-2000:]}")
    err = err.strip()
    assert proc.returncode != 0, (out, err)
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, f"stderr is not one line:\n{err}"
    assert err.startswith("laminar: error: "), err
    return err


def _snapshot(root) -> dict:
    """Every path under root with its bytes (None for directories)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = open(p, "rb").read() if os.path.isfile(p) else None
    return out


def _model(**changes) -> dict:
    return {**config_from_dict({}).model.model_dump(), **changes}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory from an earlier run: its config, a complete checkpoint, a log, metrics."""
    run = tmp_path / "runs" / "earlier"
    ckpt = run / "checkpoints" / CKPT
    ckpt.mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "config.yaml").write_text("name: earlier\n")
    (ckpt / "meta.json").write_text(json.dumps({"model": _model(), "step": 10, "version": 10}))
    (ckpt / "COMPLETE").write_text("ok\n")
    (run / "logs" / "trainer.log").write_text("step 10\n")
    (run / "metrics.jsonl").write_text('{"step": 10}\n')
    return run


def _write(tmp_path, text: str, name: str = "bad.yaml") -> str:
    (tmp_path / name).write_text(text)
    return name


def _refused(tmp_path, run, *args: str) -> str:
    """`laminar ARGS` fails in one line and changes nothing in `run`."""
    before = _snapshot(run)
    err = _cli(tmp_path, *args)
    assert _snapshot(run) == before, "the refused command changed the run directory"
    return err


# -- config files ------------------------------------------------------------------------------

def test_malformed_yaml_names_line_and_column(tmp_path, run_dir):
    cfg = _write(tmp_path, "name: x\ntrainer:\n  lr: a: b\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert f"{cfg}: line 3, column" in err and "malformed YAML" in err
    assert "quote" in err  # what to do


def test_tab_indent_says_use_spaces(tmp_path, run_dir):
    cfg = _write(tmp_path, "trainer:\n\tlr: 1\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert "line 2" in err and "spaces, not tabs" in err


def test_unknown_key_suggests_the_close_one(tmp_path, run_dir):
    cfg = _write(tmp_path, "trainer:\n  totl_steps: 5\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert err.startswith(f"laminar: error: {cfg}: unknown key 'trainer.totl_steps'")
    assert "did you mean 'trainer.total_steps'?" in err and "allowed:" in err


def test_key_of_another_section_says_where_it_lives(tmp_path):
    cfg = _write(tmp_path, "trainer:\n  max_new_tokens: 5\n")
    err = _cli(tmp_path, "run", cfg, "--run-dir", "never")
    assert "did you mean 'rollout.max_new_tokens'?" in err
    assert not (tmp_path / "never").exists()


def test_mistyped_value_names_key_value_and_default(tmp_path, run_dir):
    cfg = _write(tmp_path, "trainer:\n  total_steps: abc\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert f"{cfg}: key 'trainer.total_steps'" in err and "'abc'" in err and "integer" in err
    assert "the default is 300" in err


@pytest.mark.parametrize("section,key,value", [
    ("rollout", "count", -1), ("relay", "chunk_mb", -1), ("trainer", "rho", 0), ("trainer", "rho", -1),
])
def test_out_of_range_names_key_and_bound(tmp_path, run_dir, section, key, value):
    cfg = _write(tmp_path, f"{section}:\n  {key}: {value}\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert f"{cfg}: key '{section}.{key}'" in err and "greater than 0" in err and f"got {value}" in err
    assert "the default is" in err


def test_missing_config_file(tmp_path):
    err = _cli(tmp_path, "run", "nowhere.yaml")
    assert "nowhere.yaml: config file not found" in err and "check the path" in err
    assert os.listdir(tmp_path) == []  # no default run directory was made


# -- command-line overrides and arguments --------------------------------------------------------

@pytest.mark.parametrize("args,expect", [
    (["trainer.total_steps=abc"], "override 'trainer.total_steps=abc': key 'trainer.total_steps'"),
    (["nokey=1"], "override 'nokey=1': unknown key 'nokey'"),
    (["trainer.rho=0"], "override 'trainer.rho=0': key 'trainer.rho': Input should be greater than 0"),
    (["foo"], "override 'foo' must look like key.path=value"),
    (["trainer..lr=1"], "override 'trainer..lr=1' has an empty key part"),
    (["model.dim=66"], "ok.yaml (with override 'model.dim=66'): key 'model': dim=66 must be a multiple of n_heads"),
    (["--run-dir", "RUN", "foo"], "unrecognized arguments: foo"),  # after an option argparse sees it
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_override_errors_are_one_line(tmp_path, run_dir, args, expect):
    cfg = _write(tmp_path, "name: ok\n", "ok.yaml")
    args = [str(run_dir) if a == "RUN" else a for a in args]
    err = _refused(tmp_path, run_dir, "run", cfg, *args, "--run-dir", str(run_dir), "--resume")
    assert expect in err
    assert any(h in err for h in ("allowed", "default", "key.path=value", "--help", "must be")), err


def test_resume_needs_run_dir(tmp_path):
    cfg = _write(tmp_path, "name: ok\n", "ok.yaml")
    err = _cli(tmp_path, "run", cfg, "--resume")
    assert "--resume" in err and "--run-dir" in err
    assert os.listdir(tmp_path) == ["ok.yaml"]


def test_resume_of_a_directory_without_config(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine\n")
    err = _refused(tmp_path, tmp_path / "junk", "resume", "junk")
    assert "junk" in err and "no config.yaml" in err and "laminar run" in err


# -- datasets ---------------------------------------------------------------------------------

def test_missing_dataset_names_path_and_key(tmp_path, run_dir):
    cfg = _write(tmp_path, "task:\n  type: jsonl\n  path: data/absent.jsonl\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert "data/absent.jsonl: dataset file not found" in err and "set task.path" in err and cfg in err


def _dataset(tmp_path) -> str:
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "no answer"},
            {"question": "2+2?", "answer": "#### 4"}, {"prompt": "wrong field", "answer": "#### 1"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "d.jsonl"


def test_bad_row_fail_names_file_line_and_field(tmp_path, run_dir):
    data = _dataset(tmp_path)
    cfg = _write(tmp_path, f"task:\n  type: jsonl\n  path: {data}\n  on_bad_row: fail\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert f"{data} line 2" in err and "'answer'" in err and "on_bad_row: skip" in err


def test_bad_row_skip_counts_and_logs(tmp_path, caplog):
    from laminar_hpc.tasks import build_task
    _dataset(tmp_path)
    cfg = config_from_dict({"task": {"type": "jsonl", "path": str(tmp_path / "d.jsonl"), "on_bad_row": "skip"}})
    with caplog.at_level(logging.WARNING):
        src = build_task(cfg.task, 0)
    assert len(src) == 2 and src.skipped == 2
    # every role logs this through the root logger into logs/<role>.log
    assert any("skipped 2 of 4 rows" in r.getMessage() for r in caplog.records), caplog.text


def test_unusable_prompt_template(tmp_path):
    data = _dataset(tmp_path)
    cfg = _write(tmp_path, f"task:\n  type: jsonl\n  path: {data}\n  on_bad_row: skip\n"
                           "  prompt_template: 'Q: {question}'\n")
    err = _cli(tmp_path, "run", cfg, "--run-dir", "never")
    assert "task.prompt_template" in err and "{prompt}" in err
    assert not (tmp_path / "never").exists()


# -- run directories --------------------------------------------------------------------------

def test_resume_with_a_different_model_shape(tmp_path, run_dir):
    # a newer checkpoint without COMPLETE is not one: the message names the complete one
    partial = run_dir / "checkpoints" / "step_000020"
    partial.mkdir()
    (partial / "meta.json").write_text(json.dumps({"model": _model(dim=256)}))
    cfg = _write(tmp_path, "model:\n  dim: 128\n  ffn_dim: 512\n")
    err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), "--resume")
    assert (f"cannot resume {run_dir}: its checkpoint {CKPT} has model.dim=64, model.ffn_dim=192, "
            "the config says model.dim=128, model.ffn_dim=512") in err
    assert "use the run's own config or a new --run-dir" in err


def test_laminar_resume_after_config_was_edited(tmp_path, run_dir):
    (run_dir / "config.yaml").write_text("model:\n  n_layers: 3\n")
    err = _refused(tmp_path, run_dir, "resume", str(run_dir))
    assert f"checkpoint {CKPT} has model.n_layers=2, the config says model.n_layers=3" in err


def test_resume_check_passes_same_model_and_fresh_dirs(tmp_path, run_dir):
    check_resume_model(run_dir, _model())  # the same model: no error
    check_resume_model(tmp_path / "fresh", _model(dim=32))  # nothing to resume from: no error
    # keys only one side knows (another schema version) are not compared
    check_resume_model(run_dir, {**_model(), "new_key": 1})
    with pytest.raises(RunDirError, match="model.n_heads=4, the config says model.n_heads=8"):
        check_resume_model(run_dir, _model(n_heads=8))
    # an unreadable newest meta.json falls back to the previous checkpoint, like the trainer
    newer = run_dir / "checkpoints" / "step_000030"
    newer.mkdir()
    (newer / "COMPLETE").write_text("ok\n")
    (newer / "meta.json").write_text("{cut sho")
    with pytest.raises(RunDirError, match=CKPT):
        check_resume_model(run_dir, _model(dim=32, n_heads=2, n_kv_heads=1))


_HOLDER = ("import sys\nfrom laminar_hpc.launch.prepare import CampaignLock\n"
           "with CampaignLock(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()\n")


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"]])
def test_run_dir_held_by_a_live_campaign(tmp_path, run_dir, flag):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = _write(tmp_path, "name: earlier\n", "ok.yaml")
        err = _refused(tmp_path, run_dir, "run", cfg, "--run-dir", str(run_dir), *flag)
        assert f"run directory {run_dir} is held by another live campaign (pid {holder.pid})" in err
        assert "stop it first or use another --run-dir" in err
    finally:
        holder.stdin.close()  # the holder exits, releasing the lock
        holder.wait(timeout=30)
