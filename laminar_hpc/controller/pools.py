"""The data plane: prompt pool, partial-response pool and experience buffer.

Built of components, each given the state and the callbacks it uses in its constructor: the
partial-response pool itself (`pool`, controller/partial.py: the partials and the queue, shared
by the others), the group ledger (`ledger`, controller/ledger.py: a group from admission to
commit), the moves of trajectories between rollouts that recovery and repack make (`moves`,
controller/moves.py) and the intake of streamed tokens (`intake`, controller/stream_intake.py). The
data plane itself admits prompts, assigns work, takes results, counts refusals and writes and
loads snapshots; its public methods for moves and streams hand the call to their component.

Plain state with explicit transitions, no I/O. Every public method that changes state first
hands one record to `journal` (the controller's write-ahead log) and then applies it with the
same private method that `replay` calls, so a restarted controller rebuilds exactly this state.
(The controller sends nothing before the records it depends on are written: `Controller.send`.)

A group's life: admitted (its trajectories queued) -> assigned/streamed/finished -> ready ->
delivered to the trainer -> trained (in a step, not yet durable) -> committed (in a trainer
checkpoint). A group may instead be dropped with a reason (staleness, bad reward). Once
delivered, a group's trajectories are the trainer's: a trainer that dies before its next
checkpoint loses them, and those groups are generated again under the same ids (the
controller keeps no copy: its memory and log stay bounded by what is in flight).

Trajectories come and go as the protocol's shapes (transport/protocol.py): work goes out as
`WorkItem`s, tokens arrive as `StreamChunks` (controller/stream_intake.py), results as `Trajectory`s,
which are kept as they arrived (no copy) and handed to the trainer in `Group`s. Token arrays are
the protocol's bytes (int32 ids, float32 log-probs; transport/tokens.py): a partial holds its
prompt as bytes (shared by its group) and the chunks streamed to it as they came.

Rows and trajectories are checked where they enter, before they are journalled (controller/
validate.py, with the engines' `limits`): a prompt that cannot be generated from is refused at
admission, never sent to a rollout; a bad stream chunk is ignored; a bad (or misplaced) result
starts again from its prompt, its group dropped as "invalid_trajectory" at the MAX_REJECTIONS-th.
Counts in `refused`; each refusal is queued for the caller's log (`take_refusals`).

    dp = DataPlane(problems=task.problem, tokenize=encode, group_size=8, max_new_tokens=24)
    dp.admit(4)                          # 4 prompt groups -> 32 queued trajectories (limits: refused skipped)
    work = dp.assign(rollout=0, n=8)     # -> list of WorkItems for that rollout
    dp.stream("0.3", [5, 9], [-0.1, -0.2], version=2)   # (or bytes: protocol.pack_tokens)
    dp.partials["0.3"].token_list()     # -> [5, 9]
    done_group = dp.finish(trajectory)   # group id once all of its samples are finished
    groups = dp.ledger.take_groups(2)    # complete Groups for the trainer, oldest first
    dp.ledger.trained([0, 1], step=1); dp.ledger.commit([0, 1])
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

import msgspec

from laminar_hpc.controller import validate
from laminar_hpc.controller.ledger import GroupLedger, GroupRecord
from laminar_hpc.controller.moves import PartialMoves
from laminar_hpc.controller.partial import Partial, PartialPool
from laminar_hpc.controller.stream_intake import StreamIntake
from laminar_hpc.controller.trajqueue import TrajQueue
from laminar_hpc.controller.validate import Limits
from laminar_hpc.transport.protocol import StreamChunks, StreamItem, Trajectory, WorkItem, pack_logprobs, pack_tokens

# journal records that carry protocol shapes: read back from disk they are msgpack maps and become
# structs again on replay (msgspec.convert passes a struct through: an in-memory journal replays as is)
_RECORD_SHAPES = {"finish": ("traj", Trajectory), "migrate": ("traj", Trajectory),
                  "stream": ("items", list[StreamItem]), "chunks": ("chunks", StreamChunks)}

MAX_REJECTIONS = 3  # refused results of one trajectory before its group is dropped (a broken rollout, or row)
MAX_REFUSED_SCAN = 64  # refused prompts one `admit` call walks past (the next call goes on)
REFUSED_PROBLEMS_KEPT = 20  # the last refused problems status.json lists


class DataPlane:
    """The three pools and the ledger. Its components: `pool` (PartialPool), `ledger`
    (GroupLedger), `moves` (PartialMoves: detach, place, migrate, restart) and `intake`
    (StreamIntake: streamed tokens)."""

    def __init__(self, problems: Callable[[int], object], tokenize: Callable[[object], list[int]],
                 group_size: int, max_new_tokens: int, start_cursor: int = 0,
                 journal: Callable[[str, dict], None] | None = None, limits: Limits | None = None,
                 drop_no_signal: bool = False, max_no_signal_run: int | None = None):
        self.problems, self.tokenize = problems, tokenize
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.journal = journal  # (set again once a restarted controller has replayed its log)
        self._limits = limits  # None: only where a result belongs is checked (token contents are not)
        # (+ "prompts_too_long" once one is: snapshots written before it existed compare equal)
        self.refused = {"prompts": 0, "trajectories": 0, "stream_items": 0}
        self.refused_problems: deque[int] = deque(maxlen=REFUSED_PROBLEMS_KEPT)
        self.refusals: list[tuple[str, object, str]] = []  # (kind, subject, what happened): for the caller's log
        # results and stream chunks a rollout sent for work it does not hold (another rollout's, or
        # queued): refused, changing nothing (not journalled: a restart forgets the count)
        self.not_held = 0
        self.cursor = start_cursor  # next problem index of the prompt pool
        self.pool = PartialPool()  # trajectories queued or running, and the queue (a set lookup for membership)
        self.ledger = GroupLedger(self._log, forget=self._forget, regenerate=self._regenerate,
                                  drop_no_signal=drop_no_signal, max_no_signal_run=max_no_signal_run)
        self.moves = PartialMoves(self.pool, log=self._log, reject=self.reject, limits=limits)
        self.intake = StreamIntake(self.pool, log=self._log, refuse_chunk=self.refuse_chunk,
                                   refuse_not_held=self.refuse_not_held, limits=limits)
        # journal record -> the component that applies it (`replay`); the others are the data plane's own
        self._record_owner = {op: part for part in (self.ledger, self.moves, self.intake) for op in part.OPS}
        self.meta: dict[str, int] = {}  # controller facts that must survive it (newest version, ...)
        self.groups_started = 0
        self.trajectories_finished = 0
        self.tokens_generated = 0

    # read-only: the components read the partials and the queue through the same `pool` (a snapshot
    # replaces both there, where all of them see it) and keep the limits they were built with
    @property
    def partials(self) -> dict[str, Partial]:
        return self.pool.partials

    @property
    def queue(self) -> TrajQueue:
        return self.pool.queue

    @property
    def limits(self) -> Limits | None:
        return self._limits

    def _log(self, op: str, **args) -> None:
        # (reads `journal` at each call: the components hold this method, the controller sets the journal later)
        if self.journal is not None:
            self.journal(op, args)

    def replay(self, op: str, args: dict) -> None:
        """Apply one journal record (no new record is written)."""
        if op in _RECORD_SHAPES:
            name, shape = _RECORD_SHAPES[op]
            args = {**args, name: msgspec.convert(args[name], shape)}
        getattr(self._record_owner.get(op, self), f"_{op}")(**args)

    def take_refusals(self) -> list[tuple[str, object, str]]:
        """Refusals since the last call: ("prompt", problem index, reason), ("trajectory" or
        "stream", traj id, reason and what happened)."""
        out, self.refusals = self.refusals, []
        return out

    # -- prompt pool ----------------------------------------------------------------------
    def admit(self, n_groups: int) -> None:
        """Admit `n_groups` groups from the prompt pool. With `limits`, a problem whose prompt
        cannot be generated from is refused on the way (journalled, so a replay skips it too)
        and the next one is taken; at most MAX_REFUSED_SCAN refusals per call."""
        if n_groups <= 0:
            return
        if self.limits is None or self.pool.shard_of is not None:  # (sharded: each shard builds the prompts)
            self._log("admit", n=n_groups)
            self._admit(n_groups)
            return
        prompts: dict[int, list[int]] = {}  # problem -> prompt of the run of admissible ones so far
        admitted = refused = 0
        c = self.cursor
        while admitted < n_groups and refused < MAX_REFUSED_SCAN:
            prompt, why = self._checked_prompt(c)
            if why is None:
                prompts[c] = prompt
                admitted += 1
            else:
                self._admit_run(prompts)  # the admissible ones before it, in order
                prompts = {}
                self._log("refuse_prompt", problem=c, reason=why)
                self._refuse_prompt(c, why)
                self.refusals.append(("prompt", c, why))
                refused += 1
            c += 1
        self._admit_run(prompts)

    def _checked_prompt(self, problem: int) -> tuple[list[int], str | None]:
        try:
            prompt = self.tokenize(self.problems(problem))
        except Exception as err:  # noqa: BLE001 - a row the task or tokenizer cannot read: refused, not a crash loop
            return [], f"it cannot be read or tokenized ({type(err).__name__}: {' '.join(str(err).split())[:300]})"
        return prompt, validate.prompt_refusal(prompt, self.limits)

    def _admit_run(self, prompts: dict[int, list[int]]) -> None:
        if prompts:
            self._log("admit", n=len(prompts))
            self._admit(len(prompts), prompts)

    def _refuse_prompt(self, problem: int, reason: str) -> None:
        self.cursor = max(self.cursor, problem + 1)
        self.refused["prompts"] += 1
        if validate.TOO_LONG in reason:  # filtered by task.max_prompt_tokens, as configured
            self.refused["prompts_too_long"] = self.refused.get("prompts_too_long", 0) + 1
        self.refused_problems.append(problem)

    def _admit(self, n: int, prompts: dict[int, list[int]] | None = None) -> None:
        for _ in range(n):
            prompt = self._prompt(self.cursor, prompts)
            gid = self.ledger.next_group
            ids = [f"{gid}.{j}" for j in range(self.group_size)]
            self.ledger.add(GroupRecord(gid, self.cursor, ids))
            for tid in ids:
                self.pool.partials[tid] = self._new_partial(tid, gid, self.cursor, prompt)
                self.pool.queue.append(tid)
            self.cursor += 1
            self.groups_started += 1

    def _prompt(self, problem: int, prompts: dict[int, list[int]] | None = None) -> bytes:
        """A problem's prompt ids; none when stream shards build them (controller/shard.py, from the same
        task): the controller's thread then never tokenizes a prompt nor carries its ids."""
        if self.pool.shard_of is not None:
            return b""
        return pack_tokens(prompts[problem] if prompts else self.tokenize(self.problems(problem)))

    def prompt_refused(self, traj_id: str, why: str) -> None:
        """A shard found the prompt of `traj_id` unusable (controller/validate.prompt_refusal) and gave
        it to no rollout: its problem is refused as admission refuses one, its group dropped
        ("prompt_refused", which admission replaces; its other samples are refused alike, or forgotten)."""
        p = self.pool.partials.get(traj_id)
        if p is None:
            return
        self.refused["prompts"] += 1
        if validate.TOO_LONG in why:
            self.refused["prompts_too_long"] = self.refused.get("prompts_too_long", 0) + 1
        self.refused_problems.append(p.problem)
        self.refusals.append(("prompt", p.problem, why))
        self.ledger.drop([p.group_id], "prompt_refused")

    def _new_partial(self, traj_id: str, group_id: int, problem: int, prompt: bytes) -> Partial:
        return Partial(traj_id, group_id, problem, prompt, self.max_new_tokens)

    # -- rollout side ---------------------------------------------------------------------
    def assign(self, rollout: int, n: int) -> list[WorkItem]:
        ids = [self.pool.queue[i] for i in range(min(n, len(self.pool.queue)))]
        if not ids:
            return []
        t = time.time()
        self._log("assign", rollout=rollout, ids=ids, t=t)
        return self._assign(rollout, ids, t)

    def _assign(self, rollout: int, ids: list[str], t: float) -> list[WorkItem]:
        out = []
        queue, partials = self.pool.queue, self.pool.partials
        for tid in ids:
            if queue[0] == tid:
                queue.popleft()
            else:
                queue.remove(tid)
            p = partials[tid]
            p.rollout, p.t_assigned = rollout, t
            out.append(p.work())
            self.pool.placed(p)
        return out

    def finish(self, traj: Trajectory, rollout: int | None = None) -> int | None:
        """Record a finished trajectory (sent by `rollout`); returns its group id if that completed
        the group. One that fails validation is refused (`reject`) and recorded nowhere else."""
        p = self.pool.partials.get(traj.traj_id)
        if p is None:
            self._unwanted(traj)
            return None  # a duplicate (e.g. re-sent after a reconnect) is ignored, never counted twice
        if rollout is not None and p.rollout != rollout:
            self.refuse_not_held("trajectory", traj.traj_id, rollout, p.rollout)
            return None
        why = validate.trajectory_refusal(traj, p, self.limits, finished=True)
        if why is not None:
            self.reject(traj.traj_id, why, rollout)
            return None
        if not self.ledger.expects(traj):
            self._unwanted(traj)
            return None
        self._log("finish", traj=traj)
        return self._finish(traj)

    def _unwanted(self, traj: Trajectory) -> None:
        """A result held at a shard that nothing here waits for: the shard lets it go."""
        if traj.shard is not None:
            self.pool.forgotten.append(traj.traj_id)

    def refuse_not_held(self, kind: str, traj_id: str, rollout: int, holder: int | None) -> None:
        """A result or chunk of `traj_id` from `rollout`, which does not hold it: ignored (the holder,
        or the queue, keeps it), counted, and logged by the caller (rate-limited: a rollout whose
        trajectories were just moved elsewhere may still send a few)."""
        self.not_held += 1
        where = "queued for a rollout" if holder is None else f"held by rollout-{holder}"
        self.refusals.append((kind, traj_id, f"sent by rollout-{rollout}, which does not hold it ({where}); ignored"))

    def refuse_chunk(self, traj_id: str, why: str) -> None:
        """A stream chunk failed validation: ignored, counted and logged by the caller (not
        journalled: nothing changed, so a restart forgets the count)."""
        self.refused["stream_items"] += 1
        self.refusals.append(("stream", traj_id, f"{why}; chunk ignored"))

    def reject(self, traj_id: str, reason: str, rollout: int | None = None) -> None:
        """A result for `traj_id` from `rollout` was refused: the trajectory starts again from its
        prompt (unless another rollout runs it now), its group is dropped at the MAX_REJECTIONS-th."""
        if traj_id not in self.pool.partials:
            return
        self._log("reject", traj_id=traj_id, rollout=rollout)
        outcome = self._reject(traj_id, rollout)
        self.refusals.append(("trajectory", traj_id, f"{reason}; {outcome}"))

    def _reject(self, traj_id: str, rollout: int | None) -> str:
        self.refused["trajectories"] += 1
        p = self.pool.partials[traj_id]
        if rollout is not None and p.rollout is not None and p.rollout != rollout:
            return f"rollout-{p.rollout} runs it now and continues"  # a stale sender: the owner goes on
        p.rejected += 1
        if p.rejected >= MAX_REJECTIONS:
            self.ledger.fail(p.group_id, "invalid_trajectory")
            return f"refused {p.rejected} times: its group {p.group_id} is dropped (invalid_trajectory)"
        self.pool.reset(p)
        if traj_id not in self.pool.queue:
            self.pool.queue.appendleft(traj_id)
        return f"restarted from its prompt (refusal {p.rejected} of {MAX_REJECTIONS})"

    def _finish(self, traj: Trajectory) -> int | None:
        p = self.pool.partials.pop(traj.traj_id, None)
        if traj.offset is not None:  # sent as its tail (`finish` checked that it continues `p`)
            traj = p.completed(traj)
        # a result without a sender (the simulator's, or one replayed from the log) of a trajectory
        # requeued meanwhile: it wins, the requeue is void. (A rollout's result for work it no longer
        # holds never gets here: `finish` refuses it, and the queued copy is generated again.)
        if traj.traj_id in self.pool.queue:
            self.pool.queue.remove(traj.traj_id)
        self.trajectories_finished += 1
        self.tokens_generated += traj.total_tokens
        return self.ledger.finished(traj)

    def _forget(self, traj_ids: list[str]) -> None:
        """The ledger dropped or kept their group: stop generating these (late results are ignored)."""
        for tid in traj_ids:
            if self.pool.partials.pop(tid, None) is not None and tid in self.pool.queue:
                self.pool.queue.remove(tid)
        if self.pool.shard_of is not None:  # what a shard holds of them (partial, or finished) goes too
            self.pool.forgotten.extend(traj_ids)

    def _regenerate(self, g: GroupRecord) -> None:
        """The ledger lost a delivered group with the trainer: its samples again, first in the queue."""
        prompt = self._prompt(g.problem)
        for tid in reversed(g.traj_ids):
            self.pool.partials[tid] = self._new_partial(tid, g.group_id, g.problem, prompt)
            self.pool.queue.appendleft(tid)

    # -- moves between rollouts (controller/moves.py) ---------------------------------------
    def requeue_rollout(self, rollout: int) -> list[Partial]:
        """A dead or restarted rollout's trajectories, detached (`PartialMoves.requeue_rollout`)."""
        return self.moves.requeue_rollout(rollout)

    def detach(self, ids: list[str]) -> list[Partial]:
        return self.moves.detach(ids)

    def unplaced(self) -> list[Partial]:
        return self.moves.unplaced()

    def place(self, traj_id: str, dest: int) -> WorkItem | None:
        return self.moves.place(traj_id, dest)

    def migrate(self, traj: Trajectory, dest: int, source: int | None = None) -> WorkItem | None:
        return self.moves.migrate(traj, dest, source)

    def restart(self, traj_id: str) -> bool:
        return self.moves.restart(traj_id)

    # -- streamed tokens (controller/stream_intake.py) --------------------------------------------
    def stream_chunks(self, ch: StreamChunks, rollout: int | None = None) -> None:
        """A rollout's frame of chunks in columns (`StreamIntake.stream_chunks`)."""
        self.intake.stream_chunks(ch, rollout)

    def stream_items(self, items: list[StreamItem], rollout: int | None = None) -> None:
        self.intake.stream_items(items, rollout)

    def stream(self, traj_id: str, tokens, logprobs, version: int, offset: int | None = None) -> None:
        self.intake.stream(traj_id, tokens, logprobs, version, offset)

    def note(self, **facts: int) -> None:
        """Remember controller facts (newest version, steps trained) across a restart."""
        changed = {k: v for k, v in facts.items() if self.meta.get(k) != v}
        if changed:
            self._log("note", **changed)
            self._note(**changed)

    def _note(self, **facts: int) -> None:
        self.meta.update(facts)

    def running_versions(self) -> set[int]:
        """Weight versions of trajectories generating right now."""
        return {p.version for p in self.pool.partials.values() if p.version is not None}

    # -- snapshots ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        lg = self.ledger
        return {"cursor": self.cursor, "next_group": lg.next_group, "queue": list(self.pool.queue),
                # shallow copies: the WAL packs the state at once, before anything mutates it, so the
                # token lists need no copy (dataclasses.asdict copies every element: seconds per snapshot
                # under a long-tail load, during which the controller answered no one)
                "partials": [p.state() for p in self.pool.partials.values()],
                "groups": [dict(vars(g)) for g in lg.groups.values()], "ready": list(lg.ready),
                "trained_at": [[g, s] for g, s in lg.trained_at.items()], "committed": sorted(lg.committed),
                "dropped": [[g, r] for g, r in lg.dropped.items()], "meta": self.meta,
                "counters": [self.groups_started, lg.groups_consumed, self.trajectories_finished,
                             self.tokens_generated],
                "refused": dict(self.refused), "refused_problems": list(self.refused_problems),
                # dynamic sampling's decision in force for the records after this snapshot (a resume
                # may change the config: replay must decide as they were decided)
                "no_signal": [lg.no_signal_run, lg.no_signal_kept, lg.drop_no_signal, lg.max_no_signal_run]}

    def load_state_dict(self, s: dict) -> None:
        lg = self.ledger
        self.cursor, lg.next_group = s["cursor"], s["next_group"]
        self.pool.queue = TrajQueue(s["queue"])
        self.pool.partials = {p["traj_id"]: Partial(**p) for p in s["partials"]}
        self.pool.ranks_given.update(p.rollout for p in self.pool.partials.values() if p.rollout is not None)
        for p in self.pool.partials.values():  # read back from disk, (offset, version) pairs are lists
            if p.version_spans:
                p.version_spans = [tuple(x) for x in p.version_spans]
            # token arrays come back as bytes (lists from a log written before protocol 5)
            p.prompt, toks, lps = pack_tokens(p.prompt), pack_tokens(p.tokens), pack_logprobs(p.logprobs)
            p.tokens, p.logprobs = ([toks], [lps]) if toks else ([], [])
            p.n_tokens = len(toks) >> 2
        # a snapshot read from disk holds the finished trajectories as maps
        finished = dict[str, Trajectory]
        lg.groups = {g["group_id"]: GroupRecord(**{**g, "finished": msgspec.convert(g["finished"], finished)})
                     for g in s["groups"]}
        lg.ready = deque(s["ready"])
        lg.trained_at = {g: st for g, st in s["trained_at"]}
        lg.committed = set(s["committed"])
        lg.dropped = {g: r for g, r in s["dropped"]}
        self.meta = dict(s["meta"])
        (self.groups_started, lg.groups_consumed, self.trajectories_finished,
         self.tokens_generated) = s["counters"]
        ns = s.get("no_signal")  # absent in snapshots written before dynamic sampling's guard
        if ns is not None:
            lg.no_signal_run, lg.no_signal_kept, lg.drop_no_signal, lg.max_no_signal_run = ns
        self.refused.update(s.get("refused", {}))  # absent in snapshots written before validation
        self.refused_problems.clear()
        self.refused_problems.extend(s.get("refused_problems", []))
