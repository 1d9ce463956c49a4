"""Config values that validate field by field but break a run: control characters (they end up in
sbatch scripts and shell commands), sizes that round to no bytes, and combinations of fields that
cannot work. Each is refused in one line that names the key(s) and says what to do."""
from __future__ import annotations

import types
import typing

import pytest
from pydantic import BaseModel

from laminar_hpc.config import Config, ConfigError, config_from_dict
from laminar_hpc.config.schema import BuiltinTaskCfg, JsonlTaskCfg, SyntheticTaskCfg

TASKS = {BuiltinTaskCfg: "builtin", JsonlTaskCfg: "jsonl", SyntheticTaskCfg: "synthetic"}


def _err(data) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, "cfg.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cfg.yaml: "), msg
    return msg


def _is_text(annotation) -> bool:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return annotation is str or (union and str in typing.get_args(annotation))


def _text_fields(model: type[BaseModel] = Config, prefix: tuple[str, ...] = ()):
    """(dotted path, section class, task type or None) of every text field of the schema."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        if model is Config and name == "task":
            for cls, tag in TASKS.items():
                for path, sec, _ in _text_fields(cls, ("task",)):
                    yield path, sec, tag
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _text_fields(ann, (*prefix, name))
        elif _is_text(ann):
            yield ".".join((*prefix, name)), model, None


TEXT = [(p, t) for p, sec, t in _text_fields() if p.split(".")[-1] not in getattr(sec, "multiline", ())]


def _set(path: str, value, task: str | None) -> dict:
    data: dict = {"task": {"type": task, **({"path": "d.jsonl"} if task == "jsonl" else {})}} if task else {}
    node = data
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def test_every_text_field_is_checked():
    paths = {p for p, _ in TEXT}
    assert {"name", "slurm.partition", "slurm.account", "slurm.job_name", "slurm.python", "relay.shm_dir",
            "controller.host", "task.path", "model.hf_path"} <= paths
    assert "task.prompt_template" not in paths  # text for the model: line breaks belong there


@pytest.mark.parametrize("path,task", TEXT, ids=[p for p, _ in TEXT])
@pytest.mark.parametrize("char", ["\n", "\r", "\x00", "\x1b", "\x7f"], ids=["LF", "CR", "NUL", "ESC", "DEL"])
def test_a_control_character_in_any_text_field_is_refused(path, task, char):
    msg = _err(_set(path, f"debug{char}srun rm -rf ~", task))
    assert f"key '{path}'" in msg and f"U+{ord(char):04X}" in msg and "remove it" in msg


@pytest.mark.parametrize("params,shown", [
    ({"comment": "ok\n#SBATCH --wrap=evil"}, "entry 'comment'"),
    ({"comm\nent": "x"}, "entry 'comm\\nent'"),
])
def test_a_control_character_in_additional_parameters_is_refused(params, shown):
    msg = _err({"slurm": {"additional_parameters": params}})
    assert "key 'slurm.additional_parameters'" in msg and shown in msg and "U+000A" in msg


def test_a_prompt_template_keeps_its_line_breaks():
    cfg = config_from_dict({"task": {"type": "jsonl", "path": "d.jsonl", "prompt_template": "Q:\t{prompt}\nA: "}})
    assert cfg.task.prompt_template == "Q:\t{prompt}\nA: "


@pytest.mark.parametrize("key,hint", [("--comment", "without its '--'"), ("a b", "not an sbatch option"),
                                      ("x;y", "not an sbatch option")])
def test_additional_parameters_are_sbatch_option_names(key, hint):
    msg = _err({"slurm": {"additional_parameters": {key: "x"}}})
    assert "key 'slurm.additional_parameters'" in msg and hint in msg


def test_a_false_sbatch_flag_says_how_to_unset_it():
    msg = _err({"slurm": {"additional_parameters": {"requeue": False}}})
    assert "requeue" in msg and "no-requeue: true" in msg
    assert config_from_dict({"slurm": {"additional_parameters": {"exclusive": True, "nice": 5}}})


@pytest.mark.parametrize("section,key", [("controller", "max_frame_mb"), ("relay", "chunk_mb"),
                                         ("emulation", "weight_mb")])
def test_a_size_that_rounds_to_no_bytes_is_refused(section, key):
    msg = _err({section: {key: 1e-7}})  # int(1e-7 * 2**20) == 0
    assert f"key '{section}.{key}'" in msg and "1 KiB" in msg and "at least 0.001" in msg
    assert getattr(getattr(config_from_dict({section: {key: 0.001}}), section), key) == 0.001


def test_a_heartbeat_interval_not_well_below_the_timeout_is_refused():
    msg = _err({"supervisor": {"heartbeat_interval_s": 30.0}})  # the default timeouts.heartbeat_s is 30
    assert "supervisor.heartbeat_interval_s=30.0" in msg and "timeouts.heartbeat_s=30.0" in msg
    assert "lower the interval or raise the timeout" in msg
    assert "supervisor.heartbeat_interval_s" in _err({"timeouts": {"heartbeat_s": 1.5}})  # interval 1 s
    assert config_from_dict({"supervisor": {"heartbeat_interval_s": 15.0}})  # half of it: accepted


def test_a_signal_at_or_past_the_time_limit_is_refused():
    msg = _err({"slurm": {"time_min": 60, "signal_delay_s": 3600}})
    assert "slurm.signal_delay_s=3600" in msg and "slurm.time_min=60" in msg
    assert "lower signal_delay_s or raise time_min" in msg
    assert config_from_dict({"slurm": {"time_min": 60, "signal_delay_s": 3599}})
    assert "slurm.signal_delay_s" in _err({"slurm": {"time_min": 2000, "signal_delay_s": 70000}})  # sbatch: <= 65535


def test_emulated_lengths_with_min_above_max_are_refused():
    msg = _err({"emulation": {"lengths": {"min_tokens": 100, "max_tokens": 10}}})
    assert "key 'emulation.lengths'" in msg and "min_tokens=100" in msg and "max_tokens=10" in msg
