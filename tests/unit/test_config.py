"""Config loading, validation, one-line errors, dotted overrides and round trips."""
from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import yaml

from laminar_hpc.config import Config, ConfigError, apply_override, config_from_dict, load_config, save_config
from laminar_hpc.config.schema import BuiltinTaskCfg, JsonlTaskCfg, TrainerCfg
from laminar_hpc.config.paths import resolve_paths

from helpers import REPO

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)
                 + glob.glob(os.path.join(REPO, "configs", "**", "*.yml"), recursive=True))


def _err(data, source="cfg.yaml") -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, source)
    msg = str(err.value)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    assert msg.startswith(source), msg
    return msg


def _write(tmp_path, text: str, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------------------------------
# shipped configs
# ------------------------------------------------------------------------------------------

def test_configs_directory_is_not_empty():
    assert CONFIGS, "no YAML files under configs/"


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.relpath(p, REPO) for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    raw = yaml.safe_load(open(path))
    resolve_paths(raw, Path(path).parent)  # (its paths are read from its directory: config/paths.py)
    # what the file says is what the Config holds (spot-check every scalar it sets)
    def assert_subset(written, held, where):
        if isinstance(written, dict):
            for key, value in written.items():
                assert_subset(value, held[key], f"{where}.{key}")
        elif isinstance(held, dict) and "fn" in held:  # task.reward: "x.py:f" is short for {fn: "x.py:f"}
            assert held["fn"] == written, where
        else:
            assert held == written, where

    dumped = cfg.model_dump()
    for section, body in raw.items():
        assert_subset(body, dumped[section], section)


def test_defaults_are_valid():
    cfg = config_from_dict({})
    assert cfg == Config()
    assert cfg.task.type == "builtin"
    assert config_from_dict(None) == Config()


# ------------------------------------------------------------------------------------------
# unknown keys
# ------------------------------------------------------------------------------------------

def _allowed_listed(msg: str, allowed) -> None:
    assert "allowed" in msg, msg
    tail = msg.split("allowed", 1)[1]
    for key in allowed:
        assert key in tail, (key, msg)


def test_unknown_top_level_key():
    msg = _err({"trainr": {"lr": 1.0}})
    assert "'trainr'" in msg
    _allowed_listed(msg, Config.model_fields)


def test_unknown_nested_key():
    msg = _err({"trainer": {"lrr": 1e-3}})
    assert "'trainer.lrr'" in msg
    _allowed_listed(msg, TrainerCfg.model_fields)
    assert "kinds" not in msg  # the allowed keys are the trainer's, not another section's


def test_unknown_key_in_builtin_task():
    msg = _err({"task": {"type": "builtin", "kinds": ["add"], "lenght": 4}})
    assert "'task.lenght'" in msg
    assert "builtin" not in msg.split("'")[1]  # the union tag is not part of the key
    _allowed_listed(msg, BuiltinTaskCfg.model_fields)
    assert "prompt_field" not in msg


def test_unknown_key_in_jsonl_task():
    msg = _err({"task": {"type": "jsonl", "path": "d.jsonl", "answer_feild": "a"}})
    assert "'task.answer_feild'" in msg
    _allowed_listed(msg, JsonlTaskCfg.model_fields)
    assert "tail_alpha" not in msg


def test_unknown_key_in_file_names_file(tmp_path):
    p = _write(tmp_path, "trainer:\n  lr: 0.001\n  bogus: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg and "'trainer.bogus'" in msg and "\n" not in msg
    _allowed_listed(msg, TrainerCfg.model_fields)


# ------------------------------------------------------------------------------------------
# out-of-range and wrong-type values
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data,key", [
    ({"trainer": {"groups_per_step": -1}}, "trainer.groups_per_step"),
    ({"trainer": {"group_size": 0}}, "trainer.group_size"),
    ({"trainer": {"group_size": 1}}, "trainer.group_size"),
    ({"rollout": {"max_batch": -4}}, "rollout.max_batch"),
    ({"model": {"dim": -64}}, "model.dim"),
    ({"warmup": {"batch_size": 0}}, "warmup.batch_size"),
    ({"trainer": {"rho": 0}}, "trainer.rho"),
    ({"trainer": {"rho": -1.5}}, "trainer.rho"),
    ({"relay": {"slots": 1}}, "relay.slots"),
    ({"rollout": {"top_p": 0}}, "rollout.top_p"),
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
    ({"warmup": {"label_noise": 1.1}}, "warmup.label_noise"),
    ({"seed": -1}, "seed"),
    ({"relay": {"chunk_mb": 0}}, "relay.chunk_mb"),
    ({"task": {"type": "builtin", "min_len": 0}}, "task.min_len"),
])
def test_out_of_range_names_the_key(data, key):
    msg = _err(data)
    assert f"'{key}'" in msg, msg


@pytest.mark.parametrize("data,key", [
    ({"trainer": {"lr": "fast"}}, "trainer.lr"),
    ({"trainer": {"total_steps": "many"}}, "trainer.total_steps"),
    ({"rollout": {"verify_checksum": "perhaps"}}, "rollout.verify_checksum"),
    ({"task": {"type": "builtin", "kinds": "reverse"}}, "task.kinds"),
    ({"task": {"type": "builtin", "kinds": ["reverse", "divide"]}}, "task.kinds"),
    ({"task": {"type": "jsonl", "path": "x", "reward": "vibes"}}, "task.reward"),
    ({"trainer": {"publish_dtype": "float8"}}, "trainer.publish_dtype"),
])
def test_wrong_type_names_the_key(data, key):
    msg = _err(data)
    assert f"'{key}" in msg, msg  # the key, possibly followed by a list index


def test_wrong_type_section_not_a_mapping():
    msg = _err({"trainer": 5})
    assert "'trainer'" in msg


def test_model_dim_not_divisible_by_heads():
    msg = _err({"model": {"dim": 66, "n_heads": 4, "n_kv_heads": 2}})
    assert "model" in msg and "dim" in msg and "n_heads" in msg
    msg = _err({"model": {"dim": 64, "n_heads": 4, "n_kv_heads": 3}})
    assert "n_kv_heads" in msg
    # a consistent shape is accepted
    cfg = config_from_dict({"model": {"dim": 96, "n_heads": 6, "n_kv_heads": 3}})
    assert cfg.model.dim == 96


def test_task_max_len_below_min_len():
    msg = _err({"task": {"type": "builtin", "min_len": 5, "max_len": 3}})
    assert "max_len" in msg and "min_len" in msg


def test_jsonl_task_without_path_is_required():
    msg = _err({"task": {"type": "jsonl"}})
    assert "'task.path'" in msg and "required" in msg


def test_several_errors_still_one_line():
    msg = _err({"trainer": {"lr": -1, "rho": -1, "total_steps": 0}})
    assert "more error" in msg


# ------------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------------

def test_malformed_yaml_names_file_and_line(tmp_path):
    p = _write(tmp_path, "name: x\nseed: 1\ntrainer:\n  lr: a: b\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg and "line 4" in msg and "\n" not in msg, msg


def test_malformed_yaml_tab_indent_line(tmp_path):
    p = _write(tmp_path, "name: x\ntrainer:\n\tlr: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg and "line 3" in msg, msg


def test_missing_file_names_it(tmp_path):
    p = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert str(p) in str(err.value)


@pytest.mark.parametrize("text", ["- trainer\n- rollout\n", "just a string\n", "42\n"])
def test_top_level_not_a_mapping(tmp_path, text):
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert str(p) in str(err.value)


def test_top_level_list_via_dict_api():
    msg = _err([{"trainer": {}}])
    assert "mapping" in msg


@pytest.mark.parametrize("text", ["", "\n# only a comment\n", "---\n"])
def test_an_empty_file_is_refused_with_one_line(tmp_path, text):
    """Round 3, finding 7: an empty file (a wrong path, a truncated copy) started a campaign of defaults."""
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError, match="the config is empty") as err:
        load_config(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value)
    assert config_from_dict({}) == Config()  # (the defaults themselves are still a config)


# ------------------------------------------------------------------------------------------
# dotted overrides
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("7", 7),
    ("-3", -3),
    ("0.5", 0.5),
    ("true", True),
    ("false", False),
    ("null", None),
    ("[a, b]", ["a", "b"]),
    ("[1, 2.5]", [1, 2.5]),
    ("hello", "hello"),
    ("", ""),
    ("a=b", "a=b"),  # only the first '=' separates key and value
])
def test_override_value_parsing(text, value):
    data: dict = {}
    apply_override(data, f"sec.key={text}")
    assert data == {"sec": {"key": value}}
    assert type(data["sec"]["key"]) is type(value)


def test_override_creates_nested_keys_and_keeps_siblings():
    data = {"trainer": {"lr": 0.1}}
    apply_override(data, "a.b.c=1")
    apply_override(data, "trainer.rho=3")
    assert data == {"trainer": {"lr": 0.1, "rho": 3}, "a": {"b": {"c": 1}}}


def test_override_through_null_section_creates_it():
    data = {"controller": None}
    apply_override(data, "controller.max_ahead_steps=5")
    assert data == {"controller": {"max_ahead_steps": 5}}


def test_overrides_reach_typed_config(tmp_path):
    p = _write(tmp_path, "name: base\ntrainer:\n  lr: 0.01\n")
    cfg = load_config(p, [
        "trainer.lr=3e-4", "trainer.rho=1e1", "trainer.total_steps=12", "rollout.verify_checksum=true",
        "trainer.max_staleness=null", "trainer.clip_eps=0.2", "controller.max_ahead_steps=5",
        "task.type=builtin", "task.kinds=[reverse, add]", "task.weights=[1, 2.5]", "name=other",
    ])
    assert isinstance(cfg.trainer.lr, float) and cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.trainer.rho == pytest.approx(10.0)
    assert cfg.trainer.total_steps == 12 and isinstance(cfg.trainer.total_steps, int)
    assert cfg.rollout.verify_checksum is True
    assert cfg.trainer.max_staleness is None
    assert cfg.trainer.clip_eps == pytest.approx(0.2)
    assert cfg.controller.max_ahead_steps == 5  # section absent from the file: created
    assert cfg.task.kinds == ["reverse", "add"] and cfg.task.weights == [1.0, 2.5]
    assert cfg.name == "other"
    # the later override wins
    cfg = load_config(p, ["trainer.lr=0.5", "trainer.lr=0.25"])
    assert cfg.trainer.lr == 0.25


def test_override_unknown_key_errors_like_file_key(tmp_path):
    p = _write(tmp_path, "trainer:\n  lr: 0.01\n")
    with pytest.raises(ConfigError) as from_override:
        load_config(p, ["trainer.lrr=0.1"])
    q = _write(tmp_path, "trainer:\n  lr: 0.01\n  lrr: 0.1\n", "q.yaml")
    with pytest.raises(ConfigError) as from_file:
        load_config(q)
    a, b = str(from_override.value), str(from_file.value)
    assert "'trainer.lrr'" in a and "\n" not in a
    _allowed_listed(a, TrainerCfg.model_fields)
    assert a.split(":", 1)[1] == b.split(":", 1)[1]  # same message apart from the source


def test_override_out_of_range_names_key(tmp_path):
    p = _write(tmp_path, "name: x\n")
    with pytest.raises(ConfigError, match=r"'relay\.slots'"):
        load_config(p, ["relay.slots=1"])


@pytest.mark.parametrize("bad", ["trainer.lr", "trainer.lr 3", ""])
def test_override_without_equals_errors(tmp_path, bad):
    with pytest.raises(ConfigError) as err:
        apply_override({}, bad)
    assert "=" in str(err.value)
    p = _write(tmp_path, "name: x\n")
    with pytest.raises(ConfigError, match="="):
        load_config(p, [bad])


@pytest.mark.parametrize("bad", ["trainer..lr=1", ".lr=1", "trainer.=1", "=1"])
def test_override_empty_key_part_errors(bad):
    with pytest.raises(ConfigError):
        apply_override({}, bad)


def test_override_into_a_scalar_errors():
    data = {"seed": 3}
    with pytest.raises(ConfigError) as err:
        apply_override(data, "seed.x=1")
    assert "seed" in str(err.value)
    assert data == {"seed": 3}


# ------------------------------------------------------------------------------------------
# round trip
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    {},
    {"name": "rt", "seed": 7, "trainer": {"lr": 3e-4, "clip_eps": 0.2, "max_staleness": 3, "rho": 1.5},
     "model": {"dim": 96, "n_heads": 6, "n_kv_heads": 3, "norm_eps": 1e-6, "tie_embeddings": False},
     "task": {"type": "builtin", "kinds": ["add", "repeat"], "weights": [0.25, 0.75], "tail_alpha": 0.0},
     "relay": {"shm_dir": "/tmp/x y", "chunk_mb": 0.5}},
    {"task": {"type": "jsonl", "path": "/data/gsm8k/train.jsonl", "prompt_template": "Q: {prompt}\n#: ",
              "reward": "exact", "on_bad_row": "skip"},
     "trainer": {"init_checkpoint": "/runs/a/checkpoints/step_000010"}},
])
def test_save_then_load_round_trip(tmp_path, data):
    cfg = config_from_dict(data)
    path = tmp_path / "sub" / "config.yaml"
    save_config(cfg, path)
    back = load_config(path)
    assert back == cfg
    assert back.model_dump() == cfg.model_dump()
    assert type(back.task) is type(cfg.task)
    # saving is atomic: only the file itself, no temp files
    assert os.listdir(path.parent) == ["config.yaml"]


def test_round_trip_of_shipped_configs(tmp_path):
    for i, src in enumerate(CONFIGS):
        cfg = load_config(src, ["trainer.lr=3e-4"])
        out = tmp_path / f"{i}.yaml"
        save_config(cfg, out)
        assert load_config(out) == cfg


def test_the_reward_range_can_be_set_on_the_command_line_when_the_reward_is_a_function_name(tmp_path):
    """Issue 36: `task.reward: x.py:fn` is short for {fn: x.py:fn}; an override below it expands it."""
    p = _write(tmp_path, "task: {type: builtin, reward: len_reward.py:reward_len}\n")
    cfg = load_config(p, ["task.reward.range=[-50, 50]"])
    assert cfg.task.reward.fn == f"{tmp_path / 'len_reward.py'}:reward_len" and cfg.task.reward.range == (-50.0, 50.0)


@pytest.mark.parametrize("text, missing", [("{}", "no 'task:' and no 'trainer:' section"),
                                           ("rollout: {count: 2}\n", "no 'task:' and no 'trainer:' section"),
                                           ("task: {type: builtin}\n", "no 'trainer:' section")])
def test_a_config_without_a_task_or_a_trainer_is_refused(tmp_path, text, missing):
    """Issue 45: `{}` started a default campaign (the built-in tasks, the default trainer)."""
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(p, require_sections=True)  # as `laminar run` loads it
    assert str(p) in str(err.value) and missing in str(err.value) and "\n" not in str(err.value)
    assert load_config(p, ["task.type=builtin", "trainer.lr=0.01"], require_sections=True).trainer.lr == 0.01
