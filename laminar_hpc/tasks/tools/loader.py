"""Tools and environments named in the `env:` config, loaded for a rollout.

Built-in tools are config/env.py's BUILTIN_TOOLS (the only list), each built by its builder
here: `calculator` (tasks/tools/calculator.py: arithmetic, no eval) and `python` (tasks/sandbox/python_tool.py: a
subprocess with CPU, memory and wall limits and no network). User tools
are `package.module:function` or `path/to/file.py:function`, plain or async, called with the
call's arguments as keywords and returning text; an environment is `module:Class`, a
subclass of `tasks.tools.episode.Environment`.

    env_cls = load_environment(cfg.env)          # raises ValueError naming the key on bad input
    env = env_cls(problem, EnvContext(traj_id="3.1", seed=0, args=cfg.env.args))
"""
from __future__ import annotations

import os
from typing import Any, Callable

from laminar_hpc.config.backend_specs import resolve
from laminar_hpc.config.env import EnvCfg
from laminar_hpc.config.tool_specs import BUILTIN_TOOLS, TOOL_CALL_FORMATS
from laminar_hpc.tasks.tools.episode import Environment, ToolResult


def calculator_tool(**arguments: Any) -> str:
    """The calculator, however the model names its one argument ("x", "expression", ...)."""
    from laminar_hpc.tasks.tools.calculator import ToolError, calculate
    if len(arguments) != 1:
        raise ToolError(f"calculator: give one argument, the expression (got {len(arguments)})")
    (expression,) = arguments.values()
    return calculate(str(expression))


def python_tool(limits) -> Callable[..., Any]:
    """The sandboxed Python executor with `env.python`'s limits; its result's outcome is kept."""
    from laminar_hpc.tasks.sandbox.python_tool import SandboxLimits, run_python
    lim = SandboxLimits(cpu_s=limits.cpu_s, mem_mb=limits.mem_mb, wall_s=limits.wall_s,
                        max_output_chars=limits.max_output_chars, max_processes=limits.max_processes,
                        disk_mb=limits.disk_mb)

    async def python(code: str = "", **extra: Any) -> ToolResult:
        if extra or not isinstance(code, str):
            return ToolResult("error: python takes one argument, code (a string)", "error", name="python")
        res = await run_python(code, lim)
        outcome = "ok" if res.outcome == "ok" else ("timeout" if res.outcome == "timeout" else "error")
        return ToolResult(res.text, outcome, name="python")
    return python


def calculator_builder(cfg: EnvCfg) -> Callable[..., Any]:
    """The `calculator` built-in (config/env.py: BUILTIN_TOOLS); it takes no settings."""
    return calculator_tool


def python_builder(cfg: EnvCfg) -> Callable[..., Any]:
    """The `python` built-in (config/env.py: BUILTIN_TOOLS), with `env.python`'s limits."""
    return python_tool(_Limits(cfg))


class _Limits:
    def __init__(self, cfg: EnvCfg):
        self.cpu_s, self.mem_mb, self.wall_s = cfg.python.cpu_s, cfg.python.mem_mb, cfg.python.wall_s
        self.max_processes, self.disk_mb = cfg.python.max_processes, cfg.python.disk_mb
        self.max_output_chars = max(200, cfg.observation_max_chars)  # the sandbox's floor; the runner cuts to the config


def load_object(spec: str, key: str, what: str, base_dir: str | os.PathLike | None = None) -> Any:
    """The object `spec` ('package.module:name' or 'path/to/file.py:name') names; ValueError
    naming `key` when it cannot be loaded."""
    from laminar_hpc.tasks.rewards.scorer import RewardError, load_user_module
    head = f"{key} {spec!r}"
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{head}: write 'package.module:{what}' or 'path/to/file.py:{what}'")
    try:
        module = load_user_module(head, target, base_dir)
    except RewardError as err:
        raise ValueError(str(err)) from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{head}: {target} defines no {attr!r}; define the {what} there or fix the name after ':'")
    return obj


def load_tools(cfg: EnvCfg, base_dir: str | os.PathLike | None = None) -> dict[str, Callable[..., Any]]:
    """env.tools as name -> callable."""
    tools: dict[str, Callable[..., Any]] = {}
    for name, spec in cfg.tools.items():
        if spec in BUILTIN_TOOLS:
            tools[name] = resolve(BUILTIN_TOOLS[spec].builder)(cfg)
        else:
            fn = load_object(spec, f"env.tools.{name}", "function", base_dir)
            if not callable(fn):
                raise ValueError(f"env.tools.{name} {spec!r}: a {type(fn).__name__}, not a function")
            tools[name] = fn
    return tools


def load_format(cfg: EnvCfg, base_dir: str | os.PathLike | None = None):
    """An instance of env.format: a built-in (config/env.py: TOOL_CALL_FORMATS), or the user's class."""
    if cfg.format in TOOL_CALL_FORMATS:
        return resolve(TOOL_CALL_FORMATS[cfg.format].cls)()
    cls = load_object(cfg.format, "env.format", "Class", base_dir)
    missing = [m for m in ("stopped", "turn_calls", "observation_text") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"env.format {cfg.format!r}: a tool-call format needs the methods {', '.join(missing)} "
                         "(see laminar_hpc.tasks.tools.episode.HermesFormat)")
    return cls()


def load_environment(cfg: EnvCfg, base_dir: str | os.PathLike | None = None) -> type[Environment]:
    """The episode's environment class: env.environment with env.tools added to its own, or the
    plain tool environment."""
    tools = load_tools(cfg, base_dir)
    base: type = Environment
    if cfg.environment is not None:
        base = load_object(cfg.environment, "env.environment", "Class", base_dir)
        if not (isinstance(base, type) and issubclass(base, Environment)):
            raise ValueError(f"env.environment {cfg.environment!r}: not a subclass of "
                             "laminar_hpc.tasks.tools.episode.Environment")
    if not tools:
        return base
    return type(base.__name__, (base,), {"tools": {**getattr(base, "tools", {}), **tools}})
