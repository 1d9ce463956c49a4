"""Multi-turn episodes: the Hermes tool-call format, transcripts and masks, observation tokens
through a real chat template, and the tool runner beside the decode loop."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from laminar_hpc.model.tokenizer import CharTokenizer
from laminar_hpc.rollout.tool_runner import ToolRunner
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.tools.episode import (
    EnvContext, Environment, HermesFormat, ToolCall, ToolResult, chat_tool_turn, last_turn, model_turns,
    observation_ids, pending_calls, segments, transcript,
)

TOK = CharTokenizer()
FMT = HermesFormat()


def test_hermes_parses_calls_and_says_why_a_call_is_unreadable():
    text = 'I will look.<tool_call>{"name": "calc", "arguments": {"x": "2*3"}}</tool_call>' \
           '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert FMT.parse(text) == [ToolCall("calc", {"x": "2*3"}), ToolCall("f", {"a": 1})]
    bad = FMT.parse("<tool_call>{not json}</tool_call>")
    assert len(bad) == 1 and bad[0].error.startswith("error: the tool call is not JSON")
    assert FMT.parse('<tool_call>{"arguments": {}}</tool_call>')[0].error.startswith("error: a tool call needs")
    assert FMT.parse('<tool_call>{"name": "x", "arguments": [1]}</tool_call>')[0].error == \
        "error: x: arguments must be an object"
    assert FMT.parse('<tool_call>{"name": "x"') == []  # unfinished: not a call


def test_stop_is_seen_on_the_last_tokens_and_not_after_eos():
    ids = TOK.encode('abc<tool_call>{"name":"c","arguments":{}}</tool_call>')
    assert FMT.stopped(TOK, ids)
    assert not FMT.stopped(TOK, ids[:-1])
    assert not FMT.stopped(TOK, ids + [TOK.eos_id])  # the engine finished it itself: handled as a finish
    assert FMT.turn_calls(TOK, ids + [TOK.eos_id]) == [ToolCall("c", {})]
    assert FMT.turn_calls(TOK, TOK.encode("42")) == []


def test_segments_turns_and_pending_calls_come_from_tokens_and_mask_alone():
    call = TOK.encode('<tool_call>{"name":"c","arguments":{"x":"1"}}</tool_call>') + [TOK.eos_id]
    obs = TOK.encode("<tool_response>1</tool_response>")
    tokens = call + obs + TOK.encode("1") + [TOK.eos_id]
    mask = [1] * len(call) + [0] * len(obs) + [1, 1]
    assert segments(len(tokens), mask) == [(True, 0, len(call)), (False, len(call), len(call) + len(obs)),
                                           (True, len(call) + len(obs), len(tokens))]
    assert segments(3, None) == [(True, 0, 3)] and segments(0, None) == []
    assert model_turns(mask, len(tokens)) == 2
    assert last_turn(tokens, mask) == (len(call) + len(obs), len(tokens))
    assert [m["role"] for m in transcript(TOK, tokens, mask)] == ["assistant", "tool", "assistant"]
    assert transcript(TOK, tokens, mask)[1]["content"] == "<tool_response>1</tool_response>"
    # moved right after its call was written: the call is pending and runs again where it resumes
    assert pending_calls(FMT, TOK, call, [1] * len(call)) == [ToolCall("c", {"x": "1"})]
    assert pending_calls(FMT, TOK, call + obs, mask[:len(call) + len(obs)]) == []  # observation in: none
    assert pending_calls(FMT, TOK, call[:10], None) == []  # mid-call: generation continues


def test_observation_without_a_chat_template_is_the_format_text_and_emulated_tokens_pass_through():
    ids = observation_ids(FMT, TOK, [ToolResult("6"), ToolResult("x", "error")], ended_with_eos=True)
    assert TOK.decode(ids) == "<tool_response>6</tool_response><tool_response>x</tool_response>"
    assert TOK.eos_id not in ids
    # a turn stopped at its call gets the end-of-turn token the model did not write: the same context
    stopped = observation_ids(FMT, TOK, [ToolResult("6"), ToolResult("x", "error")], ended_with_eos=False)
    assert stopped == [TOK.eos_id] + ids
    assert observation_ids(FMT, TOK, [ToolResult("", token_ids=[7, 8]), ToolResult("", token_ids=[9])],
                           ended_with_eos=False) == [7, 8, 9]


def _chatml(messages, add_generation_prompt):
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_chat_tool_turn_is_the_template_text_between_two_assistant_turns():
    turn = chat_tool_turn(_chatml, [ToolResult("6")], eos_text="<|im_end|>")
    assert turn == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"
    full = _chatml([{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"},
                    {"role": "tool", "content": "6"}], True)
    # what the model wrote (its content and end-of-turn token) + the observation = the template's text
    assert _chatml([{"role": "user", "content": "q"}], True) + "c<|im_end|>" + turn == full
    assert chat_tool_turn(_chatml, [ToolResult("6")], eos_text="").startswith("<|im_end|>\n<|im_start|>tool")


def test_chat_tool_turn_refuses_a_template_that_does_not_continue():
    def odd(messages, add_generation_prompt):
        return "X" + _chatml(messages[::-1], add_generation_prompt)
    with pytest.raises(ValueError, match="role 'tool'"):
        chat_tool_turn(odd, [ToolResult("6")], eos_text="")


class Slow(Environment):
    gate = threading.Event()

    @staticmethod
    def wait(x):
        Slow.gate.wait(10)
        return f"waited {x}"

    @staticmethod
    async def fast(x):
        return f"fast {x}"

    @staticmethod
    def boom():
        raise RuntimeError("kaboom")

    @staticmethod
    def hang():
        threading.Event().wait(30)

    @staticmethod
    def leave():
        raise SystemExit(3)

    @staticmethod
    async def leave_async():
        raise SystemExit(4)

    @staticmethod
    def not_text():
        return ToolResult(12345)

    tools = {"wait": wait, "fast": fast, "boom": boom, "hang": hang, "leave": leave, "leave_async": leave_async,
             "not_text": not_text}


@pytest.fixture
def slow_runner():
    """slow_runner(timeout_s) -> (a ToolRunner, a `Slow` environment), the gate closed; every
    runner is closed afterwards, its thread gone."""
    made = []

    def make(timeout_s: float):
        Slow.gate.clear()
        made.append(ToolRunner(max_concurrent=8, timeout_s=timeout_s, max_chars=60))
        return made[-1], Slow(Problem(0, "p", "a"), EnvContext("t", 0))

    yield make
    Slow.gate.set()
    for runner in made:
        runner.close()
        assert not runner._thread.is_alive()


def _collect(runner, n, timeout_s=10.0):
    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"waited {timeout_s}s for {n} tool results, got {sorted(got)}"
        got.update(dict(runner.finished()))
        time.sleep(0.01)
    return got


def test_the_runner_runs_episodes_concurrently_and_every_failure_becomes_an_observation(slow_runner):
    runner, env = slow_runner(0.5)
    runner.submit("slow", env, [ToolCall("wait", {"x": 1})])
    runner.submit("quick", env, [ToolCall("fast", {"x": 2}), ToolCall("nope", {}), ToolCall("boom", {}),
                                 ToolCall("", error="error: the tool call is not JSON"),
                                 ToolCall("fast", {"x": "y" * 100})])
    got = _collect(runner, 1)  # the quick episode is back while the slow one still waits
    assert set(got) == {"quick"} and runner.pending() == 1
    outcomes = [(r.outcome, r.text) for r, _, _ in got["quick"]]
    assert outcomes[0] == ("ok", "fast 2")
    assert outcomes[1][0] == "refused" and "unknown tool 'nope'" in outcomes[1][1]
    assert outcomes[2] == ("error", "error: RuntimeError: kaboom")
    assert outcomes[3] == ("error", "error: the tool call is not JSON")
    assert outcomes[4][1].startswith("fast " + "y" * 55) and "[truncated" in outcomes[4][1]
    Slow.gate.set()
    assert _collect(runner, 1)["slow"][0][0].text == "waited 1"
    runner.submit("hung", env, [ToolCall("hang", {})])
    (res, _, latency), = _collect(runner, 1)["hung"]
    assert res.outcome == "timeout" and "timed out after 0.5s" in res.text and latency >= 0.5
    # user code that calls sys.exit() or returns no text: error observations, and the loop lives on
    runner.submit("exits", env, [ToolCall("leave"), ToolCall("leave_async"), ToolCall("not_text")])
    exits = _collect(runner, 1)["exits"]
    assert [(r.outcome, r.text) for r, _, _ in exits] == [
        ("error", "error: RuntimeError: SystemExit: 3"), ("error", "error: RuntimeError: SystemExit: 4"),
        ("ok", "12345")]
    runner.submit("after", env, [ToolCall("fast", {"x": 5})])
    assert _collect(runner, 1)["after"][0][0].text == "fast 5"
    runner.submit("gone", env, [ToolCall("fast", {"x": 3})])
    assert runner.cancel("gone") and runner.pending() == 0
    assert not [t for t, _ in runner.finished() if t == "gone"]  # a cancelled episode never comes back


def test_a_cancelled_turn_s_late_result_never_answers_the_episode_s_next_turn(slow_runner):
    # an episode moves away while its call runs (cancelled), comes back, and calls again: the
    # first call's result, already on its way, must not be taken for the second's
    runner, env = slow_runner(5.0)
    runner.submit("ep", env, [ToolCall("fast", {"x": 1})])
    deadline = time.monotonic() + 5.0
    while runner._done.empty():  # until its result is queued (not yet taken)
        assert time.monotonic() < deadline, "the first call's result never came"
        time.sleep(0.001)
    assert runner.cancel("ep")
    runner.submit("ep", env, [ToolCall("wait", {"x": 2})])  # back here, waiting on the gate
    assert runner.finished() == [] and runner.pending() == 1
    Slow.gate.set()
    assert _collect(runner, 1)["ep"][0][0].text == "waited 2"


def test_an_environment_may_end_the_episode_and_async_tools_are_awaited():
    class Once(Environment):
        async def call(self, call):
            await asyncio.sleep(0)
            return "ok"

        def done(self, turn_text, calls):
            return "final" in turn_text
    env = Once(Problem(0, "p", "a"), EnvContext("t", 0))
    assert env.done("final answer", [ToolCall("x")]) and not env.done("more", [ToolCall("x")])
    assert asyncio.run(env.call(ToolCall("x"))) == "ok"


def test_one_tool_error_class_and_one_rule_for_what_the_model_reads():
    # issue 47: two ToolError classes, so two call sites compared class names
    from laminar_hpc.tasks.tools import calculator, episode
    assert calculator.ToolError is episode.ToolError

    class ToolError(Exception):  # a user's tool, written without importing laminar
        pass

    assert episode.tool_error_text(episode.ToolError("calculator: division by zero")) == "calculator: division by zero"
    assert episode.tool_error_text(ToolError("no such city")) == "no such city"
    assert episode.tool_error_text(KeyError("x")) == "KeyError: 'x'"
