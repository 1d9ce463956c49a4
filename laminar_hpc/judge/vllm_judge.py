"""A judge on vLLM (`task.reward.judge.engine: vllm`, extra `vllm`, GPU nodes only): the kinds and
scores of the torch judge (judge_model.py), from vLLM's offline `LLM`, fed token ids from the
judge's own tokenizer (`skip_tokenizer_init`, as the rollouts' vLLM engine).

- `generative`: `LLM.generate`, greedy (temperature 0), at most `max_new_tokens` and the room the
  context leaves, stopping at the tokenizer's end token; the verdict is read as the torch judge's.
- `label`: one step with `SamplingParams.logprob_token_ids` set to the labels' first tokens: their
  log-probs under the raw logits (vLLM's default logprobs mode), normalised over the labels as
  the torch judge does.
- `classifier`: `LLM(runner="pooling").classify` with `PoolingParams(use_activation=False)`: the
  head's logits, read as the torch judge reads them (one label: the scalar; two: the second's
  softmax probability).

    judge = VllmJudge.build(cfg.task.reward.judge)     # judge/server.py, for engine: vllm
    judge.score([("2+3=", "5", "5"), ...])             # [Scored(score, error, verdict), ...]

Nothing imports vllm until a judge is built (`load_vllm_api`). The vLLM names used and their
sources are in docs/gpu.md; they are checked against a CPU stand-in computed by a torch model
(tests/vllm_standin.py: the same scores as the torch judge), not yet on a real vLLM.
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import TYPE_CHECKING

from laminar_hpc.judge.judge_model import JudgeModelError, Scored, check_classifier, judge_prompts, label_ids
from laminar_hpc.judge.verdicts import SHOWN, label_score, read_verdict

if TYPE_CHECKING:
    from laminar_hpc.config.judge import JudgeCfg


def load_vllm_api() -> SimpleNamespace:
    """The vLLM names a judge uses (imported only when a vLLM judge is built)."""
    try:
        from vllm import LLM, PoolingParams, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise ImportError("task.reward.judge.engine=vllm needs vLLM on this node (pip install '.[vllm]' in the "
                          f"GPU environment, see environment.yml): {err}") from None
    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, PoolingParams=PoolingParams,
                           TokensPrompt=TokensPrompt)


def llm_kwargs(cfg: JudgeCfg, model_dir: str) -> dict:
    """What `vllm.LLM` is built with for this judge."""
    v = cfg.vllm
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, tensor_parallel_size=v.tensor_parallel_size,
                  dtype=v.dtype, gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
                  max_model_len=cfg.model.max_seq_len, max_num_seqs=cfg.batch_size, seed=cfg.seed)
    if cfg.kind == "classifier":
        kwargs["runner"] = "pooling"  # a ...ForSequenceClassification head, no generation
    return kwargs


def classifier_labels(hf) -> int:
    """A classifier checkpoint's number of labels, from its config.json, refused (check_classifier)
    unless it is a reward model's, before vLLM starts."""
    conf = json.loads((hf / "config.json").read_text())
    n = len(conf.get("id2label") or {}) or int(conf.get("num_labels", 2))
    check_classifier(hf, list(conf.get("architectures") or []), n)
    return n


class VllmJudge:
    def __init__(self, cfg: JudgeCfg, tok, llm, api):
        self.cfg, self.tok, self.llm, self.api = cfg, tok, llm, api
        self.max_len = cfg.model.max_seq_len
        conf = llm.llm_engine.model_config
        self.vocab = int(conf.get_vocab_size()) or None  # token ids at or above it never reach vLLM
        self.label_ids = label_ids(cfg, tok)

    @classmethod
    def build(cls, cfg: JudgeCfg, api=None) -> "VllmJudge":
        from laminar_hpc.model.factory import build_tokenizer
        from laminar_hpc.model.hf import resolve_hf_path
        hf = resolve_hf_path(cfg.model.hf_path)  # also package:NAME; a missing path is named there
        if not hf.is_dir():
            raise JudgeModelError(f"task.reward.judge.model.hf_path: {hf} is a file; vLLM loads a directory with "
                                  "config.json (write one with laminar export-hf)")
        if cfg.kind == "classifier":
            classifier_labels(hf)
        api = api or load_vllm_api()
        return cls(cfg, build_tokenizer(cfg.model), api.LLM(**llm_kwargs(cfg, str(hf))), api)

    def score(self, requests: list[tuple[str, str, str]]) -> list[Scored]:
        """(problem, response, answer) each -> its Scored, in order (judge_model.JudgeModel.score's contract)."""
        room = {"label": 1, "generative": 2}.get(self.cfg.kind, 0)  # as the torch judge: room to answer
        out, prompts, where = judge_prompts(requests, self.tok, self.cfg, self.max_len, room, vocab=self.vocab)
        if prompts:
            kind = {"label": self._labels, "generative": self._generate, "classifier": self._classify}[self.cfg.kind]
            for i, s in zip(where, kind(prompts)):
                out[i] = s
        return out  # type: ignore[return-value]

    def _prompts(self, prompts: list[list[int]]) -> list:
        return [self.api.TokensPrompt(prompt_token_ids=p) for p in prompts]

    def _labels(self, prompts: list[list[int]]) -> list[Scored]:
        ids = list(self.label_ids.values())
        params = self.api.SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=ids, detokenize=False)
        out = []
        for res in self.llm.generate(self._prompts(prompts), params, use_tqdm=False):
            first = res.outputs[0].logprobs[0]  # {token id: Logprob} at the first generated position
            p = {name: math.exp(first[t].logprob) for name, t in self.label_ids.items()}  # over the vocabulary
            out.append(Scored(label_score(p, self.cfg.labels),  # (normalised over the labels there)
                              verdict=" ".join(f"{n.strip()}:{v:.3f}" for n, v in p.items())))
        return out

    def _generate(self, prompts: list[list[int]]) -> list[Scored]:
        params = [self.api.SamplingParams(temperature=0.0, max_tokens=min(self.cfg.max_new_tokens, self.max_len - len(p)),
                                          stop_token_ids=[self.tok.eos_id], detokenize=False) for p in prompts]
        out = []
        for res in self.llm.generate(self._prompts(prompts), params, use_tqdm=False):
            text = self.tok.decode([t for t in res.outputs[0].token_ids if t != self.tok.eos_id])
            score, why = read_verdict(text, self.cfg)
            out.append(Scored(score, why, text[:SHOWN]))
        return out

    def _classify(self, prompts: list[list[int]]) -> list[Scored]:
        raw = self.api.PoolingParams(use_activation=False)  # the head's logits, read below as the torch judge's
        out = []
        for res in self.llm.classify(self._prompts(prompts), pooling_params=raw, use_tqdm=False):
            logits = list(res.outputs.probs)
            if len(logits) == 1:
                value = float(logits[0])
            else:
                top = max(logits)
                exps = [math.exp(x - top) for x in logits]
                value = exps[1] / sum(exps)
            out.append(Scored(value, verdict=f"{value:.4f}"))
        return out
