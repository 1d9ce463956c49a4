"""Bad input through the real command line: each case exits non-zero with ONE stderr line (no
traceback) that names the input and says what to do, and leaves an existing run directory
byte for byte as it was. Every case fails before a role starts, so no training runs here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml


from helpers import EARLIER_CKPT, REPO, bad_rows_dataset, laminar, model_fields


def _cli(cwd, *args: str) -> str:
    """Run `laminar ARGS` as a user would; return its one-line error (asserting the contract)."""
    res = laminar(*args, cwd=cwd, timeout=30)  # past 30 s it started a campaign instead of refusing
    err = res.stderr.strip()
    assert res.returncode != 0, (res.stdout, err)
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


def _write(tmp_path, text: str, name: str = "bad.yaml") -> str:
    """A config file with `text`; one that names no `task:` or `trainer:` gets them (the builtin task,
    the default trainer), so that the refusal under test is the one each test means, not that one."""
    try:
        data = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        data = None  # bad YAML: refused for it, as written
    if isinstance(data, dict):
        text += "".join(f"\n{k}: {v}" for k, v in (("task", "{type: builtin}"), ("trainer", "{}")) if k not in data)
        text += "\n"
    (tmp_path / name).write_text(text)
    return name


def _refused(tmp_path, run, *args: str) -> str:
    """`laminar ARGS` fails in one line and changes nothing in `run`."""
    before = _snapshot(run)
    err = _cli(tmp_path, *args)
    assert _snapshot(run) == before, "the refused command changed the run directory"
    return err


# -- config files ------------------------------------------------------------------------------

def test_malformed_yaml_names_line_and_column(tmp_path, earlier_run):
    cfg = _write(tmp_path, "name: x\ntrainer:\n  lr: a: b\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert f"{cfg}: line 3, column" in err and "malformed YAML" in err
    assert "quote" in err  # what to do


def test_tab_indent_says_use_spaces(tmp_path, earlier_run):
    cfg = _write(tmp_path, "trainer:\n\tlr: 1\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert "line 2" in err and "spaces, not tabs" in err


def test_unknown_key_suggests_the_close_one(tmp_path, earlier_run):
    cfg = _write(tmp_path, "trainer:\n  totl_steps: 5\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert err.startswith(f"laminar: error: {cfg}: unknown key 'trainer.totl_steps'")
    assert "did you mean 'trainer.total_steps'?" in err and "allowed:" in err


def test_key_of_another_section_says_where_it_lives(tmp_path):
    cfg = _write(tmp_path, "trainer:\n  max_new_tokens: 5\n")
    err = _cli(tmp_path, "run", cfg, "--run-dir", "never")
    assert "did you mean 'rollout.max_new_tokens'?" in err
    assert not (tmp_path / "never").exists()


def test_mistyped_value_names_key_value_and_default(tmp_path, earlier_run):
    cfg = _write(tmp_path, "trainer:\n  total_steps: abc\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert f"{cfg}: key 'trainer.total_steps'" in err and "'abc'" in err and "integer" in err
    assert "the default is 300" in err


@pytest.mark.parametrize("section,key,value", [
    ("rollout", "count", -1), ("relay", "chunk_mb", -1), ("trainer", "rho", 0), ("trainer", "rho", -1),
])
def test_out_of_range_names_key_and_bound(tmp_path, earlier_run, section, key, value):
    cfg = _write(tmp_path, f"{section}:\n  {key}: {value}\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert f"{cfg}: key '{section}.{key}'" in err and "greater than 0" in err and f"got {value}" in err
    assert "the default is" in err


@pytest.mark.parametrize("text,expect", [
    ("controller:\n  max_frame_mb: 0.0000001\n", "key 'controller.max_frame_mb': 1e-07 MB is below 1 KiB"),
    ("relay:\n  chunk_mb: 0.0000001\n", "key 'relay.chunk_mb': 1e-07 MB is below 1 KiB"),
    ("supervisor:\n  heartbeat_interval_s: 40\n",
     "supervisor.heartbeat_interval_s=40.0 must be at most half of timeouts.heartbeat_s=30.0"),
    ("slurm:\n  time_min: 1\n  signal_delay_s: 90\n", "slurm.signal_delay_s=90 must be below slurm.time_min=1"),
    ('slurm:\n  partition: "debug\\nsrun rm -rf ~"\n', "key 'slurm.partition': holds a control character (U+000A)"),
])
def test_values_that_would_break_at_run_time_are_refused_up_front(tmp_path, earlier_run, text, expect):
    cfg = _write(tmp_path, text)
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert f"{cfg}: " in err and expect in err


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
def test_override_errors_are_one_line(tmp_path, earlier_run, args, expect):
    cfg = _write(tmp_path, "name: ok\n", "ok.yaml")
    args = [str(earlier_run) if a == "RUN" else a for a in args]
    err = _refused(tmp_path, earlier_run, "run", cfg, *args, "--run-dir", str(earlier_run), "--resume")
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

def test_missing_dataset_names_path_and_key(tmp_path, earlier_run):
    cfg = _write(tmp_path, "task:\n  type: jsonl\n  path: data/absent.jsonl\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert "task.path: " in err and "data/absent.jsonl not found" in err and "set task.path" in err and cfg in err


def test_a_missing_dataset_is_found_before_the_model(tmp_path):
    # issue 46: a data file that did not exist was found only after the model's conversion (minutes)
    cfg = _write(tmp_path, "task:\n  type: jsonl\n  path: data/absent.jsonl\nmodel: {hf_path: nowhere/model.gguf}\n")
    err = _cli(tmp_path, "run", cfg, "--run-dir", str(tmp_path / "r"))
    assert "task.path: " in err and "data/absent.jsonl not found" in err and "model.hf_path" not in err, err


def test_bad_row_fail_names_file_line_and_field(tmp_path, earlier_run):
    data = bad_rows_dataset(tmp_path)
    cfg = _write(tmp_path, f"task:\n  type: jsonl\n  path: {data}\n  on_bad_row: fail\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert f"{data} line 2" in err and "'answer'" in err and "on_bad_row: skip" in err


def test_unusable_prompt_template(tmp_path):
    data = bad_rows_dataset(tmp_path)
    cfg = _write(tmp_path, f"task:\n  type: jsonl\n  path: {data}\n  on_bad_row: skip\n"
                           "  prompt_template: 'Q: {question}'\n")
    err = _cli(tmp_path, "run", cfg, "--run-dir", "never")
    assert "task.prompt_template" in err and "{prompt}" in err
    assert not (tmp_path / "never").exists()


def _plain_rows(tmp_path, name: str = "rows.jsonl", n: int = 3) -> str:
    (tmp_path / name).write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n"
                                         for i in range(n)))
    return name


def test_a_file_that_is_not_parquet(tmp_path, earlier_run):
    (tmp_path / "rows.parquet").write_text('{"question": "q", "answer": "1"}\n')
    cfg = _write(tmp_path, "task:\n  type: dataset\n  path: rows.parquet\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert "rows.parquet: not a Parquet file" in err


@pytest.mark.parametrize("code,spec,says", [
    (None, "absent.py:score", "not found"),
    ("import not_a_module_anywhere\n", "r.py:score", "not_a_module_anywhere"),
    ("score = 3\n", "r.py:score", "not a function"),
    ("def other(problem, response):\n    return 1.0\n", "r.py:score", "score"),
    ("def score(problem, response):\n    return 'yes'\n", "r.py:score", "str"),
])
def test_a_reward_that_cannot_be_used_is_refused_before_the_run(tmp_path, earlier_run, code, spec, says):
    if code is not None:
        (tmp_path / "r.py").write_text(code)
    data = _plain_rows(tmp_path)
    cfg = _write(tmp_path, f"task:\n  type: dataset\n  path: {data}\n  answer_format: plain\n  reward: {spec}\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert "task.reward" in err and spec.split(":")[0] in err and says in err, err


def test_a_validation_file_that_overlaps_training_is_a_warning_with_the_count(tmp_path):
    train, val = _plain_rows(tmp_path, "train.jsonl", 5), _plain_rows(tmp_path, "val.jsonl", 2)
    cfg = _write(tmp_path, f"task:\n  type: dataset\n  path: {train}\n  validation_path: {val}\n"
                           "  answer_format: plain\n")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("not a run")  # then refused: nothing runs
    res = laminar("run", cfg, "--run-dir", "taken", cwd=tmp_path, timeout=60)
    assert res.returncode != 0 and "taken" in res.stderr
    # (the config's relative paths are read from its directory, here the working one: named in full)
    assert f"laminar: warning: 2 training rows of {tmp_path / 'train.jsonl'} also appear in the validation split" \
        in res.stderr, res.stderr


# -- run directories --------------------------------------------------------------------------

def test_resume_with_a_different_model_shape(tmp_path, earlier_run):
    # a newer checkpoint without COMPLETE is not one: the message names the complete one
    partial = earlier_run / "checkpoints" / "step_000020"
    partial.mkdir()
    (partial / "meta.json").write_text(json.dumps({"model": model_fields(dim=256)}))
    cfg = _write(tmp_path, "model:\n  dim: 128\n  ffn_dim: 512\n")
    err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), "--resume")
    assert (f"cannot resume {earlier_run}: its checkpoint {EARLIER_CKPT} has model.dim=64, model.ffn_dim=192, "
            "the config says model.dim=128, model.ffn_dim=512") in err
    assert "use the run's own config or a new --run-dir" in err


def test_laminar_resume_after_config_was_edited(tmp_path, earlier_run):
    (earlier_run / "config.yaml").write_text("model:\n  n_layers: 3\ntask: {type: builtin}\ntrainer: {}\n")
    err = _refused(tmp_path, earlier_run, "resume", str(earlier_run))
    assert f"checkpoint {EARLIER_CKPT} has model.n_layers=2, the config says model.n_layers=3" in err


_HOLDER = ("import sys\nfrom laminar_hpc.launch.prepare import CampaignLock\n"
           "with CampaignLock(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()\n")


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"]])
def test_run_dir_held_by_a_live_campaign(tmp_path, earlier_run, flag):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(earlier_run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = _write(tmp_path, "name: earlier\n", "ok.yaml")
        err = _refused(tmp_path, earlier_run, "run", cfg, "--run-dir", str(earlier_run), *flag)
        assert f"run directory {earlier_run} is held by another live campaign (pid {holder.pid})" in err
        assert "stop it first or use another --run-dir" in err
    finally:
        holder.stdin.close()  # the holder exits, releasing the lock
        holder.wait(timeout=30)
