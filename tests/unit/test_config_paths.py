"""Paths in a config file are read from the file's directory (config/paths.py), overrides from the
working directory; one line says so where the working directory would have read other files."""
from __future__ import annotations

import os

import pytest

from laminar_hpc.config import ConfigError, load_config

from helpers import REPO


def _write(d, text: str):
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    (d / "score.py").write_text("def score(problem, response):\n    return 1.0\n")
    p = d / "config.yaml"
    p.write_text(text)
    return p


CONFIG = """task:
  type: dataset
  path: train.jsonl
  reward: score.py:score
model: {hf_tokenizer: HuggingFaceTB/SmolLM2-135M}
"""


def test_a_configs_paths_are_read_from_its_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "exp", CONFIG)
    notes: list[str] = []
    cfg = load_config(os.path.relpath(path), notes=notes)
    assert cfg.task.path == str(tmp_path / "exp" / "train.jsonl")
    assert cfg.task.reward.fn == f"{tmp_path / 'exp' / 'score.py'}:score"
    assert cfg.model.hf_tokenizer == "HuggingFaceTB/SmolLM2-135M"  # a Hub name, not a path beside it
    assert len(notes) == 1 and "task.path, task.reward" in notes[0] and "relative to its directory (exp)" in notes[0]


def test_no_line_where_the_config_sits_in_the_working_directory_and_overrides_stay_there(tmp_path, monkeypatch):
    path = _write(tmp_path, CONFIG)
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    (tmp_path / "other" / "mine.jsonl").write_text("{}\n")
    notes: list[str] = []
    cfg = load_config(path, ["task.path=mine.jsonl"], notes=notes)
    assert cfg.task.path == str(tmp_path / "other" / "mine.jsonl")  # typed here: read from here
    assert notes == [f"{path}: paths in a config are read relative to its directory ({tmp_path}), not the working "
                     "directory: task.path, task.reward"]
    monkeypatch.chdir(tmp_path)
    notes.clear()
    assert load_config("config.yaml", notes=notes).task.path == str(tmp_path / "train.jsonl") and notes == []


def test_maps_of_code_and_explicit_relative_model_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = CONFIG.replace("reward: score.py:score", "reward: {fn: {a: score.py:score, b: exact}, weights: {a: 1, b: 1}}")
    text = text.replace("HuggingFaceTB/SmolLM2-135M", "../tok")
    path = _write(tmp_path / "exp", text)
    cfg = load_config(path)
    assert cfg.task.reward.fn == {"a": f"{tmp_path / 'exp' / 'score.py'}:score", "b": "exact"}
    assert cfg.model.hf_tokenizer == str(tmp_path / "tok")


def test_the_examples_load_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("caesar", "verl-arith"):
        cfg = load_config(REPO / "examples" / name / "config.yaml")
        assert os.path.isfile(cfg.task.reward.fn.rsplit(":", 1)[0]), cfg.task.reward.fn


def test_a_missing_file_is_named_with_the_path_it_was_read_as(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "exp", CONFIG.replace("path: train.jsonl", "path: nothere.jsonl"))
    from laminar_hpc.cli import check_task
    with pytest.raises(ConfigError, match=str(tmp_path / "exp" / "nothere.jsonl")):
        check_task(load_config(path), str(path))
