"""The built-in tools and tool-call formats of `env:` (config/env.py), one entry each: the only lists
(`BUILTIN_TOOLS`, `TOOL_CALL_FORMATS`). The `env:` section's validator and tasks/tools/loader.py
(load_tools, load_format) read them; each entry names its code as a lazy-import path ("module:name",
config/backend_specs.py: resolve), and a tool with settings names its section (`settings`, defined
here beside its entry), which becomes `env.<tool>` (config/section.py: with_part_settings). A new
built-in is its code plus one entry here. Imports neither torch, mpi4py nor vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from laminar_hpc.config.section import PosFloat, PosInt, Section


@dataclass(frozen=True)
class ToolSpec:
    name: str  # its value in `env.tools`
    # "module:function" of its builder, `(env_cfg: EnvCfg) -> the tool` (a callable taking the
    # call's arguments as keywords, plain or async, returning text or a tasks.tools.episode.ToolResult)
    builder: str
    meaning: str  # one line: what it does
    settings: type[Section] | None = None  # its own section, `env.<name>` (None: none)


@dataclass(frozen=True)
class FormatSpec:
    name: str  # its `env.format` value
    cls: str  # "module:Class" with the methods of tasks.tools.episode.HermesFormat
    meaning: str  # one line: how a call is written


class SandboxCfg(Section):
    """Limits of the built-in `python` tool (tasks/sandbox/python_tool.py): model-written code inside bubblewrap's
    namespaces and a seccomp filter, then Landlock, rlimits and an audit hook; processes, memory and
    disk counted for each call as a whole (tasks/sandbox/call_limits.py). Without bubblewrap the call fails
    closed."""
    cpu_s: PosFloat = 2.0  # CPU seconds per process of a python call (rounded up to whole seconds)
    # memory of a python call, MiB: its cgroup's limit (every process, its files too), and each process's
    # address space; without a cgroup the call holds at most max_processes x this
    mem_mb: PosInt = 256
    wall_s: PosFloat = 5.0  # wall-clock seconds per python call; past it the call is killed (outcome timeout)
    # bwrap, the only isolation (a Landlock-only mode ran tool code as the campaign's uid: removed)
    isolation: Literal["bwrap"] = "bwrap"
    max_processes: PosInt = 32  # processes of a python call at once (its cgroup's pids.max, and RLIMIT_NPROC)
    disk_mb: PosInt = 64  # what a python call may write in all: its working directory is a tmpfs of this size


BUILTIN_TOOLS: dict[str, ToolSpec] = {s.name: s for s in (
    ToolSpec("calculator", "laminar_hpc.tasks.tools.loader:calculator_builder",
             "arithmetic, no eval (tasks/tools/calculator.py)"),
    ToolSpec("python", "laminar_hpc.tasks.tools.loader:python_builder",
             "Python in a sandboxed subprocess with env.python's limits and no network (tasks/sandbox/python_tool.py)",
             settings=SandboxCfg),
)}
TOOL_CALL_FORMATS: dict[str, FormatSpec] = {s.name: s for s in (
    FormatSpec("hermes", "laminar_hpc.tasks.tools.episode:HermesFormat", "`<tool_call>{json}</tool_call>`"),
)}
