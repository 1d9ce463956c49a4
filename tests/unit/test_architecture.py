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
    "checkpoint_format": set(),
    "rundir": {"checkpoint_format"},
    "walformat": set(),
    "trust": set(),
    "policy": set(),
    "tasks": {"config", "trust"},
    "config": {"checkpoint_format", "policy", "rundir"},  # policy: the modes' list, for the `mode` type
    "transport": {"checkpoint_format", "config", "rundir"},
    "model": {"checkpoint_format", "config", "rundir", "transport", "trust"},
    "emulation": {"config", "tasks", "transport"},
    "metrics": {"checkpoint_format", "config", "rundir", "transport"},
    "analysis": {"checkpoint_format", "config", "metrics", "policy", "rundir"},
    "startup": {"checkpoint_format", "config", "metrics", "rundir", "transport"},
    "launch": {"checkpoint_format", "config", "metrics", "policy", "rundir", "startup", "transport"},
    "controller": {"checkpoint_format", "config", "metrics", "model", "policy", "rundir", "startup", "tasks",
                  "transport", "walformat"},
    "trainer": {"checkpoint_format", "config", "emulation", "metrics", "model", "policy", "rundir", "startup",
               "tasks", "transport"},
    "rollout": {"checkpoint_format", "config", "emulation", "metrics", "model", "policy", "rundir", "startup",
               "tasks", "transport"},
    "relay": {"checkpoint_format", "config", "metrics", "model", "rundir", "startup", "transport"},
    "judge": {"config", "emulation", "model", "rundir", "startup", "transport"},
    "sim": {"checkpoint_format", "config", "controller", "emulation", "metrics", "policy", "rundir", "tasks",
           "transport"},
    "cli": {"analysis", "checkpoint_format", "config", "launch", "metrics", "model", "rundir", "sim", "startup",
           "tasks", "transport", "walformat"},
}
ROLES = {"controller", "trainer", "rollout", "relay", "judge"}  # (they start through `startup`, never import `launch`)
LOWER = {"config", "transport", "metrics", "policy", "model", "tasks"}  # the issue's rule, verbatim


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
        assert not ALLOWED[role] & (ROLES | {"sim", "cli", "analysis", "launch"}), role
    assert ALLOWED["checkpoint_format"] == set() and ALLOWED["rundir"] == {"checkpoint_format"}, \
        "the run directory (and the checkpoint format it names folders by) are the leaves every layer may use"
    assert ALLOWED["walformat"] == set(), "the write-ahead log's format is a leaf (the controller and cli read it)"


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


# -- the module graph: no import cycles -----------------------------------------------------------


def module_imports(path: Path, known: set[str]) -> set[str]:
    """The laminar_hpc modules that `path` imports: for `from pkg import mod` the module `mod`,
    else the nearest module that holds the imported name."""
    out = set()
    for _, target in imports(path):
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        out.add(target)
    me, is_package = module_name(path), path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            for _, target in imports_in(ast.unparse(node), me, is_package):
                out.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return out & known - {me}


def module_graph() -> dict[str, set[str]]:
    known = {module_name(p) for p in modules()}
    return {module_name(p): module_imports(p, known) for p in modules()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted: the modules of
    one import cycle or of several that share modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        # iterative depth-first search: (module, its dependencies not yet visited)
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph.get(dep, ())))))
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    part.append(m)
                    if m == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return sorted(found)


def test_the_cycle_finder_finds_every_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e", "d"}, "g": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_has_no_cycles():
    cycles = import_cycles(module_graph())
    assert not cycles, "modules that import each other (directly or through others):\n  " + "\n  ".join(
        " <-> ".join(c) for c in cycles)


# -- classes: components, not mixins ---------------------------------------------------------------

# the packages whose classes are components, not mixins (issue 29): the roles' code
COMPONENT_PACKAGES = ("laminar_hpc.controller.", "laminar_hpc.rollout.", "laminar_hpc.trainer.")
# "class: base" still built as a mixin (none: the test fails if one comes back)
KNOWN_MIXINS: set[str] = set()
# bases that add nothing to what a class sets or reads
_NEUTRAL_BASES = {"object", "ABC", "Protocol", "Generic", "Exception", "RuntimeError", "ValueError"}
# a class whose annotated fields its generated constructor sets (dataclasses, pydantic, msgspec)
_FIELD_BASES = {"BaseModel", "Section", "Struct", "NamedTuple", "TypedDict"}


def project_classes(sources: dict[str, str]) -> dict[str, ast.ClassDef]:
    """'module.Class' -> its definition, for the top-level classes of `sources` (module -> text)."""
    return {f"{mod}.{node.name}": node for mod, src in sources.items() for node in ast.parse(src).body
            if isinstance(node, ast.ClassDef)}


def base_names(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(b).split("[")[0].split(".")[-1] for b in cls.bases]


def _project_bases(cls: ast.ClassDef, by_name: dict[str, list[ast.ClassDef]]) -> list[ast.ClassDef]:
    return [c for b in base_names(cls) for c in by_name.get(b, ())]


def _sets(cls: ast.ClassDef, by_name: dict[str, list[ast.ClassDef]]) -> tuple[set[str], bool]:
    """(attributes `cls` and its project ancestors set, whether every ancestor is a project or
    neutral class: then nothing else can set an attribute)."""
    has_fields = any("dataclass" in ast.unparse(d) for d in cls.decorator_list) or \
        bool(set(base_names(cls)) & _FIELD_BASES)
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (node.value or has_fields):
            out.add(node.target.id)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
    closed = all(b in by_name or b in _NEUTRAL_BASES for b in base_names(cls))
    for base in _project_bases(cls, by_name):
        more, base_closed = _sets(base, by_name)
        out |= more
        closed = closed and base_closed
    return out, closed


def _reads(cls: ast.ClassDef) -> set[str]:
    return {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name) and node.value.id == "self" and not node.attr.startswith("__")}


def unset_state(sources: dict[str, str], under: str) -> list[str]:
    """'module.Class: Base reads x, y' for every class in a module under `under` whose project
    base reads attributes neither it nor its own bases set (state a subclass or a sibling must
    supply: a mixin). A base that also derives from a library class (torch.nn.Module) may get
    attributes from it: there only the attributes the derived class sets count."""
    classes = project_classes(sources)
    by_name: dict[str, list[ast.ClassDef]] = {}
    for cls in classes.values():
        by_name.setdefault(cls.name, []).append(cls)
    bad = []
    for qual, cls in sorted(classes.items()):
        if not qual.startswith(under):
            continue
        derived_sets, _ = _sets(cls, by_name)
        for base in _project_bases(cls, by_name):
            own, closed = _sets(base, by_name)
            missing = sorted(a for a in _reads(base) - own if closed or a in derived_sets)
            if missing:
                bad.append(f"{qual}: {base.name} reads {', '.join(missing)}, which it never sets")
    return bad


def _sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in modules()}


def test_the_mixin_finder_sees_state_a_base_never_sets():
    src = ("import torch\n"
           "class Good:\n    def __init__(self, n):\n        self.n = n\n    def twice(self):\n"
           "        return 2 * self.n + self.helper()\n    def helper(self):\n        return 0\n"
           "class Mixin:\n    def total(self):\n        return self.items + self.n\n"
           "class Fine(Good):\n    pass\n"
           "class Bad(Good, Mixin):\n    def __init__(self):\n        super().__init__(1)\n        self.items = 3\n"
           "class Layer(torch.nn.Module):\n    def f(self):\n        return self.weight + self.scale\n"
           "class Scaled(Layer):\n    def __init__(self):\n        self.scale = 2\n")
    assert unset_state({"laminar_hpc.trainer.x": src}, "laminar_hpc.trainer") == [
        "laminar_hpc.trainer.x.Bad: Mixin reads items, n, which it never sets",
        "laminar_hpc.trainer.x.Scaled: Layer reads scale, which it never sets"]


def mixins(sources: dict[str, str]) -> list[str]:
    """`unset_state` over every package of COMPONENT_PACKAGES."""
    return [line for under in COMPONENT_PACKAGES for line in unset_state(sources, under)]


def test_the_mixin_check_covers_every_role_package():
    mixin = "class Mixin:\n    def total(self):\n        return self.items\nclass Bad(Mixin):\n    items = 3\n"
    for pkg in ("controller", "rollout", "trainer"):
        found = mixins({f"laminar_hpc.{pkg}.x": mixin})
        assert found == [f"laminar_hpc.{pkg}.x.Bad: Mixin reads items, which it never sets"]
    assert mixins({"laminar_hpc.sim.x": mixin}) == []  # (not a role)


def test_no_role_class_inherits_state_its_base_never_sets():
    found = mixins(_sources())
    bad = [line for line in found if line.split(" reads ")[0] not in KNOWN_MIXINS]
    assert not bad, "bases that read state they never set (make them components, or set it):\n  " + "\n  ".join(bad)
    gone = KNOWN_MIXINS - {line.split(" reads ")[0] for line in found}
    assert not gone, f"no longer mixins: remove them from KNOWN_MIXINS: {sorted(gone)}"


def test_no_class_has_two_project_bases():
    classes = project_classes(_sources())
    names = {cls.name for cls in classes.values()}
    many = {q for q, cls in classes.items() if len([b for b in base_names(cls) if b in names]) > 1}
    assert not many, f"classes built from several project classes (mixins): {sorted(many)}"


# -- one owner for the checkpoint format; no private names across modules ---------------------------



def test_only_the_checkpoint_format_spells_a_checkpoint_file_name():
    from laminar_hpc.checkpoint_format import COMPLETE_FILE, LEDGER_FILE, MANIFEST_FILE, META_FILE, TENSOR_FILES
    names = {*TENSOR_FILES, META_FILE, LEDGER_FILE, MANIFEST_FILE, COMPLETE_FILE}
    bad = [f"{p.relative_to(REPO)}:{node.lineno} {node.value!r}" for p in modules()
           if p.name != "checkpoint_format.py"
           for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Constant) and node.value in names]
    assert not bad, "checkpoint file names spelled outside laminar_hpc/checkpoint_format.py (use its constants):\n  " + \
        "\n  ".join(bad)


def test_no_private_name_is_imported_from_another_module():
    found = set()
    for p in modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("laminar_hpc")):
                found.update((module_name(p), a.name) for a in node.names if a.name.startswith("_"))
    assert not found, f"private names imported across modules (make them public where they live): {sorted(found)}"


# -- typed contracts: every config parameter is annotated -----------------------------------------


def test_every_config_parameter_is_annotated():
    """A parameter named `cfg` or `*_cfg` says which config it takes (`Config` or the section)."""
    bad = []
    for p in modules():
        rel = p.relative_to(PKG).as_posix()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):  # a lambda cannot say
                a = node.args
                bad += [f"{rel}:{node.lineno} {arg.arg}" for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                        if (arg.arg == "cfg" or arg.arg.endswith("_cfg")) and arg.annotation is None]
    assert not bad, "config parameters without a type:\n  " + "\n  ".join(bad)


# what a backend, a mode, an update path or a task type decides lives in its spec (config/backend_specs.py,
# config/update_paths.py, policy/modes), not in string comparisons spread over the tree
NAME_COMPARISON = re.compile(r"""(backend|mode|update_path|task\.type)\s*(==|!=)\s*['"]|(backend|mode|update_path|task\.type) (not )?in \(""")
MAX_NAME_COMPARISONS = 3  # issue 29's bar (32 before the specs)


def name_comparisons() -> list[str]:
    out = []
    for p in modules():
        rel = p.relative_to(PKG).as_posix()
        if rel.startswith("config/") or "spec" in p.name or "registry" in p.name:
            continue
        out += [f"{rel}:{i} {line.strip()}" for i, line in enumerate(p.read_text().splitlines(), 1)
                if NAME_COMPARISON.search(line)]
    return out


def test_backend_and_mode_rules_live_in_their_specs():
    found = name_comparisons()
    assert len(found) <= MAX_NAME_COMPARISONS, "compare names in a spec instead:\n  " + "\n  ".join(found)
    assert NAME_COMPARISON.search('if cfg.rollout.backend == "vllm":') and NAME_COMPARISON.search("mode in (")
    assert NAME_COMPARISON.search('if cfg.task.type == "synthetic"')  # a task type's rules are on its TaskType


def test_modules_that_share_a_file_name_say_which_is_which():
    """Issue 37 item 5: two modules with one file name only where each one's docstring names the
    other (a role's loop is `<role>/main.py` in every role package: the package says which)."""
    by_name: dict[str, list[Path]] = {}
    for p in modules():
        if p.name not in ("__init__.py", "__main__.py", "main.py"):
            by_name.setdefault(p.name, []).append(p)
    bad = []
    for paths in by_name.values():
        for p in paths:
            doc = ast.get_docstring(ast.parse(p.read_text())) or ""
            bad += [f"{p.relative_to(PKG)} does not name {q.relative_to(PKG)}" for q in paths
                    if q != p and str(q.relative_to(PKG)) not in doc]
    assert not bad, "modules of one file name whose docstrings do not say which is which:\n  " + "\n  ".join(bad)


BENCH = Path(REPO) / "bench"


def test_the_benchmarks_are_a_package_without_a_circle_that_the_product_never_imports():
    # issue 47: the benchmarks sat loose in tools/ with an import circle (bench_relay <-> its parts)
    # and sys.path edits; now `bench/` is a package (installed beside laminar_hpc) and tools/ keeps
    # the install and cluster scripts
    product = [f"{p.relative_to(REPO)}:{n.lineno}" for p in modules() for n in ast.walk(ast.parse(p.read_text()))
               if (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "bench" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "bench")]
    assert product == [], "laminar_hpc imports the benchmarks"
    scripts = sorted(BENCH.glob("*.py"))
    assert [p for p in scripts if "sys.path" in p.read_text()] == []
    assert not list((Path(REPO) / "tools").glob("*.py")), "tools/ keeps the install and cluster scripts only"
    deps: dict[str, set[str]] = {}
    for p in scripts:
        names = set()
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module == "bench":
                names |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("bench."):
                names.add(n.module.split(".")[1])
        deps[p.stem] = names - {p.stem}
    assert all(d <= set(deps) for d in deps.values()), deps
    left = dict(deps)
    while left:  # no circle: a topological order exists
        free = [m for m, d in left.items() if not d & set(left)]
        assert free, f"the benchmarks import each other in a circle among {sorted(left)}"
        for m in free:
            del left[m]
