"""The `env:` section: multi-turn episodes with tool calls (tasks/tools/episode.py, rollout/episodes.py).
Imports neither torch, mpi4py nor vLLM; re-exported by `laminar_hpc.config.schema`.

    env:
      tools: {calc: calculator, run: python, search: "my_tools.py:search"}
      max_turns: 4                 # model turns per episode
      tool_timeout_s: 10           # per call; a call past it is the observation "timed out"
      python: {cpu_s: 2, mem_mb: 256, wall_s: 5}

`tools` maps the name the model calls to a built-in or to user code (`package.module:function`,
`path/to/file.py:function`; plain or async, returns text). With `environment: "module:Class"` (a
`tasks.tools.episode.Environment`) the episode is the user's own. No `tools` and no `environment`:
single-turn trajectories, as before.

`BUILTIN_TOOLS` is the only list of built-in tools and `TOOL_CALL_FORMATS` of built-in tool-call
formats: this section's validator and tasks/tools/loader.py (load_tools, load_format) read them, and each
entry names its code as a lazy-import path ("module:name", config/backend_specs.py: resolve), so a new
built-in is its code plus one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from laminar_hpc.config.section import PosFloat, PosInt, Section


@dataclass(frozen=True)
class ToolSpec:
    name: str  # its value in `env.tools`
    # "module:function" of its builder, `(env_cfg: EnvCfg) -> the tool` (a callable taking the
    # call's arguments as keywords, plain or async, returning text or a tasks.tools.episode.ToolResult)
    builder: str
    meaning: str  # one line: what it does


@dataclass(frozen=True)
class FormatSpec:
    name: str  # its `env.format` value
    cls: str  # "module:Class" with the methods of tasks.tools.episode.HermesFormat
    meaning: str  # one line: how a call is written


BUILTIN_TOOLS: dict[str, ToolSpec] = {s.name: s for s in (
    ToolSpec("calculator", "laminar_hpc.tasks.tools.loader:calculator_builder",
             "arithmetic, no eval (tasks/tools/calculator.py)"),
    ToolSpec("python", "laminar_hpc.tasks.tools.loader:python_builder",
             "Python in a sandboxed subprocess with env.python's limits and no network (tasks/sandbox/python_tool.py)"),
)}
TOOL_CALL_FORMATS: dict[str, FormatSpec] = {s.name: s for s in (
    FormatSpec("hermes", "laminar_hpc.tasks.tools.episode:HermesFormat", "`<tool_call>{json}</tool_call>`"),
)}


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


class EnvCfg(Section):
    environment: str | None = None  # "module:Class" or "file.py:Class"; None: tools only
    tools: dict[str, str] = Field(default_factory=dict, description=(
        f"the name the model calls -> a built-in ({', '.join(BUILTIN_TOOLS)}) or user code ('file.py:function')"))
    args: dict[str, Any] = Field(default_factory=dict)  # given to the environment (EnvContext.args)
    format: str = Field("hermes", description=(
        "the tool-call format: " + ", ".join(f"{n} ({s.meaning})" for n, s in TOOL_CALL_FORMATS.items())
        + ', or "module:Class" with the methods of tasks.tools.episode.HermesFormat (stopped, turn_calls, '
        "observation_text)"))
    # true: a turn leaves the decode batch as soon as it has written a call (its tool starts at
    # once; one call a turn); false: the turn runs to its end-of-turn token and every call it wrote
    # runs, together (parallel calls, as Qwen writes several blocks in one message)
    stop_at_call: bool = True
    max_turns: PosInt = 4  # model turns per episode: the last one's calls are not run
    max_tool_calls: PosInt = 8  # per episode, over all its turns
    tool_timeout_s: PosFloat = 10.0  # a tool call past this is the observation 'timed out' (outcome timeout)
    max_concurrent: PosInt = 64  # tool calls running at once on one rollout
    # episodes a rollout holds beyond its decode batch (while tools run they leave the batch,
    # and these fill it); None: as many as rollout.max_batch
    extra_episodes: int | None = Field(default=None, ge=0)
    observation_max_chars: PosInt = 1000  # a longer tool result is cut, with a marker
    python: SandboxCfg = Field(default_factory=SandboxCfg)

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    @model_validator(mode="after")
    def _specs(self) -> "EnvCfg":
        for name, spec in self.tools.items():
            if not name or not spec or (":" not in spec and spec not in BUILTIN_TOOLS):
                raise ValueError(f"tools.{name}: {spec!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) "
                                 "nor 'package.module:function' / 'path/to/file.py:function'")
        if self.format not in TOOL_CALL_FORMATS and ":" not in self.format:
            raise ValueError(f"format {self.format!r}: write {' or '.join(TOOL_CALL_FORMATS)}, or "
                             "'package.module:Class' / 'path/to/file.py:Class'")
        if self.environment is not None and ":" not in self.environment:
            raise ValueError(f"environment {self.environment!r}: write 'package.module:Class' or 'path/to/file.py:Class'")
        return self
