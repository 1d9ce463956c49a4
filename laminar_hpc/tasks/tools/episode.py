"""Multi-turn episodes: the environment interface, the tool-call format, and transcripts.

An episode starts from a problem. The model generates one turn; if the turn ends with tool
calls in the format (Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
the environment runs them and its observations are appended as tokens the model did not
generate (loss mask 0); the model then goes on. The episode ends when a turn has no call (or
the environment says `done`), or at `task.env.max_turns` / the token limit. The reward is the
task's reward (tasks/rewards/scorer.py) of the last turn, with the whole transcript in
`Response.messages`.

An episode's whole state is its token list and mask: turn boundaries are where the mask
changes, and a turn that ends with a call and no observation after it is a pending call. So a
partial episode moved to another rollout (repack, recovery) carries everything it needs.

    class Lookup(Environment):                  # user code: task.env.environment: "mymod:Lookup"
        tools = {"lookup": lambda key: TABLE[key]}   # sync or async functions; str results

    fmt = HermesFormat()
    calls = fmt.parse('<tool_call>{"name": "calc", "arguments": {"x": "2*3"}}</tool_call>')
    obs = observation_ids(fmt, tok, [ToolResult("6")], ended_with_eos=False)
"""
from __future__ import annotations

import asyncio
import inspect
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from laminar_hpc.tasks.problem import Problem

OUTCOMES = ("ok", "error", "timeout", "refused")


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the model's call could not be read: this is its observation


@dataclass
class ToolResult:
    text: str
    outcome: str = "ok"  # one of OUTCOMES: the model sees `text` whatever the outcome
    token_ids: list[int] | None = None  # an observation given as tokens (emulated tools)
    name: str = ""


class ToolError(Exception):
    """A tool's refusal the model should read (bad arguments, ...): outcome "error". The one class
    of the package (the calculator raises it too); a user's tool may define its own of this name."""


def tool_error_text(err: Exception) -> str:
    """What the model reads of an exception a tool raised: a ToolError's message as written (ours,
    or any tool's own class of that name, for tools written without importing laminar), else the
    exception's type and message."""
    if isinstance(err, ToolError) or type(err).__name__ == "ToolError":
        return str(err)
    return f"{type(err).__name__}: {err}"


@dataclass
class EnvContext:
    traj_id: str
    seed: int
    args: Mapping[str, Any] = field(default_factory=dict)  # task.env.args


class Environment:
    """One episode's environment, made per episode as `cls(problem, ctx)`.

    Override `tools` (name -> function of the call's arguments returning text; plain or async),
    or `call` for full control, and `done` to end an episode on your own rule. An environment
    must be rebuildable from the transcript (`restore`): a moved episode gets a fresh instance."""

    tools: Mapping[str, Callable[..., Any]] = {}

    def __init__(self, problem: Problem, ctx: EnvContext):
        self.problem, self.ctx = problem, ctx

    async def call(self, call: ToolCall) -> ToolResult | str:
        fn = self.tools.get(call.name)
        if fn is None:
            names = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(f"error: unknown tool {call.name!r} (tools: {names})", "refused", name=call.name)
        if isinstance(fn, staticmethod):  # `tools = {"f": f}` written in the class body
            fn = fn.__func__
        if inspect.iscoroutinefunction(fn):
            out = await fn(**call.arguments)
        else:  # a plain function runs in a thread: the event loop (other calls) goes on
            out = await in_daemon_thread(fn, **call.arguments)
            if inspect.isawaitable(out):
                out = await out
        return out if isinstance(out, ToolResult) else str(out)

    def done(self, turn_text: str, calls: list[ToolCall]) -> bool:
        """Whether the episode ends after this model turn (default: a turn without calls)."""
        return not calls

    def restore(self, messages: list[dict[str, str]]) -> None:
        """Rebuild state from the transcript so far (a resumed episode). Default: stateless."""


async def in_daemon_thread(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """`fn(**kwargs)` on a daemon thread of its own, awaited. Not the loop's thread pool: a tool
    that hangs is abandoned at its timeout, and a pool's worker would then block the process's
    exit (the pool joins its threads at exit); a daemon thread does not."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(value: Any, err: BaseException | None) -> None:
        if fut.done():  # cancelled at its timeout
            return
        if err is None:
            fut.set_result(value)
        else:
            fut.set_exception(err)

    def run() -> None:
        try:
            value, err = fn(**kwargs), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting call
            value, err = None, e
        except BaseException as e:  # noqa: BLE001 - sys.exit() in a tool: an error, never the loop's end
            value, err = None, RuntimeError(f"{type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(settle, value, err)
        except RuntimeError:  # the loop closed meanwhile
            pass

    threading.Thread(target=run, name="tool", daemon=True).start()
    return await fut


class HermesFormat:
    """Hermes / Qwen tool calls: `<tool_call>{json}</tool_call>` blocks in the assistant's turn,
    observations as `<tool_response>...</tool_response>` (in a `tool` message where the tokenizer
    has a chat template)."""

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    stop_text = close_tag  # a turn that writes this has made its call: it leaves the decode batch

    def parse(self, text: str) -> list[ToolCall]:
        calls, pos = [], 0
        while (start := text.find(self.open_tag, pos)) >= 0:
            end = text.find(self.close_tag, start)
            if end < 0:
                break  # an unfinished block is not a call
            body = text[start + len(self.open_tag):end].strip()
            pos = end + len(self.close_tag)
            calls.append(self._call(body))
        return calls

    def _call(self, body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except ValueError as err:
            return ToolCall("", error=f"error: the tool call is not JSON ({err.msg} at {err.pos})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", error='error: a tool call needs {"name": <str>, "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            return ToolCall(obj["name"], error=f"error: {obj['name']}: arguments must be an object")
        return ToolCall(obj["name"], args)

    def ends_with_call(self, text: str) -> bool:
        return text.rstrip().endswith(self.close_tag)

    # -- what the rollout asks, on token ids (an emulated format answers from ids alone) -------
    def stopped(self, tok, ids: list[int]) -> bool:
        """Whether a turn whose tokens end with `ids` has just written its call (checked after
        each decode step on the last tokens: the sequence then leaves the decode batch)."""
        return ids[-1:] != [tok.eos_id] and tok.decode(ids[-16:]).endswith(self.close_tag)

    def turn_calls(self, tok, ids: list[int]) -> list[ToolCall]:
        """The calls a finished model turn ends with ([]: a final answer, the episode ends)."""
        text = tok.decode(ids)
        return self.parse(text) if self.ends_with_call(text) else []

    def observation_text(self, results: list[ToolResult]) -> str:
        """Observations for a tokenizer without a chat template (the model sees exactly this)."""
        return "".join(f"<tool_response>{r.text}</tool_response>" for r in results)


def observation_ids(fmt, tok, results: list[ToolResult], *, ended_with_eos: bool) -> list[int]:
    """The tokens appended after a model turn that made calls: the results as the model's chat
    template writes tool messages (the rest of the assistant's turn, the tool turn, the next
    assistant header), or `fmt.observation_text` for a tokenizer without one; results given
    as tokens (emulated tools) go in as they are."""
    if all(r.token_ids is not None for r in results):
        return [t for r in results for t in r.token_ids]
    chat = getattr(tok, "chat_render", None)
    if chat is None:  # the turn ends with the end-of-turn token, written by the model or here (mask 0):
        # a turn stopped at its call reads the same as one that ended itself, as in the warm-up's demonstrations
        return ([] if ended_with_eos else [tok.eos_id]) + tok.encode(fmt.observation_text(results))
    return tok.encode(chat_tool_turn(chat, results, eos_text=tok.eos_text if ended_with_eos else ""))


def chat_tool_turn(render: Callable[[list[dict], bool], str], results: list[ToolResult], *, eos_text: str) -> str:
    """The text a chat template puts between an assistant turn's content and the next
    assistant turn's content when tool messages come in between, found by rendering a probe
    conversation with and without them. `eos_text`: what the model already wrote of the
    turn's end (its end-of-turn token)."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "\x00"}]
    before = render(probe, False)
    tools = [{"role": "tool", "content": r.text} for r in results]
    after = render(probe + tools, True)
    if not after.startswith(before) or "\x00" not in before:
        raise ValueError("the chat template does not render tool messages after the conversation "
                         "as a continuation; use a tokenizer whose template supports role 'tool'")
    turn_end = before[before.index("\x00") + 1:]  # e.g. "<|im_end|>\n"
    if eos_text and turn_end.startswith(eos_text):
        turn_end = turn_end[len(eos_text):]
    return turn_end + after[len(before):]


def segments(n_tokens: int, mask: list[int] | None) -> list[tuple[bool, int, int]]:
    """(model's, start, end) runs of a token list by its loss mask (None: one model run)."""
    if mask is None:
        return [(True, 0, n_tokens)] if n_tokens else []
    out, start = [], 0
    for i in range(1, n_tokens + 1):
        if i == n_tokens or mask[i] != mask[start]:
            out.append((mask[start] == 1, start, i))
            start = i
    return out


def transcript(tok, tokens: list[int], mask: list[int] | None) -> list[dict[str, str]]:
    """The episode as messages: assistant turns and tool observations, decoded."""
    return [{"role": "assistant" if mine else "tool", "content": tok.decode(tokens[a:b])}
            for mine, a, b in segments(len(tokens), mask)]


def last_turn(tokens: list[int], mask: list[int] | None) -> tuple[int, int]:
    """[start, end) of the episode's last model turn (empty when it ends with an observation)."""
    segs = segments(len(tokens), mask)
    if segs and segs[-1][0]:
        return segs[-1][1], segs[-1][2]
    return len(tokens), len(tokens)


def model_turns(mask: list[int] | None, n_tokens: int) -> int:
    return sum(1 for mine, _, _ in segments(n_tokens, mask) if mine)


def pending_calls(fmt, tok, tokens: list[int], mask: list[int] | None) -> list[ToolCall]:
    """The calls of a last model turn that ended with a call and has no observation yet (an
    episode that moved while its tools were running): they run again where it resumes."""
    a, b = last_turn(tokens, mask)
    return fmt.turn_calls(tok, tokens[a:b]) if b > a else []
