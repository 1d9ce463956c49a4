"""Tool calls beside the decode loop: an asyncio event loop on its own thread.

Each episode's calls of one turn run concurrently (and with every other episode's), at most
`max_concurrent` at once, each under `timeout_s`. Whatever a call does (raises, hangs, returns
garbage) becomes a `ToolResult` the model reads, with its outcome: it never reaches the
decode loop. Plain functions run in the loop's thread pool: a hung one is abandoned at its
timeout (a thread cannot be killed; the built-in python tool is a process and is killed).

    runner = ToolRunner(max_concurrent=64, timeout_s=10, max_chars=1000)
    runner.submit("3.1", env, calls)                   # returns at once
    for traj_id, results in runner.finished(): ...     # (ToolResult, t_start, latency_s) per call
    runner.cancel("3.1"); runner.close()
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from concurrent.futures import Future

from laminar_hpc.tasks.tools.episode import Environment, ToolCall, ToolResult, tool_error_text

CLOSE_TIMEOUT_S = 5.0


class ToolRunner:
    def __init__(self, *, max_concurrent: int, timeout_s: float, max_chars: int):
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.loop = asyncio.new_event_loop()
        self._sem = asyncio.Semaphore(max_concurrent)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        # traj_id -> (ticket, future): a result counts only for the submission it answers, so a
        # cancelled turn's late result never answers a later turn of an episode that came back
        self._futures: dict[str, tuple[int, Future]] = {}
        self._tickets = itertools.count()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tool-loop", daemon=True)
        self._thread.start()

    def submit(self, traj_id: str, env: Environment, calls: list[ToolCall]) -> None:
        ticket = next(self._tickets)
        fut = asyncio.run_coroutine_threadsafe(self._turn(traj_id, ticket, env, calls), self.loop)
        self._futures[traj_id] = (ticket, fut)

    def finished(self) -> list[tuple[str, list[tuple[ToolResult, float, float]]]]:
        """Episodes whose calls all came back since the last call (cancelled ones never do)."""
        out = []
        while True:
            try:
                traj_id, ticket, results = self._done.get_nowait()
            except queue.Empty:
                return out
            if self._futures.get(traj_id, (None,))[0] == ticket:
                del self._futures[traj_id]
                out.append((traj_id, results))

    def cancel(self, traj_id: str) -> bool:
        """Forget an episode's calls (it moved away): their results are dropped."""
        entry = self._futures.pop(traj_id, None)
        if entry is not None:
            entry[1].cancel()
        return entry is not None

    def pending(self) -> int:
        return len(self._futures)

    def close(self) -> None:
        self._futures.clear()
        try:  # cancel what runs (a python tool's process group is killed by its cancellation)
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a call that ignores cancellation: the loop stops anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()

    @staticmethod
    async def _cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _turn(self, traj_id: str, ticket: int, env: Environment, calls: list[ToolCall]) -> None:
        results = await asyncio.gather(*(self._safe(env, c) for c in calls))
        self._done.put((traj_id, ticket, list(results)))

    @staticmethod
    async def _guarded(env: Environment, call: ToolCall):
        """`env.call`, with SystemExit and KeyboardInterrupt turned into errors inside its task:
        asyncio re-raises those out of the event loop, which would end the tool thread."""
        try:
            return await env.call(call)
        except (asyncio.CancelledError, Exception):
            raise
        except BaseException as err:  # noqa: BLE001 - user code calling sys.exit()
            raise RuntimeError(f"{type(err).__name__}: {err}") from None

    async def _safe(self, env: Environment, call: ToolCall) -> tuple[ToolResult, float, float]:
        """`_one`, whatever escapes it (a tool's SystemExit, a result whose text is not text)
        becoming an error observation: a turn's result always comes back."""
        t_start = time.time()
        try:
            return await self._one(env, call)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - user code: SystemExit, KeyboardInterrupt included
            return ToolResult(f"error: {call.name}: {type(err).__name__}: {err}", "error", name=call.name), t_start, 0.0

    async def _one(self, env: Environment, call: ToolCall) -> tuple[ToolResult, float, float]:
        t_start, t0 = time.time(), time.monotonic()
        if call.error is not None:
            return ToolResult(call.error, "error", name=call.name or "?"), t_start, 0.0
        async with self._sem:
            try:
                out = await asyncio.wait_for(self._guarded(env, call), self.timeout_s)
                res = out if isinstance(out, ToolResult) else ToolResult(str(out), "ok")
            except asyncio.TimeoutError:
                res = ToolResult(f"error: {call.name} timed out after {self.timeout_s:g}s", "timeout")
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the tool's or the environment's code: the model reads it
                res = ToolResult(f"error: {tool_error_text(err)}", "error")
        res.name = res.name or call.name
        res.text = res.text if isinstance(res.text, str) else str(res.text)
        if res.token_ids is None and len(res.text) > self.max_chars:
            res.text = res.text[:self.max_chars] + f"... [truncated {len(res.text) - self.max_chars} chars]"
        return res, t_start, time.monotonic() - t0
