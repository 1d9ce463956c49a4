"""The torch engine's behaviour log-probs (mu) against vLLM's, under the SamplingParams and
logprobs_mode the vLLM adapter (rollout/vllm_engine.py) actually sends: an independent numpy
reference of vLLM v1's computation, driven by the adapter's own settings."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from laminar_hpc.config import config_from_dict
from laminar_hpc.model.sampling import processed_logits, sample_tokens
from laminar_hpc.rollout.engine_interface import SeqRequest
from laminar_hpc.rollout.vllm_engine import VllmEngine
from test_vllm_adapter import ARGS, EOS, layout_and_buffer
from vllm_standin import RecordingStager, standin_api


# -- sampling: the torch engine's mu under the settings the adapter gives vLLM ---------------------
def _log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    top = finite.max()
    return x - (top + np.log(np.exp(finite - top).sum()))


def vllm_logprobs(logits: np.ndarray, params: dict, logprobs_mode: str) -> np.ndarray:
    """The log-probs vLLM returns for one row of logits, as its v1 sampler computes them (read in
    vLLM's source; numpy, float64):
    - vllm/v1/sample/sampler.py, Sampler.forward/sample: "raw_logprobs" is log_softmax of the raw
      logits; otherwise, with temperature < 1e-5 (greedy), log_softmax of the raw logits too;
      else the logits are divided by the temperature, then top-k and top-p mask them.
    - vllm/v1/worker/gpu_input_batch.py: top-k applies only when 0 < top_k < vocab.
    - vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch: sort ascending; top-k
      masks values below the k-th largest; top-p takes the softmax of what is left, a running sum
      from the least probable token, and masks where it is <= 1 - top_p, never the largest;
      forward_native's "processed_logprobs" is log_softmax of the masked logits."""
    x = logits.astype(np.float64)
    if logprobs_mode == "raw_logprobs" or params["temperature"] < 1e-5:
        return _log_softmax(x)
    assert logprobs_mode == "processed_logprobs", logprobs_mode
    x = x / params["temperature"]
    vocab, k, p = x.size, params.get("top_k", 0), params.get("top_p", 1.0)
    order = np.argsort(x, kind="stable")
    s = x[order]
    if 0 < k < vocab:
        s = np.where(s < s[vocab - k], -np.inf, s)
    if p < 1.0:
        w = np.exp(s - s[-1])
        running = np.cumsum(w / w.sum())
        drop = running <= 1.0 - p
        drop[-1] = False
        s = np.where(drop, -np.inf, s)
    out = np.empty_like(s)
    out[order] = s
    return _log_softmax(out)


def vllm_started(cfg_rollout: dict, tmp_path, monkeypatch):
    """A VllmEngine built by from_config (as the rollout role builds it), weights loaded: (cfg, engine, llm)."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "")  # recorded: the engine's setting is undone
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION")
    cfg = config_from_dict({"model": {"hf_path": str(tmp_path)}, "rollout": {"backend": "vllm", **cfg_rollout}})
    engine = VllmEngine.from_config(cfg, seed=0, eos_id=EOS, api=standin_api(), stager=RecordingStager())
    engine.llm.llm_engine.model_config.get_vocab_size = lambda: ARGS.vocab_size
    layout, buf = layout_and_buffer()
    engine.load_weights(1, memoryview(buf), layout)
    return cfg, engine, engine.llm


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("top_k", [0, 5, 50])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_torch_sampler_and_vllm_settings_give_the_same_mu(temperature, top_k, top_p, tmp_path, monkeypatch):
    """The same logits through the torch engine's sampler and through vLLM's computation under the
    SamplingParams and logprobs_mode the adapter actually sends: the same kept set, the same mu.
    Before: the torch engine's mu was the full tempered softmax's, and top_k never reached vLLM."""
    cfg, engine, llm = vllm_started({"temperature": temperature, "top_k": top_k, "top_p": top_p},
                                    tmp_path, monkeypatch)
    engine.add([SeqRequest("a", [5, 6], 8)])
    (params,) = [sp.kwargs for sp in llm.llm_engine.params.values()]
    assert (params["temperature"], params["top_k"], params["top_p"]) == (temperature, top_k, top_p)
    mode = llm.kwargs["logprobs_mode"]
    r = cfg.rollout
    g = torch.Generator().manual_seed(int(temperature * 100) + top_k + int(top_p * 10))
    logits = torch.randn(64, ARGS.vocab_size, generator=g) * 3
    toks, mu = sample_tokens(logits, r.temperature, r.top_p, g, top_k=r.top_k)
    kept = torch.isfinite(processed_logits(logits, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p))
    for i in range(64):
        ref = vllm_logprobs(logits[i].numpy(), params, mode)
        assert np.array_equal(np.isfinite(ref), kept[i].numpy()), i
        assert abs(mu[i].item() - ref[toks[i].item()]) < 1e-5, (i, mu[i].item(), ref[toks[i].item()])


def test_the_reference_tells_processed_from_full_softmax_log_probs():
    """The comparison above can fail: under top-p 0.5 the full softmax's log-prob (the old mu) is
    far from vLLM's processed one, and "raw_logprobs" would give the untempered softmax."""
    g = torch.Generator().manual_seed(9)
    row = (torch.randn(ARGS.vocab_size, generator=g) * 3).numpy()
    params = {"temperature": 1.3, "top_k": 0, "top_p": 0.5}
    processed = vllm_logprobs(row, params, "processed_logprobs")
    full = torch.log_softmax(torch.from_numpy(row).double() / 1.3, -1).numpy()
    top = int(np.argmax(row))
    assert processed[top] - full[top] > 0.1
    raw = torch.log_softmax(torch.from_numpy(row).double(), -1).numpy()
    assert np.allclose(vllm_logprobs(row, params, "raw_logprobs"), raw)
