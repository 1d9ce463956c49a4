"""The judge on vLLM (judge/vllm_judge.py, `task.reward.judge.engine: vllm`), without a GPU: against
a stand-in of vLLM's offline LLM computed by the torch judge's own model (tests/vllm_standin.py),
each kind scores as the torch judge does, and asks vLLM for what it should (greedy, the label
tokens' log-probs, the classifier's raw logits, the engine's arguments)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_judge import REQUESTS, _hf_checkpoint, _model
from vllm_standin import PoolingParams, SamplingParams, TokensPrompt, TorchBackedLLM

from laminar_hpc.config import config_from_dict
from laminar_hpc.config.judge import JudgeCfg
from laminar_hpc.config.load import ConfigError
from laminar_hpc.judge.judge_model import JudgeModelError
from laminar_hpc.judge.vllm_judge import VllmJudge, llm_kwargs


def api(llm=None):
    return SimpleNamespace(LLM=llm, SamplingParams=SamplingParams, PoolingParams=PoolingParams,
                           TokensPrompt=TokensPrompt)


def on_vllm(torch_judge, **llm):
    """A VllmJudge of the same config, its LLM the stand-in computed by the torch judge's model."""
    cfg = torch_judge.cfg
    stand_in = TorchBackedLLM(vocab=torch_judge.model.args.vocab_size if hasattr(torch_judge.model, "args") else 0,
                              max_model_len=cfg.model.max_seq_len, **llm)
    return VllmJudge(cfg, torch_judge.tok, stand_in, api()), stand_in


def test_a_label_judge_on_vllm_reads_the_labels_log_probs_as_the_torch_judge():
    torch_judge = _model(kind="label")
    judge, llm = on_vllm(torch_judge, causal=torch_judge.model)
    got, want = judge.score(REQUESTS), torch_judge.score(REQUESTS)
    assert [s.score for s in got] == pytest.approx([s.score for s in want], abs=1e-5)
    assert [s.verdict for s in got] == [s.verdict for s in want] and all(s.error is None for s in got)
    (name, prompts, params), = llm.calls  # one batch for the whole request list
    assert name == "generate" and len(prompts) == len(REQUESTS)
    assert params.max_tokens == 1 and params.temperature == 0.0
    assert params.logprob_token_ids == list(torch_judge.label_ids.values())


def test_a_generative_judge_on_vllm_writes_the_torch_judges_verdicts():
    torch_judge = _model(kind="generative", parse="number", max_new_tokens=6)
    judge, llm = on_vllm(torch_judge, causal=torch_judge.model)
    got, want = judge.score(REQUESTS), torch_judge.score(REQUESTS)
    assert [(s.verdict, s.score, s.error) for s in got] == [(s.verdict, s.score, s.error) for s in want]
    _, prompts, params = llm.calls[0]
    assert all(p.temperature == 0.0 and p.stop_token_ids == [torch_judge.tok.eos_id] for p in params)
    # at most max_new_tokens, and never past the judge's context
    assert [p.max_tokens for p in params] == [min(6, 48 - len(ids)) for ids in prompts]


@pytest.mark.parametrize("labels", [1, 2])
def test_a_classifier_on_vllm_reads_the_heads_logits_as_the_torch_judge(tmp_path, labels):
    path = _hf_checkpoint(tmp_path, "LlamaForSequenceClassification", num_labels=labels)
    torch_judge = _model(kind="classifier", model={"hf_path": path, "max_seq_len": 64})
    judge, llm = on_vllm(torch_judge, classifier=torch_judge.model)
    got, want = judge.score(REQUESTS), torch_judge.score(REQUESTS)
    assert [s.score for s in got] == pytest.approx([s.score for s in want], abs=1e-5)
    assert llm.calls[0][2].use_activation is False  # the logits, not vLLM's softmax or sigmoid


def test_a_vllm_judge_is_built_from_its_config(tmp_path):
    path = _hf_checkpoint(tmp_path, "LlamaForSequenceClassification", num_labels=1)
    cfg = JudgeCfg(kind="classifier", engine="vllm", batch_size=16, model={"hf_path": path, "max_seq_len": 64},
                   vllm={"tensor_parallel_size": 2, "dtype": "float16"})
    made = {}

    def build_llm(**kwargs):
        made.update(kwargs)
        return TorchBackedLLM(vocab=100, max_model_len=kwargs["max_model_len"])
    judge = VllmJudge.build(cfg, api=api(build_llm))
    assert made == llm_kwargs(cfg, path) and made["runner"] == "pooling" and made["skip_tokenizer_init"]
    assert (made["max_model_len"], made["max_num_seqs"], made["tensor_parallel_size"], made["dtype"]) == (64, 16, 2,
                                                                                                          "float16")
    assert judge.vocab == 100
    label = cfg.model_copy(update={"kind": "label"})
    assert "runner" not in llm_kwargs(label, path)  # a causal model generates


def test_a_checkpoint_with_three_labels_is_refused_before_vllm_starts(tmp_path):
    path = _hf_checkpoint(tmp_path, "LlamaForSequenceClassification", num_labels=3)
    cfg = JudgeCfg(kind="classifier", engine="vllm", model={"hf_path": path, "max_seq_len": 64})

    def no_llm(**kwargs):
        raise AssertionError("vLLM was started for a checkpoint that cannot be a reward model")
    with pytest.raises(JudgeModelError, match="has 3 labels; a reward model has one"):
        VllmJudge.build(cfg, api=api(no_llm))


@pytest.mark.parametrize("judge", [{"engine": "vllm"}, {"engine": "vllm", "kind": "emulated"},
                                   {"engine": "vllm", "init_checkpoint": "j.pt"}])
def test_a_vllm_judge_without_a_hugging_face_directory_is_one_line(judge):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"task": {"reward": {"fn": "judge", "judge": judge}}})
    assert "task.reward" in str(err.value) and "engine: vllm loads a Hugging Face directory" in str(err.value)
