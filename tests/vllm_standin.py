"""A recording stand-in for the vLLM objects `laminar_hpc.rollout.vllm_engine` uses (tests only).

It mimics the shapes the adapter relies on (LLM, LLMEngine.add_request/step/abort_request,
SamplingParams, TokensPrompt, RequestOutputKind.DELTA, per-position {token_id: Logprob} maps,
the weight-transfer calls) and records every call in order, so tests can check what the
adapter asked of vLLM. Generation is a pure function of (trajectory, absolute position): a
sequence aborted and re-prefilled elsewhere continues exactly as if it had never stopped.

    api = standin_api()
    llm = api.LLM(model="m", max_model_len=64)
    engine = VllmEngine(llm, api, vcfg, eos_id=2, max_batch=4, temperature=1.0, top_p=1.0,
                        stager=RecordingStager())
"""
from __future__ import annotations

import base64
import enum
import pickle
from dataclasses import dataclass
from types import SimpleNamespace


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    """Records its kwargs; refuses what vLLM's SamplingParams refuses among the fields the adapter
    sets (vllm/sampling_params.py: top_k 0 or -1 is off, top_p in (0, 1], temperature >= 0)."""

    def __init__(self, **kwargs):
        top_k, top_p, temp = kwargs.get("top_k", 0), kwargs.get("top_p", 1.0), kwargs.get("temperature", 1.0)
        if not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if temp < 0.0:
            raise ValueError(f"temperature must be non-negative, got {temp}.")
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


def TokensPrompt(**kwargs) -> dict:  # noqa: N802 - vLLM's TypedDict is called like a class
    return dict(kwargs)


class WeightTransferConfig:
    def __init__(self, backend: str = "nccl"):
        self.backend = backend


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


def token_at(traj: str, pos: int, vocab: int) -> int:
    """The token the stand-in samples for trajectory `traj` at absolute position `pos`."""
    return 4 + (pos * 31 + sum(map(ord, traj))) % (vocab - 4)


def logprob_at(pos: int) -> float:
    return -((pos % 5) + 1) / 10


@dataclass
class _Req:
    rid: str
    traj: str
    tokens: list[int]  # prompt + everything generated
    prompt_len: int
    params: SamplingParams
    generated: int = 0


class StandinEngine:
    """LLMEngine's request API: DELTA outputs, `tokens_per_step` new tokens per step."""

    def __init__(self, calls: list, *, vocab: int, max_model_len: int, eos_at: dict[str, int], tokens_per_step: int):
        self.calls, self.vocab, self.eos_at, self.tokens_per_step = calls, vocab, eos_at, tokens_per_step
        self.model_config = SimpleNamespace(max_model_len=max_model_len)
        self.reqs: dict[str, _Req] = {}
        self.params: dict[str, SamplingParams] = {}  # request id -> the SamplingParams it was added with
        self.loras: dict[int, str] = {}  # LoRA id -> the adapter directory it was loaded from

    def add_lora(self, lora_request) -> bool:
        """As vLLM: id > 0; the directory must hold PEFT's two files."""
        from pathlib import Path
        assert lora_request.lora_int_id > 0, "lora_id must be greater than 0."
        path = Path(lora_request.lora_path)
        ok = (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
        self.calls.append(("add_lora", lora_request.lora_int_id, lora_request.lora_name, ok))
        if ok:
            self.loras[lora_request.lora_int_id] = str(path)
        return ok

    def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove_lora", lora_id))
        return self.loras.pop(lora_id, None) is not None

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams, lora_request=None) -> None:
        ids = list(prompt["prompt_token_ids"])
        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            raise ValueError(f"LoRA {lora_request.lora_int_id} is not loaded")  # (vLLM would load it from its path)
        self.calls.append(("add_request", request_id, ids, params.max_tokens)
                          + ((lora_request.lora_int_id,) if lora_request is not None else ()))
        if request_id in self.reqs:
            raise ValueError(f"request id {request_id} is already running")
        self.reqs[request_id] = _Req(request_id, request_id.split("#")[0], ids, len(ids), params)
        self.params[request_id] = params

    def abort_request(self, request_ids) -> None:
        ids = list(request_ids)
        self.calls.append(("abort_request", ids))
        for rid in ids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestOutput]:
        outs = []
        for r in list(self.reqs.values()):
            toks, lps, done = [], [], False
            for _ in range(self.tokens_per_step):
                pos = len(r.tokens)
                if self.eos_at.get(r.traj) == pos:
                    tok = r.params.stop_token_ids[0]
                else:
                    tok = token_at(r.traj, pos, self.vocab)
                # the sampled token first; a second entry checks that the adapter picks by token id
                lps.append({(tok + 1) % self.vocab: Logprob(-0.01), tok: Logprob(logprob_at(pos))})
                toks.append(tok)
                r.tokens.append(tok)
                r.generated += 1
                if tok in r.params.stop_token_ids or r.generated >= r.params.max_tokens:
                    done = True
                    break
            outs.append(RequestOutput(r.rid, [CompletionOutput(toks, lps)], done))
            if done:
                del self.reqs[r.rid]
        return outs


class StandinLLM:
    """`vllm.LLM`: the constructor's kwargs, the weight-transfer calls, sleep/wake, RPC."""

    def __init__(self, model: str = "m", *, vocab: int = 100, eos_at: dict[str, int] | None = None,
                 tokens_per_step: int = 1, **kwargs):
        self.model, self.kwargs = model, kwargs  # kwargs: what vllm.LLM would receive
        self.calls: list[tuple] = []
        self.llm_engine = StandinEngine(self.calls, vocab=vocab, max_model_len=kwargs.get("max_model_len") or 64,
                                        eos_at=eos_at or {}, tokens_per_step=tokens_per_step)
        self.updated_names: list[str] = []
        self.updating = False

    def init_weight_transfer_engine(self, request: dict) -> None:
        self.calls.append(("init_weight_transfer_engine", request["init_info"]))

    def start_weight_update(self) -> None:
        if self.updating:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.updating = True
        self.calls.append(("start_weight_update",))

    def update_weights(self, request: dict) -> None:
        info = request["update_info"]
        if not self.updating:
            raise RuntimeError("update_weights outside start/finish")
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        if not (len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]) == len(handles)):
            raise ValueError("update_info lists differ in length")
        self.updated_names += info["names"]
        self.calls.append(("update_weights", list(info["names"]), list(info["dtype_names"]), info["shapes"], handles))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.updating = False
        self.calls.append(("finish_weight_update", weight_version))

    def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs: dict | None = None):
        self.calls.append(("collective_rpc", method, kwargs or {}))
        return [None]

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self) -> bool:
        """As vLLM: False (nothing reset) while a running request still holds cache blocks."""
        self.calls.append(("reset_prefix_cache",))
        return not self.llm_engine.reqs

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class PoolingParams:
    """Records its kwargs (`use_activation`: None or True applies the classifier's softmax, as vLLM)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.use_activation = kwargs.get("use_activation")


class TorchBackedLLM:
    """`vllm.LLM`'s offline `generate` and `classify`, computed by a torch model (a test's judge
    model: model/llama.py's, or a transformers ...ForSequenceClassification): greedy decoding by a
    full forward pass per token, `logprob_token_ids` as log-softmax of the raw logits, `classify`'s
    `probs` the head's logits, softmaxed unless use_activation=False. Lets a test compare an
    adapter's reading of vLLM's outputs with the torch path on the same weights."""

    def __init__(self, causal=None, classifier=None, *, vocab: int, max_model_len: int, **kwargs):
        self.causal, self.classifier, self.kwargs = causal, classifier, kwargs
        self.calls: list[tuple] = []
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=max_model_len,
                                                                       get_vocab_size=lambda: vocab))

    def generate(self, prompts, sampling_params, use_tqdm=True):
        import torch
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], sampling_params))
        outs = []
        with torch.inference_mode():
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                ids, toks, lps = list(prompt["prompt_token_ids"]), [], []
                for _ in range(sp.max_tokens):
                    logits = self.causal(torch.tensor([ids]))[0, -1].float()
                    tok = int(logits.argmax())  # temperature 0
                    logp = torch.log_softmax(logits, dim=-1)
                    wanted = getattr(sp, "logprob_token_ids", None) or []
                    lps.append({t: Logprob(float(logp[t])) for t in [*wanted, tok]})
                    toks.append(tok)
                    ids.append(tok)
                    if tok in (getattr(sp, "stop_token_ids", None) or []):
                        break
                outs.append(RequestOutput(str(i), [CompletionOutput(toks, lps)], True))
        return outs

    def classify(self, prompts, pooling_params=None, use_tqdm=True):
        import torch
        self.calls.append(("classify", [p["prompt_token_ids"] for p in prompts], pooling_params))
        outs = []
        with torch.inference_mode():
            for prompt in prompts:
                logits = self.classifier(input_ids=torch.tensor([prompt["prompt_token_ids"]])).logits[0].float()
                if pooling_params is None or pooling_params.use_activation is not False:
                    logits = torch.softmax(logits, dim=-1)
                outs.append(SimpleNamespace(outputs=SimpleNamespace(probs=logits.tolist())))
        return outs


class RecordingStager:
    """Stands in for the CUDA-IPC stager: records the tensors it was given (to check that they
    alias the relay's buffer) and returns picklable fake handles, one per GPU."""

    def __init__(self, gpus: tuple[str, ...] = ("GPU-0",)):
        self.gpus = gpus
        self.staged: list[tuple[str, object]] = []

    def stage(self, items):
        self.staged += items
        return [{g: ("rebuild", name) for g in self.gpus} for name, _ in items], []


def standin_api() -> SimpleNamespace:
    """What `vllm_engine.load_vllm_api()` returns, made of stand-ins."""
    return SimpleNamespace(LLM=StandinLLM, SamplingParams=SamplingParams, TokensPrompt=TokensPrompt,
                           RequestOutputKind=RequestOutputKind, WeightTransferConfig=WeightTransferConfig,
                           LoRARequest=LoRARequest)


@dataclass(frozen=True)
class LoRARequest:
    """vllm.lora.request.LoRARequest's three fields the engine sets."""
    lora_name: str
    lora_int_id: int
    lora_path: str
