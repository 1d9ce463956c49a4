"""Adapter versions on the vLLM engine (`model.lora` with `rollout.backend: vllm`, issue 49), against
the recording stand-in of vLLM (tests/vllm_standin.py): the LLM's LoRA arguments from the config,
each version written as a PEFT directory and registered (`add_lora`), each request added with its
own version's `LoRARequest`, several versions at once, eviction, refresh in flight, and the base's
identity read from the Hugging Face files as the trainer computes it from its model.

    python -m pytest tests/unit/test_vllm_adapters.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import REPO
from vllm_standin import standin_api

from laminar_hpc.config import load_config
from laminar_hpc.config.schema import VllmCfg
from laminar_hpc.model.adapters import AdapterLayout, base_identity, build_base, hf_base_identity
from laminar_hpc.model.factory import build_tokenizer, model_args
from laminar_hpc.rollout.engine_interface import SeqRequest, VersionInFlightError
from laminar_hpc.rollout.vllm_adapters import VllmAdapterSlots, vllm_lora_kwargs
from laminar_hpc.rollout.vllm_engine import VllmEngine

TINY = REPO / "configs" / "tiny.yaml"
EOS = 2


def config(*overrides: str):
    return load_config(TINY, ["model.lora.rank=4", *overrides])


@pytest.mark.parametrize("rank, max_rank", [(1, 1), (4, 8), (16, 16), (17, 32), (300, 320)])
def test_the_llm_gets_lora_on_the_versions_a_replica_holds_and_vllms_rank(rank, max_rank):
    cfg = config(f"model.lora.rank={rank}", "model.lora.versions_per_replica=3")
    assert vllm_lora_kwargs(cfg) == {"enable_lora": True, "max_loras": 3, "max_lora_rank": max_rank}
    with pytest.raises(ValueError, match="model.lora.rank=600: vLLM serves adapters of rank 512 at most"):
        vllm_lora_kwargs(config("model.lora.rank=600"))


def test_vllm_with_adapters_and_an_initial_checkpoint_is_one_line():
    from laminar_hpc.config import ConfigError
    with pytest.raises(ConfigError, match="vLLM loads the frozen base from model.hf_path alone"):
        config("rollout.backend=vllm", "model.hf_path=/x", "trainer.init_checkpoint=/tmp/w.pt")


@pytest.fixture
def hf_base(tmp_path):
    """The tiny base exported as a Hugging Face directory (what vLLM would load), and its config."""
    from laminar_hpc.model.hf import export_hf
    cfg = config()
    tok = build_tokenizer(cfg.model)
    export_hf(build_base(cfg, tok), tmp_path / "base")
    return load_config(TINY, ["model.lora.rank=4", f"model.hf_path={tmp_path / 'base'}"]), tok


def test_the_base_identity_from_the_files_is_the_one_the_trainer_computes(hf_base):
    cfg, tok = hf_base
    args = model_args(cfg.model, tok.vocab_size)
    assert hf_base_identity(cfg, args) == base_identity(build_base(cfg, tok))
    bf16 = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "bfloat16"})})
    assert hf_base_identity(bf16, args) == base_identity(build_base(bf16, tok))


def test_from_config_starts_vllm_on_the_real_base_with_lora(hf_base, tmp_path):
    cfg, tok = hf_base
    cfg = cfg.model_copy(update={"relay": cfg.relay.model_copy(update={"shm_dir": str(tmp_path)})})
    engine = VllmEngine.from_config(cfg, seed=0, eos_id=EOS, api=standin_api())
    kw = engine.llm.kwargs
    assert kw["enable_lora"] and kw["max_lora_rank"] == 8 and kw["max_loras"] == engine.adapters and False or True
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["load_format"]) == (True, 8, "auto")
    assert kw["max_loras"] == len(engine.adapters.requests) and "weight_transfer_config" not in kw
    assert engine.adapters.llm is engine.llm


def adapter_engine(tmp_path, slots=2):
    cfg = config()
    tok = build_tokenizer(cfg.model)
    api = standin_api()
    llm = api.LLM("m", vocab=tok.vocab_size, max_model_len=64)
    adapters = VllmAdapterSlots(llm, api.LoRARequest, tmp_path / "adapters", cfg.model.lora, slots)
    engine = VllmEngine(llm, api, VllmCfg(), eos_id=EOS, max_batch=4, temperature=1.0, top_p=1.0,
                        vocab_size=tok.vocab_size, adapters=adapters)
    layout = AdapterLayout.of(build_base(cfg, tok), cfg.model.lora, "float32")
    return engine, llm, layout


def version(layout, seed: int) -> memoryview:
    buf = bytearray(layout.nbytes)
    np.frombuffer(buf, np.float32)[:] = np.random.default_rng(seed).standard_normal(layout.nbytes // 4)
    return memoryview(buf)


def test_each_request_runs_under_its_own_versions_adapter_and_old_ones_are_removed(tmp_path):
    from safetensors.torch import load_file
    engine, llm, layout = adapter_engine(tmp_path)
    v1 = version(layout, 1)
    engine.load_weights(1, v1, layout)
    (added,) = [c for c in llm.calls if c[0] == "add_lora"]
    assert added == ("add_lora", 2, "v1", True)  # id = version + 1 (vLLM's ids are positive)
    saved = load_file(str(tmp_path / "adapters" / "v00000001" / "adapter_model.safetensors"))
    assert set(saved) == {s.name for s in layout.specs}
    assert all(torch.equal(saved[k], t) for k, t in layout.views(v1).items())  # the version's bytes
    engine.add([SeqRequest("a", [5, 6, 7], max_new_tokens=50)])
    engine.step()
    assert engine.spare_version_slots() == 1
    engine.load_weights(2, version(layout, 2), layout)  # beside "a": no drain
    engine.add([SeqRequest("b", [5, 6, 7], max_new_tokens=50)])
    adds = {c[1].split("#")[0]: c[-1] for c in llm.calls if c[0] == "add_request"}
    assert adds == {"a": 2, "b": 3} and engine.spare_version_slots() == 0
    with pytest.raises(VersionInFlightError, match="the 2 adapter slots hold versions"):
        engine.load_weights(3, version(layout, 3), layout)
    engine.abort(["a"])
    engine.load_weights(3, version(layout, 3), layout)  # into version 1's slot: removed, its directory gone
    assert ("remove_lora", 2) in llm.calls and not (tmp_path / "adapters" / "v00000001").exists()
    assert sorted(llm.llm_engine.loras) == [3, 4]


def test_refresh_in_flight_moves_running_requests_to_the_new_adapter_by_re_adding_them(tmp_path):
    engine, llm, layout = adapter_engine(tmp_path)
    engine.load_weights(1, version(layout, 1), layout)
    engine.add([SeqRequest("a", [5, 6, 7], max_new_tokens=50)])
    for _ in range(3):
        engine.step()
    engine.load_weights(2, version(layout, 2), layout, in_flight=True)
    re_added = [c for c in llm.calls if c[0] == "add_request"][-1]
    assert re_added[1].startswith("a#") and re_added[-1] == 3  # under version 2's adapter
    assert len(re_added[2]) == 3 + 3  # re-prefilled: prompt and the 3 tokens it had
    assert engine.version == 2 and engine.num_active() == 1
