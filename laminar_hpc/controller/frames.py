"""The controller's edge: frames in (guarded handling, one log line per refusal) and frames out
(split by encoded size under `controller.max_frame_mb`, oversize items refused: transport/framing.py).

A part of the `Controller` (`ctl.frames`), with counters for status.json and no socket of its
own: the controller hands it the message handler, the data plane's refusals and what it sends.

- In: a frame that decoded but whose handler raised is counted (`handler_errors`, also in
  status.json's `dropped_frames`) and logged in one line naming its type and sender; the
  controller goes on. Refusals of the data plane (controller/validate.py) are logged one line
  each, the first LOG_FIRST of a kind, then one line per LOG_EVERY.
- Out: `outgoing` splits a message into frames each under the limit (`framing.split`); an
  item that alone exceeds it is never sent, and the groups of such items are handed back for
  the caller to drop from the ledger ("oversize"), so what the ledger says was delivered or
  assigned is what was sent. `oversize_groups` finds ready groups that could never be sent,
  before they are journalled as delivered.

    frames = Frames(log, max_frame_bytes=64 << 20, task=task)
    frames.guarded(ctl.handle, ident, msg)
    frames.log_refusals(dp.take_refusals(), ident)
    data, drop, n = frames.outgoing(ident, msg)  # encoded frames; drop: group ids to drop as "oversize";
                                                 # n: items of a SPLITTABLE message sent
"""
from __future__ import annotations

from typing import Callable

from laminar_hpc.controller.ledger import GroupLedger
from laminar_hpc.transport.framing import SPLITTABLE, encode_split, fits, item_budget
from laminar_hpc.transport.protocol import TYPE_NAMES, Groups, Message

LOG_FIRST = 20  # refusals of a kind logged one by one, then one line per LOG_EVERY
LOG_EVERY = 1000
HINT = "raise controller.max_frame_mb or lower rollout.max_new_tokens"


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


class Frames:
    def __init__(self, log, *, max_frame_bytes: int, task=None):
        self.log, self.max_frame_bytes, self.task = log, max_frame_bytes, task
        self.handler_errors = 0  # frames whose handling raised
        self.oversize = 0  # groups / work items too big for one frame
        self.frames_split = 0  # messages sent as several frames
        self.refusals_seen: dict[str, int] = {}  # kind -> refusals so far

    def row(self, problem: int) -> str:
        """Where a problem comes from, for a message about it: a dataset's file and line."""
        where = getattr(self.task, "where", None)
        if where is not None:
            return where(problem)
        n = len(self.task) if self.task is not None else 0
        return f"task row {problem % n}" if 0 < n < 2**31 else "a generated task"

    # -- in -----------------------------------------------------------------------------------------
    def guarded(self, handle: Callable[[str, Message], None], ident: str, msg: Message) -> None:
        """handle(ident, msg); if it raises, the frame counts as dropped and the role goes on."""
        try:
            handle(ident, msg)
        except Exception as err:  # noqa: BLE001 - one bad frame must never end the controller
            self.handler_errors += 1
            self.log.error("dropped a '%s' frame from %s: handling it failed (%s: %s)",
                           TYPE_NAMES.get(type(msg), "?"), ident, type(err).__name__, _one_line(err))
            self.log.debug("the failed handler's traceback", exc_info=True)

    def log_refusals(self, refusals: list[tuple[str, object, str]], ident: str = "") -> None:
        """One line per refusal (`DataPlane.take_refusals`), rate-limited per kind."""
        for kind, subject, what in refusals:
            n = self.refusals_seen[kind] = self.refusals_seen.get(kind, 0) + 1
            if n > LOG_FIRST and n % LOG_EVERY:
                continue
            more = f" [{n} {kind} refusals so far]" if n > LOG_FIRST else ""
            if kind == "prompt":
                self.log.warning("refused the prompt of problem %s (%s) at admission: %s; it is never sent to a "
                                 "rollout (fix that row, or raise model.max_seq_len)%s", subject, self.row(subject),
                                 _one_line(what, 500), more)
            else:
                self.log.warning("refused %s %s from %s: %s%s", "a stream chunk of" if kind == "stream" else
                                 "trajectory", subject, ident or "?", _one_line(what, 500), more)

    # -- out ----------------------------------------------------------------------------------------
    def outgoing(self, ident: str, msg: Message) -> tuple[list[bytes], list[int], int]:
        """The frames to send for `msg` (encoded), the groups of items too big to send at all, and
        how many items of a SPLITTABLE message the frames carry."""
        frames, refused = encode_split(msg, self.max_frame_bytes)
        if len(frames) > 1:
            self.frames_split += 1
        name = SPLITTABLE.get(type(msg))
        sent = len(getattr(msg, name)) - len(refused) if name else 0
        if not refused:
            return frames, [], sent
        gids = sorted({x.group_id for x in refused if hasattr(x, "group_id")})
        self.oversize += len(refused)
        self.log.error("not sent to %s: %d item(s) of a '%s' message exceed the %d-byte frame limit alone%s; %s",
                       ident, len(refused), TYPE_NAMES.get(type(msg), "?"), self.max_frame_bytes,
                       f" (groups {gids} dropped as oversize)" if gids else "", HINT)
        return frames, gids, sent

    def oversize_groups(self, ledger: GroupLedger, credit: int) -> list[int]:
        """The ready groups among the next `credit` to deliver that alone exceed a frame (logged,
        counted; the caller drops them, then looks again: others move up)."""
        budget = item_budget(Groups(groups=[]), self.max_frame_bytes)
        big = [g for g in list(ledger.ready)[:credit] if not fits(ledger.ready_group(g), budget)]
        for gid in big:
            self.log.error("group %d (problem %d) is over the %d-byte frame limit encoded and could never reach the "
                           "trainer: dropped as oversize (%s)", gid, ledger.groups[gid].problem, self.max_frame_bytes,
                           HINT)
        self.oversize += len(big)
        return big
