"""Fuzzing config loading: whatever text, data or override a user feeds it, the loader returns a
Config or raises ConfigError with a one-line message, never another exception (which the CLI
would show as a traceback)."""
from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from laminar_hpc.config import Config, ConfigError, apply_override, config_from_dict
from laminar_hpc.config.load import parse_config_text
from laminar_hpc.config.schema import BuiltinTaskCfg, JsonlTaskCfg, SyntheticTaskCfg

FUZZ = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])


def _schema_names() -> tuple[list[str], list[str]]:
    """Section names, and every field name of every section (nested ones included)."""
    sections = sorted(Config.model_fields)
    fields: set[str] = set()
    todo: list[type[BaseModel]] = [BuiltinTaskCfg, JsonlTaskCfg, SyntheticTaskCfg]
    todo += [f.annotation for f in Config.model_fields.values()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]
    while todo:
        model = todo.pop()
        for name, f in model.model_fields.items():
            fields.add(name)
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                todo.append(f.annotation)
    return sections, sorted(fields)


SECTIONS, FIELDS = _schema_names()
# real names most of the time, so validation gets past "unknown key" into values and checks
KEYS = st.one_of(st.sampled_from(SECTIONS), st.sampled_from(FIELDS), st.sampled_from(FIELDS),
                 st.text(max_size=8))
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["jsonl", "builtin", "synthetic", "emulated", "torch", "skip", "reverse", "0", "-1", "1e-3"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(KEYS, inner, max_size=4)), max_leaves=12)
# a config-shaped mapping: sections holding fields, sometimes a bare value where a section belongs
CONFIGS = st.dictionaries(st.one_of(st.sampled_from(SECTIONS), KEYS),
                          st.one_of(st.dictionaries(KEYS, VALUES, max_size=6), VALUES), max_size=6)


def _load_or_config_error(text: str, overrides=None) -> None:
    try:
        cfg = parse_config_text(text, "fuzz.yaml", overrides)
    except ConfigError as err:
        msg = str(err)
        assert msg and len(msg.splitlines()) == 1, repr(msg)
        assert "fuzz.yaml" in msg or "command line" in msg, msg  # it names where the problem is
        return
    assert isinstance(cfg, Config)


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text(text):
    _load_or_config_error(text)


@FUZZ
@given(st.lists(st.sampled_from(["{", "}", "[", "]", ":", "- ", "\n", "  ", "\t", "&a ", "*a", "!!", "'", '"',
                                 "#", "trainer", "rho", "task", "type: jsonl", "1", "-1", "? ", ",", "|"]),
                max_size=40))
def test_yaml_looking_text(parts):
    _load_or_config_error("".join(parts))


@FUZZ
@given(CONFIGS)
def test_random_config_mappings(data):
    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except yaml.YAMLError:  # not representable (e.g. odd characters): not a loader input
        return
    _load_or_config_error(text)


@FUZZ
@given(CONFIGS)
def test_random_mappings_via_dict_api(data):
    try:
        assert isinstance(config_from_dict(data, "fuzz.yaml"), Config)
    except ConfigError as err:
        assert len(str(err).splitlines()) == 1


DOTTED = st.lists(st.one_of(st.sampled_from(SECTIONS), st.sampled_from(FIELDS), st.text(max_size=5)),
                  min_size=0, max_size=4).map(".".join)
OVERRIDES = st.one_of(
    st.text(max_size=40),  # anything at all, '=' or not
    st.tuples(DOTTED, st.one_of(st.text(max_size=20), SCALARS.map(lambda v: yaml.safe_dump(v).strip()),
                                st.sampled_from(["[1, 2", "{a: 1}", "!!python/object:os.system", "&x [*x]"])))
    .map(lambda kv: f"{kv[0]}={kv[1]}"),
)


@FUZZ
@given(st.lists(OVERRIDES, max_size=4))
def test_random_overrides(overrides):
    _load_or_config_error("name: fuzz\ntrainer:\n  lr: 0.001\n", overrides)


@FUZZ
@given(OVERRIDES, st.dictionaries(st.sampled_from(SECTIONS), st.one_of(st.none(), SCALARS,
                                                                      st.dictionaries(KEYS, SCALARS, max_size=3))))
def test_apply_override_alone(dotted, data):
    before = yaml.safe_dump(data)
    try:
        apply_override(data, dotted)
    except ConfigError as err:
        assert len(str(err).splitlines()) == 1
        assert yaml.safe_dump(data) == before  # a refused override changes nothing


# -- whatever text a user puts in a script's values, the script runs it as data -----------------
WORDS = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=16)


@settings(deadline=None, max_examples=60,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(partition=WORDS, account=WORDS, comment=WORDS, run_dir=WORDS)
def test_rendered_scripts_keep_every_value_literal(tmp_path, partition, account, comment, run_dir):
    from laminar_hpc.launch.submit import SubmitError, render_sbatch
    from test_render_sbatch import run_script, sbatch_options
    data = {"name": "fz", "slurm": {"partition": partition, "account": account,
                                    "additional_parameters": {"comment": comment}}}
    try:
        text = render_sbatch(config_from_dict(data, "fuzz.yaml"), "c.yaml", [], run_dir=run_dir)
    except (ConfigError, SubmitError) as err:
        assert len(str(err).splitlines()) == 1 and "control character" in str(err)
        return
    got = dict(words[0].split("=", 1) for words in sbatch_options(text) if len(words) == 1 and "=" in words[0])
    assert (got["--partition"], got["--account"], got["--comment"]) == (partition, account, comment)
    for old in tmp_path.iterdir():  # hypothesis reuses the directory across examples
        old.unlink()
    assert run_script(tmp_path, text)[-2:] == ["--run-dir", run_dir]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["argv", "fake-python", "job.sbatch"]  # nothing else ran
