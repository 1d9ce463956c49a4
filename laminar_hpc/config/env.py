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

The built-in tools and tool-call formats are listed in config/tool_specs.py; this section's
validator reads the lists, and a built-in tool's settings become `env.<tool>` from its entry.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from laminar_hpc.config.section import PosFloat, PosInt, Section, with_part_settings
from laminar_hpc.config.tool_specs import (  # noqa: F401 - SandboxCfg re-exported
    BUILTIN_TOOLS, TOOL_CALL_FORMATS, SandboxCfg,
)


class EnvCommon(Section):
    """The `env:` keys every episode shares; a built-in tool's own settings (`env.python`) come from
    its entry in BUILTIN_TOOLS as `EnvCfg` below."""
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


EnvCfg = with_part_settings(EnvCommon, BUILTIN_TOOLS.values(), name="EnvCfg")
