"""What a stream shard holds (controller/shard.py): the token payloads of its rollouts' work,
partial (streamed so far) and finished (until the trainer takes them), and the checks the
controller made of them before shards existed.

It builds the prompt ids of the work it passes on from the campaign's task (the controller sends a
problem index: it never tokenizes), refusing as admission did a prompt no rollout can generate from.
The partials are the controller's own `Partial`s and stream intake (controller/partial.py,
controller/stream_intake.py): the same validation, the same counting of chunks from a rollout that
does not hold the trajectory. A partial is registered when the shard passes its work to a
rollout (`register`, from the controller's `Assign`); a resumed one takes the tokens this shard
(`take_work`) or another (`Fetch`) holds. A finished result is joined to its streamed tokens,
checked (controller/validate.py), kept whole, and goes on to the controller as metadata
(`Trajectory.shard`, `length`); what cannot be joined or fails a check goes on as it came, and
the controller refuses it as it always did. Nothing here is journalled: a restarted shard holds
nothing, its rollouts send their results whole (their controller epoch changed), and a finished
trajectory it lost is generated again (the trainer reports it: `WantGroups.lost`).

    store = ShardStore(0, limits, max_new_tokens=512)
    store.register(3, work_item)                      # rollout-3 runs it
    store.stream(chunks, rollout=3)                   # its stream frame
    meta = store.finish(traj, rollout=3)              # -> the metadata to pass on, or None
    got, missing = store.take_finished(["0.3"])       # the trainer's fetch
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable

import msgspec

from laminar_hpc.controller import validate
from laminar_hpc.controller.partial import Partial, PartialPool
from laminar_hpc.controller.stream_intake import StreamIntake
from laminar_hpc.controller.validate import Limits
from laminar_hpc.transport.protocol import StreamChunks, StreamItem, Trajectory, WorkItem, pack_tokens


def _no_journal(op: str, **args) -> None:
    pass  # a shard keeps no log: what it loses in a restart is sent again or generated again


PROMPTS_KEPT = 4096  # problems whose prompt ids a shard keeps (the samples of a group come one by one)


class ShardStore:
    def __init__(self, shard: int, limits: Limits | None, max_new_tokens: int,
                 prompt: Callable[[int], list[int]] | None = None):
        """`prompt(problem)`: its prompt ids, from the campaign's task (the controller then sends none)."""
        self.shard, self.limits, self.max_new_tokens = shard, limits, max_new_tokens
        self.prompt = prompt
        self.prompts: OrderedDict[int, tuple[bytes, str | None]] = OrderedDict()
        self.pool = PartialPool()
        self.finished: dict[str, Trajectory] = {}
        self.counts: Counter[str] = Counter()  # what it refused and passed on, for status.json
        self.intake = StreamIntake(self.pool, log=_no_journal, refuse_chunk=self._refuse_chunk,
                                   refuse_not_held=self._not_held, limits=limits)

    # -- the controller's work for its rollouts ------------------------------------------------
    def with_prompt(self, w: WorkItem) -> tuple[WorkItem, str | None]:
        """`w` with its prompt ids (the controller sent its problem only), or why that prompt cannot
        be generated from (controller/validate.prompt_refusal: then it goes to no rollout)."""
        if w.prompt or w.eval_round is not None or self.prompt is None:
            return w, None
        got = self.prompts.get(w.problem)
        if got is None:
            try:
                ids = self.prompt(w.problem)
                got = (pack_tokens(ids), validate.prompt_refusal(ids, self.limits) if self.limits else None)
            except Exception as err:  # noqa: BLE001 - a row the task or tokenizer cannot read: refused
                got = (b"", f"it cannot be read or tokenized ({type(err).__name__}: {' '.join(str(err).split())[:300]})")
            self.prompts[w.problem] = got
            if len(self.prompts) > PROMPTS_KEPT:
                self.prompts.popitem(last=False)
        else:
            self.prompts.move_to_end(w.problem)
        prompt, why = got
        return (w if why is not None else msgspec.structs.replace(w, prompt=prompt)), why

    def register(self, rollout: int, w: WorkItem) -> None:
        """`rollout` runs `w` from now on (its tokens, if resumed, already filled in)."""
        if w.eval_round is not None:
            return  # evaluation work: its result goes to the controller as it comes
        p = Partial(w.traj_id, w.group_id, w.problem, w.prompt, w.max_new_tokens, rollout=rollout)
        if w.tokens:
            p.tokens, p.logprobs, p.n_tokens = [bytes(w.tokens)], [bytes(w.logprobs or b"")], len(w.tokens) >> 2
            p.version, p.version_spans = w.version, w.version_spans
            p.mask, p.tool_calls, p.tool_errors = w.mask, w.tool_calls, w.tool_errors
        self.pool.partials[w.traj_id] = p

    def take_work(self, w: WorkItem) -> WorkItem:
        """`w` (resumed, its tokens at this shard) with every token this shard holds of it; as it
        came, without tokens, when it holds none (then it starts from its prompt)."""
        p = self.pool.partials.pop(w.traj_id, None)
        return self.resumed(w, p.work() if p is not None and p.n_tokens and not p.gap else None)

    def resumed(self, w: WorkItem, held: WorkItem | None) -> WorkItem:
        """`w` with the tokens of `held` (a partial as work, this shard's or another's), or from its
        prompt when there are none."""
        if held is None or not held.tokens:
            self.counts["resumed_without_tokens"] += 1
            return msgspec.structs.replace(w, shard=None, version=None, version_spans=None, mask=None,
                                           tool_calls=0, tool_errors=0)
        self.counts["resumed"] += 1
        return msgspec.structs.replace(w, shard=None, tokens=held.tokens, logprobs=held.logprobs,
                                       version=held.version, version_spans=held.version_spans, mask=held.mask,
                                       tool_calls=held.tool_calls, tool_errors=held.tool_errors)

    def take_partials(self, ids: list[str]) -> tuple[list[WorkItem], list[str]]:
        """Another shard's `Fetch` of partials it resumes: what this one holds of them, as work."""
        out, missing = [], []
        for tid in ids:
            p = self.pool.partials.pop(tid, None)
            if p is None:
                missing.append(tid)
            else:
                out.append(p.work())
        self.counts["handed_on"] += len(out)
        return out, missing

    def forget(self, ids: list[str]) -> None:
        """The controller dropped these (their group, or a restart from the prompt)."""
        for tid in ids:
            self.pool.partials.pop(tid, None)
            self.finished.pop(tid, None)

    # -- the rollouts' traffic -------------------------------------------------------------------
    def stream(self, chunks: StreamChunks | None, items: list[StreamItem], rollout: int) -> None:
        if chunks is not None:
            self.intake.stream_chunks(chunks, rollout=rollout)
        if items:
            self.intake.stream_items(items, rollout=rollout)

    def finish(self, traj: Trajectory, rollout: int) -> Trajectory | None:
        """The metadata of a finished result this shard now keeps whole (an evaluation result's, kept
        nowhere); None: pass it on as it came (the controller refuses it)."""
        tid = traj.traj_id
        if traj.eval_round is not None:  # evaluation: the controller scores its reward, no token is kept
            return msgspec.structs.replace(traj, prompt=b"", tokens=b"", logprobs=b"", mask=None, offset=None,
                                           length=(traj.offset or 0) + traj.n_tokens)
        p = self.pool.partials.get(tid)
        if p is None:
            if traj.offset is not None or tid in self.finished:
                return None  # a tail of tokens this shard never held, or a duplicate: the controller judges it
            # a whole result of work registered before this shard (re)started
            p = Partial(tid, traj.group_id, traj.problem, traj.prompt, self.max_new_tokens, rollout=rollout)
        elif p.rollout != rollout:
            return None  # not the holder: the controller refuses and counts it
        if traj.offset is not None:
            if traj.offset != p.n_tokens or p.gap:
                return None  # the controller refuses it (its pool holds none of these tokens) and restarts it
            whole = p.completed(traj)
        else:
            whole = traj
        if validate.trajectory_refusal(whole, p, self.limits, finished=True) is not None:
            self.pool.partials.pop(tid, None)
            self.counts["refused_passed_on"] += 1
            return None
        self.pool.partials.pop(tid, None)
        self.finished[tid] = whole
        return self.metadata(whole)

    def migrated(self, traj: Trajectory, rollout: int) -> Trajectory:
        """A trajectory `rollout` handed back for repack (every token it has): kept as its partial,
        passed on as metadata; the rollout it moves to gets its tokens from here."""
        p = self.pool.partials.get(traj.traj_id)
        if p is None or p.rollout != rollout:
            p = Partial(traj.traj_id, traj.group_id, traj.problem, traj.prompt, self.max_new_tokens, rollout=rollout)
            self.pool.partials[traj.traj_id] = p
        p.tokens, p.logprobs, p.n_tokens = [bytes(traj.tokens)], [bytes(traj.logprobs)], traj.n_tokens
        p.version, p.version_spans, p.gap = traj.version, traj.version_spans, False
        p.mask, p.tool_calls, p.tool_errors = traj.mask, traj.tool_calls, traj.tool_errors
        return self.metadata(traj)

    def metadata(self, traj: Trajectory) -> Trajectory:
        """`traj` without its token payloads, which this shard holds."""
        return msgspec.structs.replace(traj, prompt=b"", tokens=b"", logprobs=b"", mask=None, offset=None,
                                       shard=self.shard, length=traj.n_tokens)

    # -- the trainer's fetch ---------------------------------------------------------------------
    def take_finished(self, ids: list[str]) -> tuple[list[Trajectory], list[str]]:
        out, missing = [], []
        for tid in ids:
            t = self.finished.pop(tid, None)
            if t is None:
                missing.append(tid)
            else:
                out.append(t)
        return out, missing

    # -- counting ------------------------------------------------------------------------------
    def _refuse_chunk(self, traj_id: str, why: str) -> None:
        self.counts["stream_items_refused"] += 1

    def _not_held(self, kind: str, traj_id: str, rollout: int, holder: int | None) -> None:
        self.counts["not_held"] += 1

    def stats(self) -> dict[str, int]:
        """What it holds now (trajectories, token bytes) and its counts so far."""
        held = sum(p.n_tokens for p in self.pool.partials.values())
        done = sum(t.n_tokens + t.n_prompt for t in self.finished.values())
        return {"partials": len(self.pool.partials), "finished": len(self.finished),
                "token_bytes": 8 * (held + done), **self.counts}
