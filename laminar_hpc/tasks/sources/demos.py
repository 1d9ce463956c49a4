r"""Demonstrations for the supervised warm-up (`warmup.data`): conversations in a JSONL file, tool
calls included, in the user's own format. Imports neither torch nor a tokenizer.

One JSON object a line, `{"messages": [...]}`, each message `{"role": ..., "content": <text>}`:

    {"messages": [{"role": "user", "content": "How many units of SKU 40127 are in stock?"},
                  {"role": "assistant",
                   "content": "<tool_call>{\"name\": \"stock\", \"arguments\": {\"sku\": \"40127\"}}</tool_call>"},
                  {"role": "tool", "content": "{\"sku\": \"40127\", \"units\": 417}"},
                  {"role": "assistant", "content": "417"}]}

A conversation is a prompt (an optional `system` message first, then `user` messages) and an
episode: `assistant` turns; a turn that calls tools (in `env.format`, Hermes by default) ends
with its call and is followed by one `tool` message per call (the tool's result); the last turn
calls nothing. The warm-up learns the assistant turns (tasks/sources/demo_tokens.py renders them as
RL's episodes are); the prompt and the tool results are context.

    demos = load_demos("demos.jsonl", env_cfg)     # DemoError: `lines`, one per bad row
    demos[0].prompt, demos[0].episode               # the messages before / from the first assistant turn
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from laminar_hpc.config.env import EnvCfg

MAX_LISTED = 20  # bad rows named one a line; the rest are counted


class DemoError(ValueError):
    """A demonstrations file that cannot be used: `lines` holds one line per bad row (file, line,
    field, what to do), the message the first of them and how many there are."""

    def __init__(self, lines: list[str], total: int | None = None):
        total = len(lines) if total is None else total
        super().__init__(lines[0] + (f" (and {total - 1} more bad rows)" if total > 1 else ""))
        self.lines, self.total = lines, total


@dataclass(frozen=True)
class Demo:
    line: int  # in the file, from 1
    prompt: tuple[dict[str, str], ...]  # system? + user messages
    episode: tuple[dict[str, str], ...]  # assistant turns and tool results, ending with an assistant turn

    @property
    def tool_calls(self) -> int:
        return sum(1 for m in self.episode if m["role"] == "tool")


class _Bad(Exception):
    def __init__(self, field: str, what: str, fix: str):
        super().__init__(what)
        self.field, self.what, self.fix = field, what, fix


ALLOWED_KEYS = {"role", "content", "name", "tool_call_id"}  # name, tool_call_id: OpenAI-style tool messages, ignored


def hermes_calls(fmt) -> Callable[[str], tuple[list, bool]]:
    """(the calls a turn's text makes, whether the text ends with a call) by a format that reads
    text (`parse`, `ends_with_call`: tasks.tools.episode.HermesFormat)."""
    return lambda text: (fmt.parse(text), fmt.ends_with_call(text))


def check_demo(number: int, record: Any, *, calls_of: Callable[[str], tuple[list, bool]] | None,
               tools: set[str] | None, max_turns: int, one_call_a_turn: bool) -> Demo:
    """The row as a Demo, or _Bad naming the field. `calls_of`: None when the run has no tools
    (a demo may then make no call); `tools`: the names the model may call (None: any)."""
    if not isinstance(record, dict) or "messages" not in record:
        raise _Bad("messages", f"expected an object with 'messages', got {_shown(record)}",
                   'write each line as {"messages": [{"role": ..., "content": ...}, ...]}')
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _Bad("messages", f"is {_shown(messages)}, not a non-empty list of messages",
                   "give the conversation as a list of {role, content} messages")
    roles = []
    for k, m in enumerate(messages):
        at = f"messages[{k}]"
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise _Bad(at, f"is {_shown(m)}, not a {{'role': ..., 'content': <text>}} message",
                       "give every message a role and a content")
        if "tool_calls" in m:
            raise _Bad(f"{at}.tool_calls", "structured tool calls are not read",
                       "write the call in the content, as the model writes it: "
                       '<tool_call>{"name": ..., "arguments": {...}}</tool_call>')
        if extra := sorted(set(m) - ALLOWED_KEYS):
            raise _Bad(at, f"has keys {', '.join(extra)} besides role and content", "remove them")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise _Bad(f"{at}.role", f"is {m['role']!r}", "use system, user, assistant or tool")
        if not isinstance(m["content"], str):
            raise _Bad(f"{at}.content", f"is {type(m['content']).__name__}, not text", "write the content as text")
        roles.append(m["role"])
    first = roles.index("assistant") if "assistant" in roles else len(roles)
    for k, role in enumerate(roles[:first]):
        if role == "system" and k > 0:
            raise _Bad(f"messages[{k}].role", "is system after the first message", "put the system message first")
        if role == "tool":
            raise _Bad(f"messages[{k}].role", "is tool before any assistant turn called a tool",
                       "put tool results after the assistant turn whose call they answer")
    if "user" not in roles[:first]:
        raise _Bad("messages", "has no user message before the first assistant turn",
                   "begin the conversation with the prompt, as a user message")
    if first == len(roles):
        raise _Bad("messages", "has no assistant message: nothing to learn", "end the conversation with the answer, "
                   "as an assistant message")
    k, turns, pending = first, 0, 0
    while k < len(roles):
        m, at = messages[k], f"messages[{k}]"
        if m["role"] in ("system", "user"):
            raise _Bad(f"{at}.role", f"is {m['role']} after the first assistant turn (an episode holds assistant "
                       "turns and tool results only)", "keep system and user messages before the first assistant turn")
        if m["role"] == "tool":
            if pending == 0:
                raise _Bad(f"{at}.role", "is a tool result no call asked for (one tool message per call)",
                           "remove it, or make the assistant turn before it call the tool")
            pending -= 1
            k += 1
            continue
        if pending:
            raise _Bad(f"{at}.role", f"is assistant, but the turn before made {pending} more call(s) than tool "
                       "results follow it", "add one tool message per call after the calling turn")
        turns += 1
        calls, ends = calls_of(m["content"]) if calls_of is not None else ([], False)
        if calls and calls_of is not None:
            _check_calls(at, calls, ends, tools, one_call_a_turn)
        elif calls_of is None and "<tool_call>" in m["content"]:
            raise _Bad(f"{at}.content", "makes a tool call, but the run has no tools",
                       "set env.tools (or env.environment), or remove the call")
        pending = len(calls)
        k += 1
    if pending:
        raise _Bad(f"messages[{len(roles) - 1}]", "is a turn that calls a tool, with no result and no answer after it",
                   "add the tool's result and the final answer")
    if turns > max_turns and calls_of is None:
        raise _Bad("messages", f"holds {turns} assistant turns, and a run without tools answers in one",
                   "merge them into one assistant message, or set env.tools")
    if turns > max_turns:
        raise _Bad("messages", f"holds {turns} assistant turns, more than the {max_turns} an episode may have "
                   "(env.max_turns)", "shorten the demonstration, or raise env.max_turns")
    return Demo(number, tuple(_pair(m) for m in messages[:first]), tuple(_pair(m) for m in messages[first:]))


def _check_calls(at: str, calls: list, ends: bool, tools: set[str] | None, one_call_a_turn: bool) -> None:
    for c in calls:
        if c.error is not None:
            raise _Bad(f"{at}.content", f"holds a call the runtime cannot read ({c.error.removeprefix('error: ')})",
                       'write it as <tool_call>{"name": <tool>, "arguments": {...}}</tool_call>')
        if tools is not None and c.name not in tools:
            raise _Bad(f"{at}.content", f"calls {c.name!r}, which env.tools does not name "
                       f"(tools: {', '.join(sorted(tools)) or 'none'})", "call one of them, or add it to env.tools")
    if not ends:
        raise _Bad(f"{at}.content", "goes on after its tool call (a turn stops at its call)",
                   "end the assistant message with the call; write the rest after the tool result")
    if one_call_a_turn and len(calls) > 1:
        raise _Bad(f"{at}.content", f"makes {len(calls)} calls in one turn, and a turn stops at its first "
                   "(env.stop_at_call: true)", "split them into turns, or set env.stop_at_call: false")


def _pair(m: dict) -> dict[str, str]:
    return {"role": m["role"], "content": m["content"]}


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, (set, bytes)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_demos(path: str | Path, env_cfg: EnvCfg | None = None, *,
               calls_of: Callable[[str], tuple[list, bool]] | None = None, key: str = "warmup.data") -> list[Demo]:
    """Every demonstration of a JSONL file, checked against the run's `env:` section (its tools,
    format, max_turns, stop_at_call). DemoError with one line per bad row; `calls_of` reads a
    turn's calls for a format that only reads tokens (default: the format's `parse`)."""
    from laminar_hpc.tasks.sources.row_files import BadRow, DatasetError, read_jsonl
    p = Path(path)
    if not p.is_file():
        where = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
        raise DemoError([f"{key}: {p}: no such file{where}; set {key} to a JSONL file of demonstrations"])
    enabled = env_cfg is not None and env_cfg.enabled
    tools = None
    if enabled and calls_of is None:
        from laminar_hpc.tasks.tools.loader import load_format
        fmt = load_format(env_cfg)
        if not (callable(getattr(fmt, "parse", None)) and callable(getattr(fmt, "ends_with_call", None))):
            raise DemoError([f"{key}: env.format {env_cfg.format!r} reads calls from tokens only; the warm-up "
                             "needs parse(text) and ends_with_call(text) to read a demonstration's calls"])
        calls_of = hermes_calls(fmt)
    if enabled and env_cfg.environment is None:
        from laminar_hpc.tasks.tools.loader import load_environment
        tools = set(load_environment(env_cfg).tools)
    demos, bad, total = [], [], 0
    try:
        for number, record in read_jsonl(p):
            try:
                if isinstance(record, BadRow):
                    raise _Bad("(the line)", record.what, record.fix)
                demos.append(check_demo(number, record, calls_of=calls_of if enabled else None, tools=tools,
                                        max_turns=env_cfg.max_turns if enabled else 1,
                                        one_call_a_turn=enabled and env_cfg.stop_at_call))
            except _Bad as err:
                total += 1
                if len(bad) < MAX_LISTED:
                    bad.append(f"{key}: {p} line {number}: {err.field} {err.what}; {err.fix}")
    except DatasetError as err:
        raise DemoError([f"{key}: {err}"]) from None
    if total > len(bad):
        bad.append(f"{key}: {p}: {total - len(bad)} more bad rows not listed")
    if bad:
        raise DemoError(bad, total)
    if not demos:
        raise DemoError([f"{key}: {p} holds no demonstrations; write one JSON object a line, "
                         '{"messages": [...]}'])
    return demos


__all__ = ["Demo", "DemoError", "check_demo", "load_demos"]
