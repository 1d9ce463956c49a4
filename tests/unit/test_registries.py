"""One list per swappable part (issue 37 item 3): rollout engines and trainer backends in
config/backend_specs.py, off-policy corrections in config/correction_specs.py, modes in policy/modes,
partial rollout's update paths in config/update_paths.py, dataset layouts in config/layout_specs.py,
reward signatures and built-in rewards in config/reward_specs.py, built-in tools and tool-call formats
in config/env.py, experiment trackers in config/tracking.py. Everything else derives from those
lists: the values the schema accepts, the code each entry names (a lazy-import path), the config
reference (docs/config.md) and the architecture doc's "Where a new part goes".
`registry_problems` is that consistency check; the last tests add an entry to one list only and
see it named in what the check reports."""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from helpers import REPO
from pydantic import BaseModel, ValidationError

from laminar_hpc.config.backend_specs import (
    ROLLOUT_BACKENDS, TRAINER_BACKENDS, RolloutBackendSpec, TrainerBackendSpec, resolve,
)
from laminar_hpc.config.correction_specs import CORRECTION_SPECS, CorrectionSpec
from laminar_hpc.config.env import EnvCfg
from laminar_hpc.config.tool_specs import BUILTIN_TOOLS, ToolSpec
from laminar_hpc.config.layout_specs import LAYOUT_SPECS, LayoutSpec
from laminar_hpc.config.reward_specs import BUILTIN_REWARDS, REWARD_SIGNATURES, BuiltinReward
from laminar_hpc.config.schema import Config, DatasetTaskCfg, RewardCfg
from laminar_hpc.config.task import TASK_TYPES, TaskType
from laminar_hpc.config.tracker_specs import TRACKERS, TrackerSpec
from laminar_hpc.config.tracking import LoggingCfg
# the trainer's table is built from CORRECTION_SPECS when first imported: import it before any
# test here edits that list (else it would hold the edit in every later test of the process)
from laminar_hpc.trainer.corrections import CORRECTIONS

CONFIG_DOC = REPO / "docs" / "config.md"
ARCHITECTURE_DOC = REPO / "docs" / "architecture.md"
NEW_PART_HEADING = "**Where a new part goes.**"
LOGGING_SETTINGS = ("run_name", "send", "names")  # the fields of `logging:` that are no tracker


def config_doc_row(key: str) -> str:
    rows = [line for line in CONFIG_DOC.read_text().splitlines() if line.startswith(f"| `{key}` |")]
    return rows[0] if rows else ""


def quoted(key: str, name: str) -> bool:
    """docs/config.md lists `name` in the key's Literal type: 'name'."""
    return f"'{name}'" in config_doc_row(key)


def as_word(key: str, name: str) -> bool:
    """docs/config.md names `name` in the key's meaning (a description derived from the list)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", config_doc_row(key)) is not None


def own_row(key: str, name: str) -> bool:
    """docs/config.md has a row for `key.name` (a tracker's own field)."""
    return bool(config_doc_row(f"{key}.{name}"))


def no_code(spec: Any) -> None:
    return None


def refused_names(make: Callable[[], Any], pattern: str) -> tuple[str, ...]:
    """The names a validator's refusal of a bad value lists (for keys whose type is text, not a
    Literal of the names): `pattern`'s group, split at ', ' and ' or '."""
    try:
        make()
    except ValidationError as e:
        found = re.search(pattern, str(e))
        assert found, f"the refusal does not list the built-ins ({pattern!r}): {e}"
        return tuple(re.split(r", | or ", found.group(1)))
    raise AssertionError("a bad value was accepted")


@dataclass(frozen=True)
class Kind:
    """One kind of swappable part: the config key that picks an entry, and its one list."""
    key: str  # the config key whose values are the entries' names
    module: str  # the module that holds the list
    table: str  # the list's name in it
    code: Callable[[Any], str | None] = no_code  # an entry's code, as a lazy-import path "module:name" (None: none)
    # the names the schema accepts, where its field is no Literal of them (None: the field's Literal)
    values: Callable[[], tuple[str, ...]] | None = None
    extra: tuple[str, ...] = ()  # values the key's Literal holds that name no entry ("auto")
    documented: Callable[[str, str], bool] = quoted  # (key, name): docs/config.md lists the entry

    @property
    def registry(self) -> dict:
        return getattr(importlib.import_module(self.module), self.table)

    @property
    def file(self) -> str:
        """The list's file as docs/architecture.md names it (relative to laminar_hpc/)."""
        return self.module.removeprefix("laminar_hpc.").replace(".", "/") + ".py"

    def allowed(self) -> tuple[str, ...]:
        """The values the schema accepts for the key that name an entry (its field's Literal, less
        `extra`, or `values`)."""
        if self.values is not None:
            return self.values()
        literal = typing.get_args(schema_field(self.key).annotation)
        assert all(word in literal for word in self.extra), (self.key, literal)
        return tuple(name for name in literal if name not in self.extra)


def sections(annotation: Any) -> list[type[BaseModel]]:
    """The config sections an annotation holds (a union of task types, an optional section)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in sections(arg)]


def schema_field(key: str):
    """The schema's field of a dotted key (through unions: the first variant that has it)."""
    found: list[type[BaseModel]] = [Config]
    *path, leaf = key.split(".")
    for part in path:
        found = [m for s in found if part in s.model_fields for m in sections(s.model_fields[part].annotation)]
    fields = [s.model_fields[leaf] for s in found if leaf in s.model_fields]
    assert fields, f"the schema has no key {key}"
    return fields[0]


def task_types() -> tuple[str, ...]:
    """The task types the schema accepts: the `type` values of the sections in its `task:` union."""
    return tuple(name for section in sections(Config.model_fields["task"].annotation)
                 for name in typing.get_args(section.model_fields["type"].annotation))


KINDS = [
    Kind("rollout.backend", "laminar_hpc.config.backend_specs", "ROLLOUT_BACKENDS", lambda spec: spec.builder),
    Kind("trainer.backend", "laminar_hpc.config.backend_specs", "TRAINER_BACKENDS", lambda spec: spec.builder),
    Kind("trainer.correction", "laminar_hpc.config.correction_specs", "CORRECTION_SPECS", lambda spec: spec.path),
    Kind("mode", "laminar_hpc.policy.modes.registry", "MODES"),
    Kind("partial_rollout.update_path", "laminar_hpc.config.update_paths", "UPDATE_PATHS"),
    Kind("task.layout", "laminar_hpc.config.layout_specs", "LAYOUT_SPECS"),
    Kind("task.reward.signature", "laminar_hpc.config.reward_specs", "REWARD_SIGNATURES", lambda spec: spec.adapter,
         extra=("auto",)),
    Kind("task.reward.fn", "laminar_hpc.config.reward_specs", "BUILTIN_REWARDS", lambda spec: spec.path,
         values=lambda: refused_names(lambda: RewardCfg(fn="no-such-reward"), r"or one of ([\w-]+(?:, [\w-]+)*)"),
         documented=as_word),
    Kind("env.tools", "laminar_hpc.config.tool_specs", "BUILTIN_TOOLS", lambda spec: spec.builder,
         values=lambda: refused_names(lambda: EnvCfg(tools={"t": "no-such-tool"}),
                                      r"a built-in tool \(([\w-]+(?:, [\w-]+)*)\)"),
         documented=as_word),
    Kind("env.format", "laminar_hpc.config.tool_specs", "TOOL_CALL_FORMATS", lambda spec: spec.cls,
         values=lambda: refused_names(lambda: EnvCfg(format="no-such-format"),
                                      r"write ([\w-]+(?: or [\w-]+)*), or 'package"),
         documented=as_word),
    Kind("task.type", "laminar_hpc.config.task", "TASK_TYPES", lambda spec: spec.source, values=task_types),
    Kind("logging", "laminar_hpc.config.tracker_specs", "TRACKERS", lambda spec: spec.sink,
         values=lambda: tuple(f for f in LoggingCfg.model_fields if f not in LOGGING_SETTINGS), documented=own_row),
]
WITH_CODE = [kind for kind in KINDS if kind.code is not no_code]


def new_part_section() -> str:
    """docs/architecture.md's paragraph "Where a new part goes" and its table (up to the next heading)."""
    text = ARCHITECTURE_DOC.read_text()
    assert NEW_PART_HEADING in text, f"docs/architecture.md has no {NEW_PART_HEADING!r}"
    return text.split(NEW_PART_HEADING, 1)[1].split("\n#", 1)[0]


def code_problem(path: str) -> str | None:
    """Why a lazy-import path names no callable (None: it does)."""
    try:
        obj = resolve(path)
    except (ImportError, AttributeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None if callable(obj) else "not callable"


def registry_problems() -> list[str]:
    """Every way the lists and what derives from them disagree, each naming the entry: a name the
    schema does not accept (or one it accepts with no entry), an entry under another name, code
    that does not resolve, a value docs/config.md does not list, a list the architecture doc does
    not name, a correction without its function in the trainer's table, a tracker whose sink bears
    another name, a layout default that is no key of the dataset section."""
    problems = []
    new_part = new_part_section()
    for kind in KINDS:
        registry, allowed = kind.registry, kind.allowed()
        where = f"{kind.file}: {kind.table}"
        problems += [f"{kind.key} {name!r}: in {where} but the schema does not accept it"
                     for name in registry if name not in allowed]
        problems += [f"{kind.key} {name!r}: the schema accepts it but {where} has no entry"
                     for name in allowed if name not in registry]
        problems += [f"{kind.key} {word!r}: in {where}, but the schema's {word!r} is no entry"
                     for word in kind.extra if word in registry]
        for name, spec in registry.items():
            if spec.name != name:
                problems.append(f"{kind.key} {name!r}: its entry in {where} is named {spec.name!r}")
            code = kind.code(spec)
            why = code_problem(code) if code is not None else None
            if why:
                problems.append(f"{kind.key} {name!r}: its code {code!r} does not resolve ({why})")
            if not kind.documented(kind.key, name):
                problems.append(f"{kind.key} {name!r}: docs/config.md does not list it (regenerate it: "
                                "laminar_hpc.config.reference.markdown)")
        if where not in new_part:
            problems.append(f"{kind.key}: docs/architecture.md's 'Where a new part goes' does not name {where}")
    for name, spec in TRACKERS.items():  # a sink names itself (its package's errors say which to turn off)
        sink = None if code_problem(spec.sink) else resolve(spec.sink)
        if sink is not None and getattr(sink, "name", None) != name:
            problems.append(f"logging {name!r}: its sink {spec.sink!r} is named {getattr(sink, 'name', None)!r}")
    problems += [f"task.type {name!r}: its section {spec.section.__name__} does not accept type {name!r}"
                 for name, spec in TASK_TYPES.items()
                 if name not in typing.get_args(spec.section.model_fields["type"].annotation)]
    problems += [f"task.layout {name!r}: its default {key!r} is no key of the task: section (DatasetTaskCfg)"
                 for name, spec in LAYOUT_SPECS.items() for key in spec.defaults
                 if key not in DatasetTaskCfg.model_fields]
    problems += [f"trainer.correction {name!r}: trainer/corrections.py's CORRECTIONS does not have it"
                 for name in CORRECTION_SPECS if name not in CORRECTIONS]
    problems += [f"trainer.correction {name!r}: in trainer/corrections.py's CORRECTIONS but not in "
                 "config/correction_specs.py: CORRECTION_SPECS" for name in CORRECTIONS if name not in CORRECTION_SPECS]
    return problems


# -- (a)-(d): the lists and everything derived from them agree ----------------------------------------


def test_the_lists_and_what_derives_from_them_agree():
    assert registry_problems() == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.key)
def test_the_schema_accepts_exactly_the_registrys_names(kind):
    assert list(kind.allowed()) == list(kind.registry)  # same order: error messages and docs list them so


@pytest.mark.parametrize("kind", WITH_CODE, ids=lambda k: k.key)
def test_every_entrys_code_resolves_to_a_function(kind):
    for name, spec in kind.registry.items():
        code = kind.code(spec)
        assert code is None or callable(resolve(code)), name


def modules_imported_by(code: str) -> str:
    """What a fresh interpreter running `code` prints (its imports are its own, not this process's)."""
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_resolving_every_builder_imports_neither_vllm_nor_megatron():
    """The vLLM engine's and the Megatron backend's heavy imports are inside their builders: a
    node without vLLM (or megatron-core) resolves every builder."""
    assert modules_imported_by(
        "from laminar_hpc.config.backend_specs import ROLLOUT_BACKENDS, TRAINER_BACKENDS, resolve\n"
        "for spec in (*ROLLOUT_BACKENDS.values(), *TRAINER_BACKENDS.values()):\n"
        "    resolve(spec.builder)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'megatron')))\n") == "[]"


def test_resolving_every_sink_imports_no_tracker_package():
    """A tracker's package is imported when its sink opens, not when the sink is resolved: a run
    without the `trackers` extra resolves every sink."""
    assert modules_imported_by(
        "from laminar_hpc.config.backend_specs import resolve\n"
        "from laminar_hpc.config.tracker_specs import TRACKERS\n"
        "for spec in TRACKERS.values():\n"
        "    resolve(spec.sink)\n"
        "print(sorted({spec.package for spec in TRACKERS.values()} & {m.split('.')[0] for m in sys.modules}))\n") == "[]"


def test_the_correction_functions_are_the_registrys():
    assert list(CORRECTIONS) == list(CORRECTION_SPECS)
    assert all(CORRECTIONS[name] is resolve(spec.path) for name, spec in CORRECTION_SPECS.items())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.key)
def test_the_config_reference_lists_every_allowed_value(kind):
    assert config_doc_row(kind.key) or kind.documented is own_row, f"docs/config.md has no row for {kind.key}"
    assert [name for name in kind.allowed() if not kind.documented(kind.key, name)] == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.key)
def test_the_architecture_doc_says_where_an_entry_goes(kind):
    assert f"{kind.file}: {kind.table}" in new_part_section()


def test_resolve_refuses_a_path_without_a_function():
    with pytest.raises(ValueError, match="module:name"):
        resolve("laminar_hpc.rollout.engines")


def test_a_bad_value_is_refused_with_the_allowed_ones():
    from laminar_hpc.config import ConfigError, load_config
    with pytest.raises(ConfigError) as e:
        load_config(str(REPO / "configs" / "tiny.yaml"), ["rollout.backend=foo"])
    assert all(f"'{name}'" in str(e.value) for name in ROLLOUT_BACKENDS)


# -- (e): an entry added to one list only is caught ------------------------------------------------


class FakeRollout(RolloutBackendSpec):
    name = "fake"
    builder = "laminar_hpc.rollout.engines:fake_engine"


def test_an_engine_in_the_registry_only_is_reported_by_name(monkeypatch):
    monkeypatch.setitem(ROLLOUT_BACKENDS, "fake", FakeRollout())
    problems = registry_problems()
    assert problems and all("'fake'" in p for p in problems), problems
    assert any("the schema does not accept it" in p for p in problems)
    assert any("'laminar_hpc.rollout.engines:fake_engine' does not resolve" in p for p in problems)
    assert any("docs/config.md does not list it" in p for p in problems)


def test_a_builder_that_does_not_resolve_is_reported_by_name(monkeypatch):
    class Broken(TrainerBackendSpec):
        name = "megatron"
        builder = "laminar_hpc.trainer.no_such_module:megatron_trainer"
    monkeypatch.setitem(TRAINER_BACKENDS, "megatron", Broken())
    assert registry_problems() == [
        "trainer.backend 'megatron': its code 'laminar_hpc.trainer.no_such_module:megatron_trainer' does not "
        "resolve (ModuleNotFoundError: No module named 'laminar_hpc.trainer.no_such_module')"]


@pytest.fixture
def restored():
    """restored(registry) -> registry: a list the test edits, put back afterwards as it was, in its
    order (monkeypatch's delitem puts an entry back last; the lists' order is checked above)."""
    saved = []

    def keep(registry: dict) -> dict:
        saved.append((registry, dict(registry)))
        return registry
    yield keep
    for registry, before in saved:
        registry.clear()
        registry.update(before)


def test_a_correction_the_schema_accepts_without_an_entry_is_reported_by_name(restored):
    del restored(CORRECTION_SPECS)["mis-seq"]
    problems = registry_problems()
    assert "trainer.correction 'mis-seq': the schema accepts it but config/correction_specs.py: CORRECTION_SPECS " \
           "has no entry" in problems
    assert all("'mis-seq'" in p for p in problems), problems


def test_a_correction_without_its_function_is_reported_by_name(monkeypatch):
    fake = CorrectionSpec("fake", "laminar_hpc.trainer.corrections:fake_correction", "a test's")
    monkeypatch.setitem(CORRECTION_SPECS, "fake", fake)
    problems = registry_problems()
    assert any("'fake'" in p and "does not resolve" in p for p in problems), problems
    assert any("'fake'" in p and "CORRECTIONS does not have it" in p for p in problems), problems


def test_a_layout_in_the_registry_only_is_reported_by_name(monkeypatch):
    fake = LayoutSpec("fake", "a test's", {"prompt_field": "q", "no_such_key": 1})
    monkeypatch.setitem(LAYOUT_SPECS, "fake", fake)
    problems = registry_problems()
    assert problems and all("'fake'" in p for p in problems), problems
    assert "task.layout 'fake': in config/layout_specs.py: LAYOUT_SPECS but the schema does not accept it" in problems
    assert any("docs/config.md does not list it" in p for p in problems)
    assert "task.layout 'fake': its default 'no_such_key' is no key of the task: section (DatasetTaskCfg)" in problems


def test_a_tracker_in_the_registry_only_is_reported_by_name(monkeypatch):
    monkeypatch.setitem(TRACKERS, "fake", TrackerSpec("fake", "laminar_hpc.metrics.tracker_sinks:FakeSink", "fake",
                                                      "Fake"))
    problems = registry_problems()
    assert problems and all("'fake'" in p for p in problems), problems
    assert "logging 'fake': in config/tracker_specs.py: TRACKERS but the schema does not accept it" in problems
    assert any("'laminar_hpc.metrics.tracker_sinks:FakeSink' does not resolve" in p for p in problems)


def test_a_tracker_field_without_an_entry_is_reported_by_name(restored):
    del restored(TRACKERS)["mlflow"]
    problems = registry_problems()
    assert problems == ["logging 'mlflow': the schema accepts it but config/tracker_specs.py: TRACKERS has no entry"]


def test_a_built_in_tool_in_the_registry_only_is_reported_by_name(monkeypatch):
    """The validator lists the registry's tools, so the schema takes the new name at once; its code
    and the config reference still lack it."""
    monkeypatch.setitem(BUILTIN_TOOLS, "fake",
                        ToolSpec("fake", "laminar_hpc.tasks.tools.loader:fake_builder", "a test's"))
    problems = registry_problems()
    assert problems and all("'fake'" in p for p in problems), problems
    assert any("'laminar_hpc.tasks.tools.loader:fake_builder' does not resolve" in p for p in problems)
    assert any("docs/config.md does not list it" in p for p in problems)
    assert EnvCfg(tools={"t": "fake"}).tools == {"t": "fake"}


def test_a_built_in_reward_under_another_name_is_reported(monkeypatch):
    monkeypatch.setitem(BUILTIN_REWARDS, "exact", BuiltinReward("exactly", BUILTIN_REWARDS["exact"].path, "a test's"))
    assert registry_problems() == [
        "task.reward.fn 'exact': its entry in config/reward_specs.py: BUILTIN_REWARDS is named 'exactly'"]


def test_auto_is_no_reward_signature():
    assert "auto" not in REWARD_SIGNATURES and typing.get_args(schema_field("task.reward.signature").annotation) == \
        ("auto", *REWARD_SIGNATURES)


def test_the_tracker_fields_are_the_registrys():
    """LoggingCfg has exactly one field per tracker (and its own settings), and `enabled` reads
    the registry."""
    assert [f for f in LoggingCfg.model_fields if f not in LOGGING_SETTINGS] == list(TRACKERS)
    on = LoggingCfg(**{name: True for name in TRACKERS})
    assert on.enabled == list(TRACKERS) and LoggingCfg().enabled == []


def test_a_task_type_in_the_list_only_is_reported_by_name(monkeypatch):
    monkeypatch.setitem(TASK_TYPES, "maze", TaskType("maze", DatasetTaskCfg, "laminar_hpc.tasks.sources.maze:MazeTasks.from_config"))
    problems = registry_problems()
    assert problems and all("'maze'" in p for p in problems), problems
    assert "task.type 'maze': its section DatasetTaskCfg does not accept type 'maze'" in problems
    assert any("the schema does not accept it" in p for p in problems)
    assert any("'laminar_hpc.tasks.sources.maze:MazeTasks.from_config' does not resolve" in p for p in problems)


def test_every_task_type_builds_its_source():
    from laminar_hpc.tasks.sources.build import build_task
    data = {"path": str(REPO / "examples" / "verl-arith" / "data" / "train.parquet"), "layout": "verl"}
    built = {name: type(build_task(spec.section(type=name, **(data if "path" in spec.section.model_fields else {})),
                                   0)).__name__ for name, spec in TASK_TYPES.items()}
    assert built == {name: spec.source.split(":")[1].split(".")[0] for name, spec in TASK_TYPES.items()}


def test_what_code_asks_of_a_task_type_is_a_rule_of_its_entry(monkeypatch):
    """Issue 47: the controller (epochs), the schema (a tool task needs tools) and the simulator and
    ideal (an emulated task's prompt length) ask the TaskType, never its name: a rule set on an
    entry is what every caller sees."""
    from dataclasses import replace

    from laminar_hpc.config.schema import SyntheticTaskCfg
    from laminar_hpc.config.task import BuiltinTaskCfg, fixed_prompt_tokens
    assert {n for n, t in TASK_TYPES.items() if t.counts_epochs} == {"dataset", "jsonl"}
    assert fixed_prompt_tokens(SyntheticTaskCfg(prompt_tokens=77)) == 77
    assert fixed_prompt_tokens(BuiltinTaskCfg()) is None
    Config(task={"type": "synthetic"})  # no tools needed
    monkeypatch.setitem(TASK_TYPES, "synthetic", replace(TASK_TYPES["synthetic"], needs_tools=True))
    with pytest.raises(ValidationError, match="task.type synthetic is solved with a tool: set env.tools"):
        Config(task={"type": "synthetic"})


# a part added in one place, before anything reads the tables: what derives from them must follow
ONE_PLACE = '''
import json
from laminar_hpc.config import backend_specs as specs
from pydantic import Field
from laminar_hpc.config.section import PosInt, Section

class FakeCfg(Section):  # (its meaning as a description: a "-c" script has no source to read comments from)
    knob: PosInt = Field(7, description="the fake part's one setting")

class FakeRollout(specs.RolloutBackendSpec):
    name, meaning, settings = "fake", "a test's engine", FakeCfg
    builder = "laminar_hpc.rollout.engines:torch_engine"

class FakeTrainer(specs.TrainerBackendSpec):
    name, meaning, settings = "fake", "a test's trainer", FakeCfg
    builder = "laminar_hpc.trainer.backend_builders:torch_trainer"

from laminar_hpc.config import env, tool_specs, tracker_specs, tracking
specs.ROLLOUT_BACKENDS["fake"] = FakeRollout()  # each its one entry
specs.TRAINER_BACKENDS["fake"] = FakeTrainer()
tool_specs.BUILTIN_TOOLS["fake"] = tool_specs.ToolSpec("fake", "laminar_hpc.tasks.tools.loader:calculator_builder",
                                         "a test's tool", settings=FakeCfg)
tracker_specs.TRACKERS["fake"] = tracker_specs.TrackerSpec("fake", "laminar_hpc.metrics.tracker_sinks:TensorBoardSink",
                                                 "tensorboard", "Fake", meaning="a test's tracker", settings=FakeCfg)
# the package's import built the schema before the entries existed: build it again, as a start would
import importlib
from laminar_hpc.config import schema, trainer
for module in (env, tracking, trainer, schema):
    importlib.reload(module)  # the sections, derived again; the tables (the *_specs modules) keep the entries
from laminar_hpc.config.reference import markdown
from laminar_hpc.config.schema import Config
cfg = Config(rollout={"backend": "fake", "fake": {"knob": 8}}, trainer={"backend": "fake", "fake": {"knob": 9}},
             env={"tools": {"t": "fake"}, "fake": {"knob": 10}}, logging={"fake": True})
docs = markdown()
print(json.dumps({
    "settings": [cfg.rollout.fake.knob, cfg.trainer.fake.knob, cfg.env.fake.knob, cfg.logging.fake.knob,
                 Config().rollout.fake.knob, Config().logging.fake],
    "enabled": cfg.logging.enabled,
    "documented": [k in docs for k in ("`rollout.fake.knob`", "`trainer.fake.knob`", "`env.fake.knob`",
                                       "`logging.fake.knob`", "fake: a test's engine", "fake: a test's trainer",
                                       "a test's tracker", "the fake part's one setting")],
    "builders": [callable(specs.resolve(p)) for p in (specs.rollout_backend(cfg).builder,
                                                       specs.trainer_backend(cfg).builder,
                                                       tool_specs.BUILTIN_TOOLS["fake"].builder,
                                                       tracker_specs.TRACKERS["fake"].sink)],
}))
'''


def test_a_part_added_in_one_place_reaches_the_schema_the_docs_and_its_builder():
    """Issue 47 item 1: an engine, a trainer backend, a built-in tool or a tracker is its spec, with
    its settings beside it, and one entry: the schema's type and its `<section>.<name>` settings,
    docs/config.md and the builder all follow from the entry (in a fresh interpreter: the schema derives when its
    module is imported)."""
    out = subprocess.run([sys.executable, "-c", ONE_PLACE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"settings": [8, 9, 10, 7, 7, None], "enabled": ["fake"], "documented": [True] * 8,
                   "builders": [True] * 4}


# a correction with a hyperparameter of its own, added in one place: its function and its entry
NEW_CORRECTION = '''
import json
from laminar_hpc.config import correction_specs as specs
from laminar_hpc.config.section import PosFloat, Section
from pydantic import Field

class DampCfg(Section):
    damp: PosFloat = Field(0.3, description="the fake correction's damping")

seen = []

def damped(tok, *, rho, damp, prox_logp=None, **_):  # its function: aipo's terms, scaled
    import dataclasses
    from laminar_hpc.trainer.corrections import aipo
    seen.append(damp)
    t = aipo(tok, rho=rho, clip_eps=None)
    return dataclasses.replace(t, per_token=t.per_token * damp)

specs.CORRECTION_SPECS["damped"] = specs.CorrectionSpec(  # its one entry
    "damped", "__main__:damped", "a test's", settings=(specs.WeightBoundsCfg, DampCfg))
# the package's import derived these before the entry existed: derive them again, as a start would
import importlib
from laminar_hpc.config import resume_changes, schema, trainer
for module in (trainer, schema, resume_changes):
    importlib.reload(module)
import torch
from laminar_hpc.config.reference import markdown
from laminar_hpc.config.schema import Config
from laminar_hpc.trainer.loss import policy_loss
cfg = Config(trainer={"correction": "damped", "damp": 0.7})
lp = torch.zeros(2, 3, requires_grad=True)
out = policy_loss(lp, torch.zeros(2, 3), torch.ones(2, 1), torch.ones(2, 3), correction="damped",
                  **specs.correction_settings(cfg.trainer))
print(json.dumps({"seen": seen, "documented": "`trainer.damp`" in markdown() and "damping" in markdown(),
                  "resume": "trainer.damp" in resume_changes.LOSS, "default": Config().trainer.damp}))
'''


def test_a_correction_with_a_hyperparameter_of_its_own_is_its_function_and_its_entry():
    """Issue 47 item 1: a new correction's hyperparameter is a settings section beside its entry:
    the `trainer:` key, its docs, the resume check and the loss's call (through both backends'
    `correction_settings`) follow, with no edit of the loss, the backends or the trainer section."""
    out = subprocess.run([sys.executable, "-c", NEW_CORRECTION], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"seen": [0.7], "documented": True, "resume": True, "default": 0.3}

