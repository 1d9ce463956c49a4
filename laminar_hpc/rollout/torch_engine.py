"""The PyTorch rollout engine (the `RolloutEngine` protocol is in rollout/engine_interface.py).

It holds ONE weight version at a time and generates with continuous batching: new sequences
join between decode steps, finished ones leave, and weights can only be swapped when no
sequence is in flight (or, asked, under them: refresh in flight), so every trajectory is produced
by exactly one version. With adapters (`model.lora`) it holds the frozen base and several adapter
versions (model.adapters.AdapterBank): a new version goes into a free slot while sequences of an
older one go on under theirs, each batch row under its own version.

Each sampled token is drawn from its trajectory's own stream (model.sampling.stream_uniforms:
the campaign's `seed`, the trajectory id, the token's index), so what a trajectory draws does not
depend on the replica, its batch or the process's start: a restarted rollout never repeats the
campaign's first draws, and a trajectory moved to another replica draws what it would have drawn.

    engine = TorchEngine(model_args, eos_id, max_batch=32, temperature=1.0, top_p=0.9, top_k=50, seed=0)
    engine.load_weights(version=3, buf=weights, layout=layout)
    engine.add([SeqRequest("t1", prompt_ids, max_new_tokens=20)])
    while engine.num_active():
        for out in engine.step(): ...      # one new token per active sequence
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from laminar_hpc.model.adapters import AdapterBank
from laminar_hpc.model.llama import KVCache, ModelArgs, Transformer
from laminar_hpc.model.sampling import check_sampling, sample_tokens, stream_uniforms
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.rollout.engine_interface import (
    RolloutEngine, SeqRequest, StepOutput, VersionInFlightError, check_add, request_problem, slot_for_version,
)

__all__ = ["RolloutEngine", "SeqRequest", "StepOutput", "TorchEngine", "VersionInFlightError"]


@dataclass
class _Active:
    req: SeqRequest
    length: int  # tokens written to the KV cache
    slot: int = 0  # with adapters: the bank slot of the version it decodes under


class TorchEngine:
    """Continuous-batching generation with a slot-based KV cache, on CPU or GPU."""

    def __init__(self, args: ModelArgs, eos_id: int, *, max_batch: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, device: str = "cpu",
                 model: Transformer | None = None, adapters: AdapterBank | None = None):
        """`model`: the model to generate with (default: a fresh one of shape `args`, whose weights
        each version replaces). `adapters`: `model`'s adapter bank (model.adapters), when a
        version is an adapter on `model`'s frozen weights; each sequence decodes under the
        version it was admitted (or last moved) under."""
        self.args, self.eos_id = args, eos_id
        # rollout.temperature / top_p / top_k: each token's log-prob is recorded under the
        # distribution it was drawn from (model.sampling), the one the trainer scores with
        check_sampling(temperature, top_k, top_p)
        self.max_batch, self.temperature, self.top_p, self.top_k = max_batch, temperature, top_p, top_k
        self.device = torch.device(device)
        self.model = (model if model is not None else Transformer(args)).to(self.device).eval().requires_grad_(False)
        self.adapters = adapters
        self.slot_version = [-1] * (adapters.slots if adapters is not None else 1)  # slot -> version it holds
        self.slot = 0  # the newest version's slot: new sequences decode under it
        self.cache = KVCache(args, max_batch, device=self.device)
        self.seed = seed  # the campaign's: every trajectory's stream is keyed by it
        self.active: list[_Active] = []  # index == cache slot
        self.version = -1

    # -- capacity -------------------------------------------------------------------------
    def num_active(self) -> int:
        return len(self.active)

    def free_slots(self) -> int:
        return self.max_batch - len(self.active)

    def kv_tokens(self) -> int:
        return sum(a.length for a in self.active)

    def active_ids(self) -> list[str]:
        return [a.req.traj_id for a in self.active]

    def spare_version_slots(self) -> int:
        """Adapter slots no running sequence decodes under (0 without adapters: one version)."""
        if self.adapters is None:
            return 0
        return len(self.slot_version) - len({a.slot for a in self.active})

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, version: int, buf: memoryview, layout: WeightLayout, checksum: bool = False,
                     in_flight: bool = False) -> int | None:
        if self.adapters is None:
            if self.active and not in_flight:
                raise VersionInFlightError(
                    f"cannot load version {version}: {len(self.active)} trajectories of version "
                    f"{self.version} are still generating")
            digest = layout.unpack(buf, self.model, checksum=checksum)
        else:
            slot = slot_for_version(version, self.slot_version, {a.slot for a in self.active}, in_flight)
            digest = layout.unpack(buf, self.adapters.slot(slot), checksum=checksum)
            self.slot_version[slot], self.slot = version, slot
            if in_flight:
                for a in self.active:
                    a.slot = slot
        self.version = version
        return digest

    # -- generation -----------------------------------------------------------------------
    def refuse(self, request: SeqRequest) -> str | None:
        return request_problem(request, vocab_size=self.args.vocab_size, max_len=self.args.max_seq_len,
                               len_name="model.max_seq_len")

    @torch.inference_mode()
    def add(self, requests: list[SeqRequest]) -> list[StepOutput]:
        """Prefill new sequences into free slots and sample their next token (a refused request
        raises ValueError and nothing joins: ask `refuse` first)."""
        if not requests:
            return []
        check_add(requests, self.free_slots(), self.version)
        for r in requests:
            why = self.refuse(r)
            if why is not None:
                raise ValueError(f"trajectory {r.traj_id}: {why}")
        prefixes = [r.prompt + r.tokens for r in requests]
        width = max(len(p) for p in prefixes)
        first = len(self.active)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        for i, p in enumerate(prefixes):
            tokens[i, :len(p)] = torch.tensor(p)
        # right padding: real tokens never attend to pads, and a pad's cache entry at position
        # >= len(p) is overwritten before any real token can attend to it
        positions = torch.arange(width).expand(len(requests), width)
        logits = self._forward(tokens, positions, slot0=first, key_len=width, rows=[self.slot] * len(requests))
        last = torch.tensor([len(p) - 1 for p in prefixes])
        step_logits = logits[torch.arange(len(requests)), last]
        for r, p in zip(requests, prefixes):
            self.active.append(_Active(r, len(p), self.slot))
        return self._sample_and_retire(step_logits, list(range(first, first + len(requests))))

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One decode step for every active sequence."""
        if not self.active:
            return []
        toks = torch.tensor([[a.req.tokens[-1]] for a in self.active])
        pos = torch.tensor([[a.length] for a in self.active])
        logits = self._forward(toks, pos, slot0=0, key_len=int(pos.max()) + 1, rows=[a.slot for a in self.active])
        for a in self.active:
            a.length += 1
        return self._sample_and_retire(logits[:, -1], list(range(len(self.active))))

    def abort(self, traj_ids: list[str]) -> list[SeqRequest]:
        """Remove sequences (repack, recovery) and return them with their progress so far."""
        wanted, out = set(traj_ids), []
        for slot in sorted((i for i, a in enumerate(self.active) if a.req.traj_id in wanted), reverse=True):
            out.append(self.active[slot].req)
            self._free(slot)
        return out

    # -- internals ------------------------------------------------------------------------
    def _forward(self, tokens, positions, *, slot0: int, key_len: int, rows: list[int]) -> torch.Tensor:
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        if self.adapters is not None:  # each batch row's adapter version
            self.adapters.rows = torch.tensor(rows, device=self.device)
        if slot0 == 0:
            return self.model(tokens, cache=self.cache, positions=positions, key_len=key_len)
        # prefill writes into slots slot0.. : give the model a cache view starting there
        view = _CacheView(self.cache, slot0)
        return self.model(tokens, cache=view, positions=positions, key_len=key_len)

    def _sample_and_retire(self, logits: torch.Tensor, slots: list[int]) -> list[StepOutput]:
        # a sequence whose logits are not finite (weights that overflow on its tokens) ends with an
        # error alone: sampling it would raise for the whole batch (on a GPU, a device-side assert)
        bad = ~torch.isfinite(logits).all(-1)
        logits = logits.masked_fill(bad.unsqueeze(-1), 0.0)  # no `if bad.any()`: that would sync a GPU
        reqs = [self.active[s].req for s in slots]
        u = stream_uniforms(self.seed, [r.traj_id for r in reqs], [len(r.tokens) for r in reqs])
        toks, logps = sample_tokens(logits, self.temperature, self.top_p, top_k=self.top_k, uniforms=u)
        greedy = [self.active[s].req.greedy for s in slots]
        if any(greedy):  # evaluation requests take the most likely token (their log-probs are not trained on)
            toks = torch.where(torch.tensor(greedy, device=toks.device), logits.argmax(-1), toks)
        outs = []
        for slot, tok, lp, nan in zip(slots, toks.tolist(), logps.tolist(), bad.tolist()):
            req = self.active[slot].req
            if nan:
                outs.append(StepOutput(req.traj_id, [], [], True, req, error=(
                    f"non-finite logits at position {len(req.prompt) + len(req.tokens)}")))
                for buf in (*self.cache.k, *self.cache.v):
                    buf[slot].zero_()  # masked positions still reach attention's sum: no NaN left behind
                continue
            req.tokens.append(tok)
            req.logprobs.append(lp)
            done = (tok == self.eos_id or len(req.tokens) >= req.max_new_tokens
                    or len(req.prompt) + len(req.tokens) >= self.args.max_seq_len)
            outs.append(StepOutput(req.traj_id, [tok], [lp], done, req if done else None))
        for slot in sorted((s for s, o in zip(slots, outs) if o.finished), reverse=True):
            self._free(slot)
        return outs

    def _free(self, slot: int) -> None:
        # keep active sequences compacted in slots 0..n-1: move the last one into the hole
        last = len(self.active) - 1
        if slot != last:
            self.cache.move_slot(last, slot)
            self.active[slot] = self.active[last]
        self.active.pop()


class _CacheView(KVCache):
    """The same buffers seen from slot `slot0` on (no copy)."""

    def __init__(self, base: KVCache, slot0: int):  # noqa: D107 - deliberately skips KVCache.__init__
        self.k = [k[slot0:] for k in base.k]
        self.v = [v[slot0:] for v in base.v]
        self.max_slots = base.max_slots - slot0
