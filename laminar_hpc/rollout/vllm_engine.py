"""vLLM rollout engine (`rollout.backend: vllm`, extra `vllm`, GPU nodes only).

The same `RolloutEngine` contract as the torch engine, on top of vLLM's `LLMEngine`
(continuous batching, paged KV cache). This module imports no vllm: `load_vllm_api()` does,
when an engine is built, so every other module (and this one) imports on a CPU-only install.

    engine = VllmEngine.from_config(cfg, seed=0, eos_id=tok.eos_id, layout=layout)
    engine.load_weights(3, buf, layout)           # buf: a version in the relay's shared memory
    engine.add([SeqRequest("t1", prompt_ids, max_new_tokens=512)])
    while engine.num_active():
        for out in engine.step(): ...             # new tokens + their sampled-token log-probs

Weights (`rollout.vllm.weight_update`), fed from `layout.views(buf)`: HF-named tensors that
alias the relay's shared memory, so nothing is copied on the host:
- `transfer_engine` (default): vLLM's weight-transfer API with the CUDA-IPC backend.
  `start_weight_update()`, then per chunk of <= `staging_mb` the chunk's tensors are copied to
  every local GPU of the engine and `update_weights()` gets their IPC handles, then
  `finish_weight_update(weight_version=str(version))`.
- `reload_weights`: `collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` with
  the aliasing CPU tensors (vLLM's RPC serialises them: slower, no GPU staging).
With `enable_sleep_mode` a load is wrapped in sleep(level=2) / wake_up(["weights"]) ... load ...
wake_up(["kv_cache"]): the KV cache is released while the weights change. Otherwise the prefix
cache is reset after a load: cached prefixes of the old version must never be reused.

One request's failure never ends the engine: `refuse` names a request vLLM must not get (a
token id outside the model's vocabulary: with `skip_tokenizer_init` vLLM does not check it, and
on the GPU it is an out-of-bounds embedding read), and a request vLLM finishes with
finish_reason "error" or "abort" that this engine did not ask for, or without any new token
(a prompt its KV cache can never hold is "ignored", reported as "length"), or whose log-probs
are missing, comes out of `step` finished with `error` set.

vLLM API facts used, with sources, are listed in docs/gpu.md.
"""
from __future__ import annotations

import atexit
import itertools
import os
import tempfile
from pathlib import Path
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from laminar_hpc.model.draws import stream_bits
from laminar_hpc.rollout.engine_interface import (SeqRequest, StepOutput, VersionInFlightError, check_add,
                                                  request_problem, slot_for_version)

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config
    from laminar_hpc.model.weights import WeightLayout

MIN_VLLM = "0.29"  # four-phase weight-transfer API with finish_weight_update(weight_version): see docs/gpu.md
# the sampled token's log-prob after temperature, top-k and top-p (renormalised over what they
# keep): mu under the distribution sampled from, as the torch engine records it (model/sampling.py
# names the vLLM source of these semantics)
LOGPROBS_MODE = "processed_logprobs"


def load_vllm_api() -> SimpleNamespace:
    """The vLLM names the engine uses (imported here, only when a vLLM engine is built)."""
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import WeightTransferConfig
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind
    except ImportError as err:
        raise ImportError(f"rollout.backend=vllm needs vLLM >= {MIN_VLLM} on this node "
                          f"(pip install '.[vllm]' in the GPU environment, see environment.yml): {err}") from None
    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt,
                           RequestOutputKind=RequestOutputKind, WeightTransferConfig=WeightTransferConfig,
                           LoRARequest=LoRARequest)


def meta_layout(args, dtype: str):
    """The published weight layout of a model shape, without allocating it (model.weights.layout_for)."""
    from laminar_hpc.model.weights import layout_for
    return layout_for(args, dtype)


class CudaIpcStager:
    """Copies tensors to every local GPU of the engine and returns their CUDA-IPC handles, keyed
    by GPU UUID: each vLLM worker picks the handle of its own GPU (vLLM's IPC engine)."""

    def __init__(self, devices: list[int]):
        self.devices = devices
        self._uuids: dict[int, str] | None = None

    def stage(self, items: list[tuple[str, object]]) -> tuple[list[dict], list]:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor
        if self._uuids is None:  # CUDA is first touched here, after vLLM started its workers
            self._uuids = {d: str(torch.cuda.get_device_properties(d).uuid) for d in self.devices}
        handles, keep = [], []
        for _, t in items:
            per_gpu = {}
            for d in self.devices:
                g = t.to(f"cuda:{d}")
                keep.append(g)  # the worker reads the bytes through the handle: keep them alive
                per_gpu[self._uuids[d]] = reduce_tensor(g)
            handles.append(per_gpu)
        for d in self.devices:
            torch.cuda.synchronize(d)
        return handles, keep


@dataclass
class _Seq:
    req: SeqRequest
    rid: str  # vLLM request id (unique per admission: a trajectory may come back after a migration)
    start: int  # tokens it had when admitted (a finish without new ones generated nothing)
    slot: int = 0  # with adapters: the slot of the version it decodes under


class VllmEngine:
    """Continuous batching on vLLM; one weight version at a time."""

    def __init__(self, llm, api, vcfg, *, eos_id: int, max_batch: int, temperature: float, top_p: float,
                 top_k: int = 0, stager=None, vocab_size: int | None = None, stream_seed: int = 0,
                 adapters=None):
        """`adapters`: a rollout/vllm_adapters.VllmAdapterSlots when a version is an adapter on the
        base vLLM loaded (`model.lora`): each request runs under its own version's LoRARequest."""
        self.llm, self.api, self.vcfg = llm, api, vcfg
        self.adapters = adapters
        self.slot_version = [-1] * (len(adapters.requests) if adapters is not None else 1)
        self.slot = 0  # the newest version's slot: new requests run under it
        # every request samples from its own seeded generator (SamplingParams.seed), a function of the
        # campaign's seed, the trajectory and where it resumes (model.sampling.stream_bits): a
        # restarted replica never repeats the campaign's first draws
        self.stream_seed = stream_seed
        self._vocab = vocab_size  # None: vLLM's model config says, on first use
        self.eos_id, self.max_batch = eos_id, max_batch
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.stager = stager if stager is not None else CudaIpcStager(list(range(vcfg.tensor_parallel_size)))
        self.active: dict[str, _Seq] = {}  # vLLM request id -> sequence, in admission order
        self.version = -1
        self.asleep = False
        self.prefix_cache_kept = 0  # in-flight loads after which vLLM kept prefix blocks of an older version
        self._ids = itertools.count()
        if vcfg.weight_update == "transfer_engine" and adapters is None:
            for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                         "finish_weight_update"):
                if not hasattr(llm, name):
                    raise RuntimeError(f"rollout.vllm.weight_update=transfer_engine: this vLLM has no LLM.{name} "
                                       f"(needs vLLM >= {MIN_VLLM}, or use weight_update: reload_weights)")
            llm.init_weight_transfer_engine({"init_info": {}})  # the IPC backend needs no handshake

    @classmethod
    def from_config(cls, cfg: Config, *, seed: int, eos_id: int, api=None, stager=None) -> "VllmEngine":
        """Start vLLM for `cfg` (model.hf_path: a Hugging Face directory vLLM reads config.json
        from). Its weights are dummies until the first version is pulled from the relay."""
        if not cfg.model.hf_path:
            raise ValueError("rollout.backend=vllm needs model.hf_path (a Hugging Face directory with config.json)")
        from laminar_hpc.model.hf import resolve_hf_path
        hf = resolve_hf_path(cfg.model.hf_path)  # also package:NAME; a missing path is named there
        if not hf.is_dir():
            raise ValueError(f"rollout.backend=vllm: model.hf_path {hf} is a file; vLLM starts here from a "
                             "directory with config.json (write one with laminar_hpc.model.hf.export_hf)")
        api = api or load_vllm_api()
        v = cfg.rollout.vllm
        kwargs = {}
        adapters = None
        if cfg.model.lora is not None:  # the real base, loaded once; versions are adapters (rollout/vllm_adapters.py)
            from laminar_hpc.rollout.vllm_adapters import VllmAdapterSlots, vllm_lora_kwargs
            kwargs.update(vllm_lora_kwargs(cfg), load_format="auto")
            # node-local, made here with mode 0700 under a fresh name (another user cannot plant it), removed at exit
            root = Path(tempfile.mkdtemp(prefix="laminar-adapters-", dir=cfg.relay.shm_dir or "/dev/shm"))
            adapters = VllmAdapterSlots(None, api.LoRARequest, root, cfg.model.lora, kwargs["max_loras"],
                                        base_model=str(hf))
            atexit.register(adapters.close)
        elif v.weight_update == "transfer_engine":
            # the handles travel through vLLM's RPC as a base64 pickle (ipc_handles_pickled),
            # which its workers only unpickle with this set; it must be set before they start
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            kwargs["weight_transfer_config"] = api.WeightTransferConfig(backend="ipc")
        kwargs.setdefault("load_format", "dummy")  # full versions replace every weight: no need to read them
        llm = api.LLM(model=str(hf), skip_tokenizer_init=True, tensor_parallel_size=v.tensor_parallel_size,
                      dtype=v.dtype, gpu_memory_utilization=v.gpu_memory_utilization,
                      enforce_eager=v.enforce_eager, enable_sleep_mode=v.enable_sleep_mode,
                      max_model_len=v.max_model_len or cfg.model.max_seq_len, max_num_seqs=cfg.rollout.max_batch,
                      seed=seed, logprobs_mode=LOGPROBS_MODE, **kwargs)
        if adapters is not None:
            adapters.llm = llm
        return cls(llm, api, v, eos_id=eos_id, max_batch=cfg.rollout.max_batch,
                   temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                   stager=stager, stream_seed=cfg.seed, adapters=adapters)

    @property
    def max_model_len(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def vocab_size(self) -> int | None:
        """Rows of the model's embedding: a token id must be below it (None: not known)."""
        if self._vocab is None:
            self._vocab = int(self.llm.llm_engine.model_config.get_vocab_size())  # 0 where config.json has none
        return self._vocab or None

    # -- capacity -------------------------------------------------------------------------
    def num_active(self) -> int:
        return len(self.active)

    def free_slots(self) -> int:
        return self.max_batch - len(self.active)

    def kv_tokens(self) -> int:
        return sum(len(s.req.prompt) + len(s.req.tokens) for s in self.active.values())

    def active_ids(self) -> list[str]:
        return [s.req.traj_id for s in self.active.values()]

    def spare_version_slots(self) -> int:
        if self.adapters is None:
            return 0  # one version at a time
        return len(self.slot_version) - len({s.slot for s in self.active.values()})

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, version: int, buf: memoryview, layout: WeightLayout, checksum: bool = False,
                     in_flight: bool = False) -> int | None:
        if self.adapters is not None:
            return self._load_adapter(version, buf, layout, checksum, in_flight)
        if self.active and not in_flight:
            raise VersionInFlightError(f"cannot load version {version}: {len(self.active)} trajectories of "
                                       f"version {self.version} are still generating")
        digest = None
        if checksum:  # one extra pass over the bytes; relays already verified the version
            from laminar_hpc.transport.weight_store import checksum as xxh3
            digest = xxh3(buf)
        views = layout.views(buf)  # HF name -> tensor aliasing the relay's shared memory
        # in flight (refresh with the KV kept): no sleep, which would drop the running requests' KV
        sleep_mode = self.vcfg.enable_sleep_mode and not (in_flight and self.active)
        if sleep_mode:
            # level 2 drops weights and KV cache (the weights are all replaced); buffers such as
            # rotary tables are kept by vLLM across it. Weights come back first, KV cache last.
            self.llm.sleep(level=2)
            self.llm.wake_up(tags=["weights"])
        if self.vcfg.weight_update == "transfer_engine":
            self._transfer(views, version)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(views.items())})
        if sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])  # sleep() already reset the prefix cache
        elif not self.llm.reset_prefix_cache() and self.active:
            # vLLM frees no block a running request holds: prefixes cached under the old weights may be
            # reused by new requests until those finish (counted; the sampled log-probs stay exact)
            self.prefix_cache_kept += 1
        self.asleep = False
        self.version = version
        return digest

    def _load_adapter(self, version: int, buf: memoryview, layout, checksum: bool, in_flight: bool) -> int | None:
        """An adapter version into a slot no running request uses. In flight, the running requests
        move to it: vLLM keeps a request's LoRARequest to its end, so they are taken out and added
        again under the new one (re-prefilled: their KV cannot be kept across adapters here)."""
        moved = self.abort(self.active_ids()) if in_flight else []
        slot = slot_for_version(version, self.slot_version, {s.slot for s in self.active.values()}, in_flight)
        digest = None
        if checksum:
            from laminar_hpc.transport.weight_store import checksum as xxh3
            digest = xxh3(buf)
        self.adapters.load(slot, version, layout.views(buf))
        self.slot_version[slot], self.slot = version, slot
        self.version = version
        self.add(moved)
        return digest

    def _transfer(self, views: dict, version: int) -> None:
        limit = int(self.vcfg.staging_mb * 2**20)
        self.llm.start_weight_update()
        chunk, size = [], 0
        for name, t in views.items():
            n = t.numel() * t.element_size()
            if chunk and size + n > limit:
                self._send(chunk)
                chunk, size = [], 0
            chunk.append((name, t))
            size += n
        if chunk:
            self._send(chunk)
        self.llm.finish_weight_update(weight_version=str(version))

    def _send(self, chunk: list[tuple[str, object]]) -> None:
        import base64
        import pickle
        handles, keep = self.stager.stage(chunk)
        info = {"names": [n for n, _ in chunk],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                "shapes": [list(t.shape) for _, t in chunk],
                # pickled: the handles hold a rebuild function, which vLLM's RPC encoder does not carry
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")}
        self.llm.update_weights({"update_info": info})  # returns once every worker loaded the chunk
        del keep

    def sleep(self, level: int = 1) -> None:
        """Release GPU memory while idle (vLLM sleep mode); `wake` before generating again."""
        if self.active:
            raise VersionInFlightError(f"cannot sleep: {len(self.active)} trajectories are generating")
        if not self.vcfg.enable_sleep_mode:
            raise RuntimeError("rollout.vllm.enable_sleep_mode is false: vLLM was started without sleep mode")
        self.llm.sleep(level=level)
        self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # -- generation -----------------------------------------------------------------------
    def refuse(self, request: SeqRequest) -> str | None:
        return request_problem(request, vocab_size=self.vocab_size, max_len=self.max_model_len,
                               len_name="max_model_len")

    def add(self, requests: list[SeqRequest]) -> list[StepOutput]:
        """Queue sequences; a resumed one re-prefills prompt + tokens and generates only the
        tokens it has left. Their tokens arrive from `step`. A refused request raises
        ValueError and none is queued (ask `refuse` first)."""
        if not requests:
            return []
        check_add(requests, self.free_slots(), self.version)
        if self.asleep:
            raise RuntimeError("the engine is asleep: call wake() before add()")
        limit = self.max_model_len
        plans = []
        for r in requests:  # all checked before any is queued: a refused call changes nothing
            why = self.refuse(r)
            if why is not None:
                raise ValueError(f"trajectory {r.traj_id}: {why}")
            prefix = r.prompt + r.tokens
            plans.append((r, prefix, min(r.max_new_tokens - len(r.tokens), limit - len(prefix))))
        for r, prefix, left in plans:
            params = self.api.SamplingParams(**self.sampling_kwargs(left, greedy=r.greedy),
                                             seed=self.request_seed(r))
            rid = f"{r.traj_id}#{next(self._ids)}"
            prompt = self.api.TokensPrompt(prompt_token_ids=prefix)
            if self.adapters is None:
                self.llm.llm_engine.add_request(rid, prompt, params)
            else:  # under the newest version's adapter
                self.llm.llm_engine.add_request(rid, prompt, params, lora_request=self.adapters.requests[self.slot])
            self.active[rid] = _Seq(r, rid, len(r.tokens), self.slot)
        return []

    def request_seed(self, r: SeqRequest) -> int:
        """The request's sampling seed: its trajectory's stream where it (re)starts (63 bits)."""
        return stream_bits(self.stream_seed, r.traj_id, len(r.tokens)) >> 1

    def sampling_kwargs(self, max_tokens: int, greedy: bool = False) -> dict:
        """The SamplingParams of a request that may generate `max_tokens` more tokens (`greedy`:
        evaluation, temperature 0)."""
        return dict(n=1, temperature=0.0 if greedy else self.temperature, top_p=self.top_p,
                    top_k=self.top_k,  # 0: off, in rollout.top_k and in vLLM >= 0.29 alike (older ones wanted -1)
                    max_tokens=max_tokens,
                    logprobs=0,  # the sampled token's log-prob only
                    stop_token_ids=[self.eos_id],  # no tokenizer in the engine: EOS is named here
                    detokenize=False, output_kind=self.api.RequestOutputKind.DELTA)

    def step(self) -> list[StepOutput]:
        """One engine step: every sequence's new tokens since the last step (DELTA outputs)."""
        if not self.active:
            return []
        outs = []
        for ro in self.llm.llm_engine.step():
            seq = self.active.get(ro.request_id)
            if seq is None:
                continue  # aborted meanwhile
            try:
                comp = ro.outputs[0]
                toks = list(comp.token_ids)
                lps = _sampled_logprobs(toks, comp.logprobs, ro.request_id)
            except (IndexError, RuntimeError, KeyError, TypeError) as err:  # this request's output is unusable
                outs.append(self._failed(seq, ro.finished, f"vLLM request {ro.request_id}: unusable output ({err})"))
                continue
            # finish_reason: None until finished (the stand-in of the tests has none at all)
            why = _failure(ro.finished, getattr(comp, "finish_reason", None),
                           len(seq.req.tokens) + len(toks) - seq.start)
            if why is not None:
                outs.append(self._failed(seq, ro.finished, f"vLLM request {ro.request_id}: {why}"))
                continue
            seq.req.tokens.extend(toks)
            seq.req.logprobs.extend(lps)
            if ro.finished:
                del self.active[ro.request_id]
            outs.append(StepOutput(seq.req.traj_id, toks, lps, ro.finished, seq.req if ro.finished else None))
        return outs

    def _failed(self, seq: _Seq, finished: bool, why: str) -> StepOutput:
        """Drop one request (vLLM's copy too, if it still runs) and finish it with an error."""
        del self.active[seq.rid]
        if not finished:
            self.llm.llm_engine.abort_request([seq.rid])
        return StepOutput(seq.req.traj_id, [], [], True, seq.req, error=why)

    def abort(self, traj_ids: list[str]) -> list[SeqRequest]:
        """Remove sequences and return them with the tokens streamed so far (tokens the engine
        sampled but `step` has not returned are dropped with them)."""
        wanted = set(traj_ids)
        rids = [rid for rid, s in self.active.items() if s.req.traj_id in wanted]
        if rids:
            self.llm.llm_engine.abort_request(rids)
        return [self.active.pop(rid).req for rid in rids]


def _failure(finished: bool, reason: str | None, new_tokens: int) -> str | None:
    """Why a request vLLM reports on failed, or None. Our own aborts never reach `step`'s
    outputs (their ids left `active` first), so an "abort" here is vLLM's."""
    if reason in ("error", "abort"):
        return f"vLLM finished it with finish_reason={reason!r}"
    if finished and new_tokens <= 0:
        return f"vLLM finished it without generating a token (finish_reason={reason!r})"
    return None


def _sampled_logprobs(tokens: list[int], logprobs, rid: str) -> list[float]:
    """Log-prob of each sampled token from vLLM's per-position {token_id: Logprob} maps."""
    if not tokens:
        return []
    if logprobs is None or len(logprobs) < len(tokens):
        raise RuntimeError(f"vLLM request {rid}: {len(tokens)} new tokens but "
                           f"{0 if logprobs is None else len(logprobs)} log-prob entries (SamplingParams.logprobs=0)")
    tail = logprobs[len(logprobs) - len(tokens):]  # DELTA outputs: the entries of the new tokens
    return [float(pos[t].logprob) for t, pos in zip(tokens, tail)]
