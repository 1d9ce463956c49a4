"""`status.json`: the controller's live status, one typed contract for its writer and its readers.

The controller writes it every `controller.status_interval_s` (and `controller_stats.json`, the
same struct plus the ledger, at its end); the supervisor reads the role table and the `hung`
list from it, the progress display and `laminar status` the figures. Both sides go through
this struct, so a field renamed on one side cannot silently read as missing on the other.

    write_status(rd.status, status)          # atomic: readers never see half a file
    st = read_status(rd.status)              # -> Status (defaults when absent or unreadable)
"""
from __future__ import annotations

import errno
import logging
from pathlib import Path

import msgspec

from laminar_hpc.rundir import TRANSIENT_ERRORS, atomic_write_text, transient_hint

Scalar = int | float | str | bool | None


class RoleEntry(msgspec.Struct, kw_only=True):
    pid: int
    joined_t: float
    last_seen: float
    ready_t: float | None = None
    down: bool = False


class ControllerInfo(msgspec.Struct, kw_only=True):
    pid: int = 0
    t_start: float = 0.0
    ready_t: float | None = None  # serving again after a recovery
    # CPU seconds of its thread spent in work done once per wall interval (this status, the count of
    # versions in flight), whatever the traffic
    periodic_cpu_s: float = 0.0


class Utilisation(msgspec.Struct, kw_only=True):
    busy_s: float = 0.0
    weight_wait_s: float = 0.0


class Status(msgspec.Struct, kw_only=True):
    t: float = 0.0  # when written (the supervisor judges freshness by it)
    elapsed_s: float = 0.0
    phase: str = "?"  # ? (starting), warmup, rl, finishing (the trainer is done: final evaluation, stop)
    pid: int = 0
    step: int = 0
    total_steps: int | None = None
    trainer_version: int = -1
    relay_versions: dict[int, int] = {}
    rollout_versions: dict[int, int] = {}
    versions_in_flight: list[int] = []
    max_versions_in_flight: int = 0
    trajectories_per_s: float = 0.0
    trajectories_finished: int = 0
    tokens_generated: int = 0
    groups_consumed: int = 0
    groups_pending: int = 0
    groups_committed: int = 0
    groups_dropped: int = 0
    queued: int = 0
    running: int = 0
    published: int = 0
    dropped_frames: int = 0  # malformed frames, refused hellos and frames whose handling failed
    relay_dropped_frames: int = 0
    # validation where rows and frames enter (controller/validate.py) and leave (transport/framing.py)
    handler_errors: int = 0  # frames that decoded but whose handling raised (dropped, in dropped_frames too)
    prompts_refused: int = 0  # problems whose prompt cannot be generated from: never sent to a rollout
    refused_problems: list[int] = []  # the last ones refused (problem indexes of the task)
    trajectories_refused: int = 0  # results with bad tokens / lengths / log-probs or a wrong group: regenerated
    stream_items_refused: int = 0  # stream chunks with bad tokens or log-probs: ignored
    oversize_refused: int = 0  # groups or work items too big for one frame: dropped as "oversize"
    frames_split: int = 0  # messages sent as several frames to stay under controller.max_frame_mb
    repack: dict[str, int] = {}
    rollout_util: dict[int, Utilisation] = {}
    metrics: dict[str, Scalar] = {}  # the trainer's last step
    prompts_too_long: int = 0  # of prompts_refused: over task.max_prompt_tokens
    rows_skipped: int = 0  # the dataset's bad rows skipped as it loaded (task.on_bad_row: skip)
    prompt_cursor: int = 0  # problems drawn from the task so far (admitted or refused)
    epochs: float | None = None  # prompt_cursor / the dataset's training rows (None: a generated task)
    groups_dropped_by: dict[str, int] = {}  # reason -> groups (staleness, no_signal, bad_reward, ...)
    eval: dict[str, Scalar] | None = None  # the last evaluation round's row (controller/evaluation.py)
    # the running evaluation round: round, step, done (items), items; None between rounds
    evaluating: dict[str, int] | None = None
    epoch: str | None = None  # a new one means the controller restarted
    controller: ControllerInfo = msgspec.field(default_factory=ControllerInfo)
    roles: dict[str, RoleEntry] = {}
    hung: list[str] = []  # roles silent for longer than timeouts.heartbeat_s
    recovery: dict[str, int | dict[str, Scalar]] = {}
    wal_error: str | None = None  # the write-ahead log cannot be written (disk full): admission is paused
    # writes refused for a passing reason (a full disk, no free file descriptor), each retried:
    # "status", "wal", "trace", "metrics" -> failures so far
    write_failures: dict[str, int] = {}
    # the control-plane socket's monitor (transport/monitor.py): accepted, authenticated,
    # handshake_failed, closed, cut (a frame over MAXMSGSIZE), open (now)
    connections: dict[str, int] = {}
    unknown_roles: int = 0  # frames from a role name the launcher did not start (controller/membership.py)
    work_not_held: int = 0  # results and stream chunks from a rollout that does not hold that work: refused
    # rollouts that joined from jobs of their own (controller/elastic.py): rank -> relay, max_batch, kind, job, left
    elastic: dict[str, dict[str, Scalar]] = {}
    # stream shards (controller.shards, controller/shard.py): "shard-k" -> what it holds (partials,
    # finished, token_bytes) and counts (resumed, stream_items_refused, not_held, forwarded), as it
    # last reported; `relayed`: frames and batches that came through them
    shards: dict[str, dict[str, Scalar]] = {}
    relayed: dict[str, int] = {}
    # controller_stats.json only
    stop_reason: str | None = None
    ledger: dict[str, int | list[int] | dict[str, int]] | None = None  # GroupLedger.summary()


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Status)


def write_status(path: Path, status: Status) -> None:
    atomic_write_text(Path(path), _encoder.encode(status).decode())


class StatusWriter:
    """`write_status` for a role's loop: a write refused for a passing reason (no free file
    descriptor under a flood of connections, a full disk) is counted in `failures`, logged once
    until a write succeeds again, and reported as False so that the caller retries soon; any
    other error raises."""

    def __init__(self, log: logging.Logger | None = None):
        self.log = log or logging.getLogger(__name__)
        self.failures = 0
        self.error: str | None = None  # the failure while it lasts

    def write(self, path: Path, status: Status) -> bool:
        try:
            write_status(path, status)
        except OSError as err:
            if err.errno not in TRANSIENT_ERRORS:
                raise
            self.failures += 1
            if self.error is None:
                self.log.warning("cannot write %s (%s): %s", path, err.strerror, transient_hint(err))
            self.error = f"{errno.errorcode.get(err.errno, err.errno)}: {err.strerror}"
            return False
        if self.error is not None:
            self.log.warning("writing %s again (after %d failed attempts)", path, self.failures)
            self.error = None
        return True


def read_status(path: Path) -> Status:
    """The last status written, or an empty one (all defaults) when there is none yet or the
    file is not a status (a reader must not die on a file a crashed writer left)."""
    try:
        return _decoder.decode(Path(path).read_bytes())
    except (OSError, msgspec.DecodeError):
        return Status()
