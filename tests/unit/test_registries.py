"""One list per swappable part (issue 37 item 3): rollout engines and trainer backends in
config/backends.py, off-policy corrections in config/corrections.py. Everything else derives from
those lists: the values the schema accepts, the code each entry names (a lazy-import path), the
config reference (docs/config.md) and the architecture doc's "Where a new part goes".
`registry_problems` is that consistency check; the last tests add an entry to one list only and
see it named in what the check reports."""
from __future__ import annotations

import importlib
import subprocess
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from helpers import REPO

from laminar_hpc.config.backends import (
    ROLLOUT_BACKENDS, TRAINER_BACKENDS, RolloutBackendSpec, TrainerBackendSpec, resolve,
)
from laminar_hpc.config.corrections import CORRECTION_SPECS, CorrectionSpec
from laminar_hpc.config.schema import Config

CONFIG_DOC = REPO / "docs" / "config.md"
ARCHITECTURE_DOC = REPO / "docs" / "architecture.md"
NEW_PART_HEADING = "**Where a new part goes.**"


@dataclass(frozen=True)
class Kind:
    """One kind of swappable part: the config key that picks an entry, and its one list."""
    key: str  # the config key whose values are the entries' names
    module: str  # the module that holds the list
    table: str  # the list's name in it
    code: Callable[[Any], str]  # an entry's code, as a lazy-import path "module:name"

    @property
    def registry(self) -> dict:
        return getattr(importlib.import_module(self.module), self.table)

    @property
    def file(self) -> str:
        """The list's file as docs/architecture.md names it (relative to laminar_hpc/)."""
        return self.module.removeprefix("laminar_hpc.").replace(".", "/") + ".py"

    def allowed(self) -> tuple[str, ...]:
        """The values the schema accepts for the key (its field's Literal)."""
        section: Any = Config
        *path, leaf = self.key.split(".")
        for part in path:
            section = section.model_fields[part].annotation
        return typing.get_args(section.model_fields[leaf].annotation)


KINDS = [
    Kind("rollout.backend", "laminar_hpc.config.backends", "ROLLOUT_BACKENDS", lambda spec: spec.builder),
    Kind("trainer.backend", "laminar_hpc.config.backends", "TRAINER_BACKENDS", lambda spec: spec.builder),
    Kind("trainer.correction", "laminar_hpc.config.corrections", "CORRECTION_SPECS", lambda spec: spec.path),
]


def new_part_section() -> str:
    """docs/architecture.md's paragraph "Where a new part goes" and its table (up to the next heading)."""
    text = ARCHITECTURE_DOC.read_text()
    assert NEW_PART_HEADING in text, f"docs/architecture.md has no {NEW_PART_HEADING!r}"
    return text.split(NEW_PART_HEADING, 1)[1].split("\n#", 1)[0]


def config_doc_row(key: str) -> str:
    rows = [line for line in CONFIG_DOC.read_text().splitlines() if line.startswith(f"| `{key}` |")]
    return rows[0] if rows else ""


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
    not name, a correction without its function in the trainer's table."""
    problems = []
    new_part = new_part_section()
    for kind in KINDS:
        registry, allowed = kind.registry, kind.allowed()
        where = f"{kind.file}: {kind.table}"
        row = config_doc_row(kind.key)
        problems += [f"{kind.key} {name!r}: in {where} but the schema does not accept it"
                     for name in registry if name not in allowed]
        problems += [f"{kind.key} {name!r}: the schema accepts it but {where} has no entry"
                     for name in allowed if name not in registry]
        for name, spec in registry.items():
            if spec.name != name:
                problems.append(f"{kind.key} {name!r}: its entry in {where} is named {spec.name!r}")
            why = code_problem(kind.code(spec))
            if why:
                problems.append(f"{kind.key} {name!r}: its code {kind.code(spec)!r} does not resolve ({why})")
            if f"'{name}'" not in row:
                problems.append(f"{kind.key} {name!r}: docs/config.md does not list it (regenerate it: "
                                "laminar_hpc.config.reference.markdown)")
        if where not in new_part:
            problems.append(f"{kind.key}: docs/architecture.md's 'Where a new part goes' does not name {where}")
    from laminar_hpc.trainer.corrections import CORRECTIONS
    problems += [f"trainer.correction {name!r}: trainer/corrections.py's CORRECTIONS does not have it"
                 for name in CORRECTION_SPECS if name not in CORRECTIONS]
    problems += [f"trainer.correction {name!r}: in trainer/corrections.py's CORRECTIONS but not in "
                 "config/corrections.py: CORRECTION_SPECS" for name in CORRECTIONS if name not in CORRECTION_SPECS]
    return problems


# -- (a)-(d): the lists and everything derived from them agree ----------------------------------------


def test_the_lists_and_what_derives_from_them_agree():
    assert registry_problems() == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.key)
def test_the_schema_accepts_exactly_the_registrys_names(kind):
    assert list(kind.allowed()) == list(kind.registry)  # same order: error messages and docs list them so


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.key)
def test_every_entrys_code_resolves_to_a_function(kind):
    for name, spec in kind.registry.items():
        assert callable(resolve(kind.code(spec))), name


def test_resolving_every_builder_imports_neither_vllm_nor_megatron():
    """The vLLM engine's and the Megatron backend's heavy imports are inside their builders: a
    node without vLLM (or megatron-core) resolves every builder."""
    code = ("import sys\n"
            "from laminar_hpc.config.backends import ROLLOUT_BACKENDS, TRAINER_BACKENDS, resolve\n"
            "for spec in (*ROLLOUT_BACKENDS.values(), *TRAINER_BACKENDS.values()):\n"
            "    resolve(spec.builder)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'megatron')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_correction_functions_are_the_registrys():
    from laminar_hpc.trainer.corrections import CORRECTIONS
    assert list(CORRECTIONS) == list(CORRECTION_SPECS)
    assert all(CORRECTIONS[name] is resolve(spec.path) for name, spec in CORRECTION_SPECS.items())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.key)
def test_the_config_reference_lists_every_allowed_value(kind):
    row = config_doc_row(kind.key)
    assert row, f"docs/config.md has no row for {kind.key}"
    assert [name for name in kind.allowed() if f"'{name}'" not in row] == []


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


def test_a_correction_the_schema_accepts_without_an_entry_is_reported_by_name(monkeypatch):
    monkeypatch.delitem(CORRECTION_SPECS, "mis-seq")
    problems = registry_problems()
    assert "trainer.correction 'mis-seq': the schema accepts it but config/corrections.py: CORRECTION_SPECS " \
           "has no entry" in problems
    assert all("'mis-seq'" in p for p in problems), problems


def test_a_correction_without_its_function_is_reported_by_name(monkeypatch):
    monkeypatch.setitem(CORRECTION_SPECS, "fake", CorrectionSpec("fake", "fake_correction", "a test's"))
    problems = registry_problems()
    assert any("'fake'" in p and "does not resolve" in p for p in problems), problems
    assert any("'fake'" in p and "CORRECTIONS does not have it" in p for p in problems), problems
