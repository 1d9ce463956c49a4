"""What a rollout streams to the controller's partial-response pool, and what its results then
carry: a component of `Rollout` (rollout/main.py), given the `send` of its control channel, its
episodes (their loss masks and tool counts travel with the chunks) and `version(traj_id)`, the
weight version generating that trajectory's tokens (the engine's, or with several adapter versions
in one engine, the trajectory's own).

Each token crosses the wire once (protocol 7). New tokens wait in `buf` until `flush` sends them
as one frame (protocol.stream_frame: columns), each chunk at `offset`, the tokens of its
trajectory the pool holds already (`streamed`). A finished trajectory's result is its tail: the
tokens after what the streams delivered, without the prompt (`result`: protocol.finished_tail). A
controller that restarted may lack chunks sent before it went down: what the rollout held then
finishes whole (`controller_restarted`).

    out = StreamOut(send=ctrl.send, episodes=episodes, version=lambda traj_id: engine.version)
    out.started("3.1", resumed=0); out.add("3.1", [5, 9], [-0.1, -0.2]); out.flush()
    out.finished("3.1"); ctrl.send(Finished(trajectory=out.result(traj)))
(The controller's intake of these streams is controller/stream_intake.py.)
"""
from __future__ import annotations

from typing import Callable

from laminar_hpc.transport.protocol import (Message, StreamItem, Trajectory, finished_tail, packed,
                                            stream_frame)


class StreamOut:
    """A rollout's side of the partial-response pool: tokens buffered, streamed, and its results' tails."""

    def __init__(self, send: Callable[[Message], None], episodes, version: Callable[[str], int]):
        self.send, self.episodes, self.version = send, episodes, version
        self.buf: dict[str, tuple[list[int], list[float]]] = {}  # tokens not streamed yet
        self.streamed: dict[str, int] = {}  # tokens of each trajectory the partial-response pool holds
        # a finished one's tokens the pool holds (its result carries the rest), until its result goes out
        self.delivered: dict[str, int] = {}
        self.resend_whole: set[str] = set()  # held when the controller restarted: results go whole
        self.steps_since_flush = 0

    def started(self, traj_id: str, resumed: int) -> None:
        """`traj_id` entered the engine with `resumed` tokens, which the pool holds (it sent them)."""
        self.streamed[traj_id] = resumed

    def add(self, traj_id: str, tokens: list[int], logprobs: list[float]) -> None:
        """Tokens of a trajectory for its next chunk."""
        toks, lps = self.buf.setdefault(traj_id, ([], []))
        toks.extend(tokens)
        lps.extend(logprobs)

    def forget(self, traj_id: str) -> None:
        """`traj_id` left the engine: its result or its partial carries every token from here."""
        self.buf.pop(traj_id, None)
        self.streamed.pop(traj_id, None)

    def finished(self, traj_id: str) -> None:
        """Its sequence ended (before `forget`): its result will carry what the pool lacks."""
        whole = traj_id in self.resend_whole
        self.resend_whole.discard(traj_id)
        self.delivered[traj_id] = 0 if whole else self.streamed.get(traj_id, 0)

    def result(self, traj: Trajectory) -> Trajectory:
        """What goes out for a finished `traj` (whole tokens): its tail, packed."""
        return finished_tail(packed(traj), self.delivered.pop(traj.traj_id, 0))

    def controller_restarted(self, running: list[str], scored: list[str]) -> None:
        """The restarted controller's pool may lack chunks: what runs (`running`) or waits for its
        reward (`scored`) finishes whole."""
        self.resend_whole.update(running)
        self.delivered.update(dict.fromkeys(scored, 0))

    def flush(self) -> None:
        """Send every buffered token: one frame, each chunk at the offset the pool holds."""
        items = []
        episodes = self.episodes
        for t, (toks, lps) in self.buf.items():
            if toks:
                offset = self.streamed.get(t, 0)
                item = StreamItem(traj_id=t, tokens=toks, logprobs=lps, version=self.version(t), offset=offset)
                if episodes.enabled:
                    ep = episodes.fields(t, offset + len(toks))
                    item.mask = episodes.chunk_mask(t, offset, len(toks))
                    item.tool_calls, item.tool_errors = ep.get("tool_calls"), ep.get("tool_errors")
                items.append(item)
                self.streamed[t] = offset + len(toks)
        if items:
            self.send(stream_frame(items))  # in columns, token arrays as bytes
        self.buf = {t: ([], []) for t in self.buf}
        self.steps_since_flush = 0
