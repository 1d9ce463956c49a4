"""The allowed import directions between the packages of laminar_hpc, checked on the source.

`ALLOWED` is the package map of docs/architecture.md as a dict: a test keeps the two equal, so
the document stays true. Every `import` of every module counts, at the top of the file or inside
a function (a lazy import is still a dependency), and each one must be allowed by `ALLOWED`.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO

PKG = Path(REPO) / "laminar_hpc"
DOC = Path(REPO) / "docs" / "architecture.md"

# package -> the other packages it may import. Roles never import each other; the lower layers
# never import the launcher or a role; the simulator may use the controller's socket-free parts.
ALLOWED: dict[str, set[str]] = {
    "rundir": set(),
    "policy": set(),
    "tasks": set(),
    "config": {"rundir"},
    "transport": {"config", "rundir"},
    "model": {"config", "rundir", "transport"},
    "emulation": {"config", "tasks", "transport"},
    "metrics": {"config", "rundir", "transport"},
    "analysis": {"config", "metrics", "rundir"},
    "launch": {"config", "metrics", "policy", "rundir", "transport"},
    "controller": {"config", "launch", "metrics", "model", "policy", "rundir", "tasks", "transport"},
    "trainer": {"config", "emulation", "launch", "metrics", "model", "policy", "rundir", "tasks", "transport"},
    "rollout": {"config", "emulation", "launch", "metrics", "model", "policy", "rundir", "tasks", "transport"},
    "relay": {"config", "launch", "metrics", "model", "rundir", "transport"},
    "sim": {"config", "controller", "emulation", "metrics", "policy", "rundir", "tasks", "transport"},
    "cli": {"analysis", "config", "launch", "metrics", "model", "rundir", "sim", "tasks", "transport"},
}
ROLES = {"controller", "trainer", "rollout", "relay"}
LOWER = {"config", "transport", "metrics", "policy", "model", "tasks"}  # the rule, verbatim


def package_of(module: str) -> str:
    """'laminar_hpc.trainer.megatron.runner' -> 'trainer'; 'laminar_hpc.cli' -> 'cli'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path):
    """(line, imported laminar_hpc module) for every import statement in the file."""
    return imports_in(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def imports_in(source: str, me: str, is_package: bool = False):
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "laminar_hpc":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                parts = me.split(".")
                base = parts[: len(parts) - node.level + is_package]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "laminar_hpc":
                continue
            if target == "laminar_hpc":  # `from laminar_hpc import sim`: the names are the packages
                for alias in node.names:
                    yield node.lineno, f"laminar_hpc.{alias.name}"
            else:
                yield node.lineno, target


def modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_every_import_follows_the_package_map():
    bad = []
    for path in modules():
        src = package_of(module_name(path))
        if not src:
            continue  # laminar_hpc/__init__.py
        for line, target in sorted(imports(path)):
            dst = package_of(target)
            if dst != src and dst not in ALLOWED.get(src, set()):
                may = ", ".join(sorted(ALLOWED.get(src, ()))) or "nothing"
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target} ({src} may import: {may})")
    assert not bad, "imports against the package map (docs/architecture.md):\n  " + "\n  ".join(bad)


def test_the_checker_sees_every_kind_of_import():
    src = ("import os\nimport laminar_hpc.model.llama as llama\nfrom laminar_hpc import sim, tasks\n"
           "def f():\n    from laminar_hpc.relay.chain import STOP\n    from .base import X\n"
           "    from .. import policy\n    from ..controller.pools import P\n"
           "if False:\n    import laminar_hpc.trainer\n")
    got = sorted(imports_in(src, "laminar_hpc.rollout.node"))
    assert got == [(2, "laminar_hpc.model.llama"), (3, "laminar_hpc.sim"), (3, "laminar_hpc.tasks"),
                   (5, "laminar_hpc.relay.chain"), (6, "laminar_hpc.rollout.base"), (7, "laminar_hpc.policy"),
                   (8, "laminar_hpc.controller.pools"), (10, "laminar_hpc.trainer")]
    assert sorted(imports_in("from . import base\n", "laminar_hpc.rollout", is_package=True)) == \
        [(1, "laminar_hpc.rollout")]
    assert [package_of(m) for _, m in got] == ["model", "sim", "tasks", "relay", "rollout", "policy",
                                               "controller", "trainer"]


def test_every_package_is_on_the_map():
    found = {package_of(module_name(p)) for p in modules()} - {""}
    assert found - set(ALLOWED) == set(), "packages missing from ALLOWED and docs/architecture.md's package map"
    assert set(ALLOWED) - found == set(), "the package map names packages that do not exist"


def test_the_map_is_layered():
    # no cycle: a topological order exists
    left = {p: set(d) for p, d in ALLOWED.items()}
    while left:
        free = [p for p, d in left.items() if not d & set(left)]
        assert free, f"the allowed imports form a cycle among {sorted(left)}"
        for p in free:
            del left[p]
    for low in LOWER:
        assert not ALLOWED[low] & (ROLES | {"launch", "sim", "cli", "analysis"}), low
    for role in ROLES:
        assert not ALLOWED[role] & (ROLES | {"sim", "cli", "analysis"}), role
    assert ALLOWED["rundir"] == set(), "the run directory is the leaf every layer may use"


def doc_map() -> dict[str, set[str]]:
    """The package map table of docs/architecture.md: | `pkg/` | job | `a`, `b` (or —) |."""
    text = DOC.read_text()
    section = text.split("## Package map", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Package map' section"
    rows = [ln for ln in section[1].split("\n## ", 1)[0].splitlines() if ln.startswith("|")][2:]
    out = {}
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        name = re.fullmatch(r"`([a-z_]+)(?:/|\.py)`", cells[0])
        assert name, f"package map row does not start with a `package/` or `module.py`: {row}"
        out[name.group(1)] = set(re.findall(r"`([a-z_]+)(?:/|\.py)?`", cells[-1]))
    return out


def test_the_document_shows_the_same_map():
    assert doc_map() == ALLOWED
