"""The control-plane message protocol: one typed msgspec struct per message type.

Every frame is a msgpack map whose `type` field names its struct (a tagged union). `decode`
enforces the size limit and every field's type in one pass (in C); a frame that does not fit
raises `DecodeError`, which receivers count and drop: a bad frame never crashes a role.
Unknown fields are ignored, so a newer sender's extra field does not break an older receiver;
incompatible changes bump `PROTOCOL_VERSION`, which travels in `Hello` and is checked by the
controller (`version_mismatch`). Senders keep their frames under the receiver's limit with
`framing.split`: a message with a list of items over the limit goes as several of the same type.

The shapes that travel inside messages (`Trajectory`, `WorkItem`, `StreamItem`, `StreamChunks`,
`Group`) are defined once in transport/items.py and importable from here. A rollout streams the
chunks of all its sequences as one `StreamChunks` (columns: ids, offsets, counts and one buffer of
tokens; `stream_frame` builds it), so the controller handles a frame's chunks with a few buffer
operations instead of one struct each.

    frame = encode(WantWork(credit=8, version=3))
    msg = decode(frame)          # -> WantWork(credit=8, version=3), or DecodeError
    Finished(trajectory=packed(traj)); traj.n_tokens, traj.token_list()
    match msg:
        case WantWork(credit=c): ...
"""
from __future__ import annotations

from typing import Union

import msgspec

# the token-array helpers (transport/tokens.py), here too: every sender and receiver imports the protocol
from laminar_hpc.transport.tokens import LOGPROB_DTYPE, TOKEN_DTYPE, LogProbs, TokenIds  # noqa: F401
from laminar_hpc.transport.tokens import logprob_array, logprob_list, pack_items, pack_logprobs  # noqa: F401
from laminar_hpc.transport.tokens import pack_tokens, packed, same_tokens, token_array  # noqa: F401
from laminar_hpc.transport.tokens import token_count, token_list, unpacked  # noqa: F401

# the shapes inside the messages (transport/items.py), here too: every sender and receiver imports the protocol
from laminar_hpc.transport.items import Group, StreamChunks, StreamItem, Trajectory, WorkItem  # noqa: F401
from laminar_hpc.transport.items import finished_tail, record_version, span_versions  # noqa: F401

MAX_FRAME_BYTES = 64 << 20
# 1: the untyped dict protocol (no `protocol` in hello); 3: `Drops`; 4: version spans; 5: token arrays as bytes;
# 6: elastic capacity (`Join`, `Joined`, `Leaving`) and the joiners' leaf relays (`Leaf*`); 7: a finished
# trajectory carries only the tokens its stream frames did not deliver (`Trajectory.offset`), no prompt;
# 8: groups the trainer dropped as too stale go with the request that replaces them (`WantGroups.stale`);
# 9: stream shards (controller/shard.py): a rollout's frames reach the controller through its shard
# (`Relayed`), finished trajectories as metadata held at a shard (`Trajectory.shard`), fetched by id
# (`Fetch`, `Fetched`); `WantGroups.lost`
PROTOCOL_VERSION = 9

# values of the free-form maps (train metrics, log-event fields): scalars only, so that a frame
# that decodes can always be written to status.json
Scalar = Union[int, float, str, bool, None]


class DecodeError(ValueError):
    """A frame that does not follow the protocol (too big, not msgpack, wrong fields)."""


class Message(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base of every frame; the subclass's tag is the frame's `type`."""


# -- any role -> controller ------------------------------------------------------------------
class Hello(Message, tag="hello"):
    role: str
    rank: int
    pid: int
    protocol: int = 1  # roles of the untyped protocol sent none


class Heartbeat(Message, tag="heartbeat"):
    """role -> controller with its pid (a restarted controller learns who is there); controller ->
    role with its epoch (a role that sees a new epoch re-sends its state) and the `t` it answers."""
    t: float
    pid: int | None = None
    epoch: str | None = None
    echo: float | None = None
    # controller -> role: seconds since the trainer's loop last sent anything but a heartbeat (a
    # warm-up reports its steps): a rollout waiting for its first weights waits while it progresses
    trainer_quiet_s: float | None = None


class LogEvent(Message, tag="log_event"):
    event: str
    fields: dict[str, Scalar]


# -- rollout -> controller -------------------------------------------------------------------
class WantWork(Message, tag="want_work"):
    credit: int  # slots freed since the last ask
    version: int


class Stream(Message, tag="stream"):
    items: list[StreamItem] = []  # chunks one by one (episodes: with their masks and tool counts)
    chunks: StreamChunks | None = None  # the others, in columns (`stream_frame`)


class Finished(Message, tag="finished"):
    trajectory: Trajectory


class WeightsLoaded(Message, tag="weights_loaded"):
    version: int
    pull_s: float


class Resync(Message, tag="resync"):
    """To a restarted controller: the trajectories this rollout holds and its free slots."""
    held: list[str]
    free: int
    version: int
    pid: int


class RolloutState(Message, tag="rollout_state"):
    """Batch and KV of a replica (the rollout manager's repack input) and utilisation (wall s)."""
    version: int
    waiting: int
    running: int
    kv_tokens: int
    kv_peak: int
    traj_ids: list[str]
    busy_s: float
    weight_wait_s: float


class Migrated(Message, tag="migrated"):
    dest: int  # repack: running trajectories handed back, for replica `dest`
    trajectories: list[Trajectory]


class MigrateReject(Message, tag="migrate_reject"):
    traj_ids: list[str]  # repack work whose version this replica no longer holds


# -- controller -> rollout -------------------------------------------------------------------
class Assign(Message, tag="assign"):
    work: list[WorkItem]


class Migrate(Message, tag="migrate"):
    traj_ids: list[str]
    dest: int  # repack: hand these to replica `dest`


class UpdateWeights(Message, tag="update_weights"):
    version: int  # barrier modes, partial-rollout: load this version (or newer) now


class Resume(Message, tag="resume"):
    version: int  # partial-rollout: every rollout holds this version: continue


# -- controller -> trainer -------------------------------------------------------------------
class WeightsSynced(Message, tag="weights_synced"):
    version: int  # partial-rollout: the global weight update is complete


class Drops(Message, tag="drops"):
    """Sent before a delivery: groups the controller dropped since the last one
    (`groups_dropped.<reason>`), the failed rewards in them (`reward_failed_dropped.<reason>`) and
    no-signal groups kept past dynamic sampling's cap (`no_signal_kept`), for the trainer's next
    step row."""
    counts: dict[str, int]


class Groups(Message, tag="groups"):
    groups: list[Group]


class HelloAck(Message, tag="hello_ack"):
    run_id: str
    max_version: int | None = None  # newest version any trainer published


# -- trainer -> controller -------------------------------------------------------------------
class WantGroups(Message, tag="want_groups"):
    n: int
    reset: bool | None = None  # n replaces the credit (after a resync)
    # dropped as too stale, replaced by this request: reported at once, not with the next step,
    # since admission counts them as replaced only once it knows (else a window of stale groups
    # stalls the run: no step, no report, no admission)
    stale: list[int] | None = None
    # groups delivered whose trajectories no stream shard held any more (a shard restarted): the
    # controller generates them again
    lost: list[int] | None = None


class TrainStep(Message, tag="train_step"):
    metrics: dict[str, Scalar]
    groups: list[int] | None = None  # trained in this step


class TrainerSync(Message, tag="trainer_sync"):
    """The trainer's lineage after it (re)started or the controller restarted: every group its
    weights were trained on (the first committed_n are in its checkpoint) and what it holds."""
    consumed: list[int]
    committed_n: int
    held: list[int]
    step: int
    version: int


class Published(Message, tag="published"):
    version: int
    stall_s: float


class CheckpointSaved(Message, tag="checkpoint_saved"):
    step: int
    version: int
    path: str
    groups: list[int] | None = None  # now durable: the controller frees them


class TrainerDone(Message, tag="trainer_done"):
    steps: int


# -- relay -> controller; trainer <-> master relay (weight hand-off) ---------------------------
class VersionReady(Message, tag="version_ready"):
    rank: int
    version: int
    nbytes: int
    bcast_s: float


class Publish(Message, tag="publish"):
    version: int
    slot: int
    nbytes: int
    layout: str
    t: float


# -- elastic capacity: an attach job -> controller (launch/attach.py, controller/elastic.py) ----
class Join(Message, tag="join"):
    """An attach job asks for `rollouts` rollout ranks and one relay rank (its leaf relay) for
    replicas of its own capacity (`max_batch`, `kv_capacity` KV tokens) and `kind` (a name
    traces and summaries attribute their work to)."""
    rollouts: int
    max_batch: int
    kv_capacity: int
    kind: str
    job: str | None = None  # its Slurm job id (status.json)


class Joined(Message, tag="joined"):
    """The controller's answer: the ranks registered for the job (never reused), or why not."""
    ranks: list[int] = []
    relay: int = -1
    refused: str | None = None


class Leaving(Message, tag="leaving"):
    """A joiner's rollout leaves (its job ends or is preempted): it has streamed every token it
    holds; these trajectories continue elsewhere."""
    held: list[str]


# -- a joiner's leaf relay <-> the master relay (relay/leaf.py) -------------------------------
class LeafSubscribe(Message, tag="leaf_subscribe"):
    """A leaf relay asks for every version newer than `have`, the newest it holds (sent every
    second: its liveness). `done`: the last version it was sent that it has finished with,
    committed or dropped (the master sends a leaf one version at a time)."""
    have: int
    done: int = -1


class LeafHeader(Message, tag="leaf_header"):
    version: int
    nbytes: int
    digest: int
    t_ns: int  # when the trainer published it


class LeafChunk(Message, tag="leaf_chunk"):
    version: int
    offset: int
    data: bytes


class LeafTrailer(Message, tag="leaf_trailer"):
    version: int
    sealed: bool  # False: the master's copy was overtaken, drop the version
    checksum: int


# -- stream shards (controller/shard.py) --------------------------------------------------------
class Relayed(Message, tag="relayed"):
    """Frames in bulk between a stream shard and the controller: (identity, encoded frame) pairs.
    Shard -> controller: what its rollouts sent, the token payloads kept at the shard. Controller
    -> shard: what goes to its rollouts, after `forget` (trajectories the shard may drop)."""
    frames: list[tuple[str, bytes]] = []
    forget: list[str] = []
    # shard -> controller: the rollouts (and their heartbeat sockets) that beat since the last batch,
    # with their pids; the shard answered those heartbeats itself
    alive: list[tuple[str, int]] = []
    # shard -> controller: work whose prompt it built and found unusable (traj id, the rollout it was
    # meant for, why): given to no rollout
    refused: list[tuple[str, int, str]] = []


class Fetch(Message, tag="fetch"):
    """The trainer (finished trajectories) or another shard (partials, as work) asks a shard
    for these trajectories; what it sends it no longer holds."""
    traj_ids: list[str]
    request: int = 0


class Fetched(Message, tag="fetched"):
    """A shard's answer to `Fetch`: the finished trajectories, or the partials as work items
    (tokens set), and the ids it does not hold."""
    request: int = 0
    trajectories: list[Trajectory] = []
    work: list[WorkItem] = []
    missing: list[str] = []


# -- rollout -> judge (laminar_hpc/judge/); judge -> rollout ------------------------------------
class JudgeRequest(Message, tag="judge_request"):
    """One response to score. `request` is the asker's own number, echoed in the verdict (an
    asker that gave up on a judge and asked another drops the late answer by it)."""
    request: int
    problem: str  # the problem as the policy saw it (its prompt text)
    response: str
    answer: str = ""  # the row's gold answer, where it has one


class JudgeVerdict(Message, tag="judge_verdict"):
    """A judge's score for one request, or why it has none (`error`: a verdict that did not
    parse, a prompt too long for the judge's model; `score` is then 0)."""
    request: int
    score: float = 0.0
    error: str | None = None
    verdict: str = ""  # a generative judge's text, for the trace (cut to 200 characters)
    judge: str = ""  # which judge answered (judge-N)


# -- launcher / campaign driver -> controller; controller -> any role --------------------------
class RoleDown(Message, tag="role_down"):
    role: str
    code: int


class StopAll(Message, tag="stop_all"):
    reason: str


class Stop(Message, tag="stop"):
    reason: str


MESSAGE_TYPES: tuple[type[Message], ...] = tuple(Message.__subclasses__())
TYPE_NAMES: dict[type[Message], str] = {t: t.__struct_config__.tag for t in MESSAGE_TYPES}
_decoder = msgspec.msgpack.Decoder(Union[MESSAGE_TYPES])  # type: ignore[valid-type]
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    if not isinstance(msg, Message):
        raise TypeError(f"encode takes a protocol message struct, got {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    if len(frame) > max_bytes:
        raise DecodeError(f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return _decoder.decode(frame)
    # ValidationError included (wrong type, missing field, bad tag); msgspec lets an invalid UTF-8
    # tag string through as UnicodeDecodeError
    except (msgspec.DecodeError, UnicodeDecodeError) as err:
        raise DecodeError(str(err)) from None


def stream_frame(items: list[StreamItem]) -> Stream:
    """What a rollout sends for the chunks it streams (token arrays as lists or bytes): their
    columns (`StreamChunks`) when they are plain (one version, offsets set, no episode fields),
    else the items, packed."""
    if items and all(it.offset is not None and it.mask is None and it.tool_calls is None for it in items) \
            and len({it.version for it in items}) == 1:
        toks = [token_list(it.tokens) for it in items]
        lps = [logprob_list(it.logprobs) for it in items]
        if all(len(t) == len(lp) for t, lp in zip(toks, lps)):
            return Stream(chunks=StreamChunks(
                version=items[0].version, traj_ids=[it.traj_id for it in items],
                offsets=pack_tokens([it.offset for it in items]), counts=pack_tokens([len(t) for t in toks]),
                tokens=pack_tokens([x for t in toks for x in t]),
                logprobs=pack_logprobs([x for lp in lps for x in lp])))
    return Stream(items=pack_items(items))




def stream_items(msg: Stream) -> list[StreamItem]:
    """Every chunk of a stream frame as a `StreamItem` (its columns first, then its items)."""
    return (msg.chunks.items() if msg.chunks is not None else []) + list(msg.items)


def version_mismatch(hello: Hello, ident: str) -> str | None:
    """One line for a role that speaks another protocol version, else None."""
    if hello.protocol == PROTOCOL_VERSION:
        return None
    return (f"{ident} speaks protocol {hello.protocol}, this controller {PROTOCOL_VERSION}: every node must run "
            f"the same laminar-hpc version (reinstall it from one checkout)")
