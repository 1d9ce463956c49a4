"""A restart changes nothing, in process (issue 44): a trainer resumed from a checkpoint trains
exactly as the uninterrupted one would (the same KL reference, learning rate, optimizer settings
and loss, step for step); a resume that changes a training setting says so, or refuses; and a
restarted rollout continues the campaign's sampling streams instead of repeating its first draws.
(The same with whole campaigns: tests/integration/test_restart_equivalence_runs.py.)"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import REPO, anchored, train_groups

from laminar_hpc.checkpoint_format import CheckpointError, anchor_path, verified_anchor
from laminar_hpc.config import load_config
from laminar_hpc.config.resume_changes import ResumeRefused, resume_changes, training_settings
from laminar_hpc.config.schema import ModelCfg
from laminar_hpc.model.factory import build_tokenizer, model_args
from laminar_hpc.model.llama import Transformer
from laminar_hpc.model.sampling import sample_tokens, stream_uniforms
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.rollout.torch_engine import SeqRequest, TorchEngine
from laminar_hpc.trainer.backend_builders import build_backend
from laminar_hpc.trainer.checkpoint import keep_anchor, list_checkpoints

COMPARED = ("kl", "loss", "lr", "weight_decay", "grad_norm", "is_weight_mean", "entropy")


def config(*overrides: str):
    return load_config(REPO / "configs" / "tiny.yaml", ["trainer.kl_coef=0.5", "trainer.weight_decay=0.5",
                                                        "trainer.lr_schedule=cosine", "trainer.total_steps=6",
                                                        *overrides])


def backend(cfg, run: Path, seed: int):
    torch.manual_seed(seed)
    return build_backend(cfg, build_tokenizer(cfg.model), run_dir=run, ckpt_root=run / "checkpoints")


def save(b, cfg, step: int) -> None:
    b.save(step, step, meta={"model": cfg.model.model_dump(), "training": training_settings(cfg)},
           ledger={"consumed": []})
    assert "error" not in b.saves_done(wait=True)[0]


def batch(step: int):
    return train_groups(10 * step, version=step)


def started(cfg, run: Path):
    """A trainer at the start of RL: step 0 checkpointed and kept as the anchor (trainer/main.py)."""
    b = backend(cfg, run, seed=0)
    assert anchored(b, cfg)["source"] == "step_000000"
    return b


@pytest.mark.parametrize("weights", [(), ("model.lora.rank=4", "model.lora.alpha=8")], ids=["full", "adapters"])
def test_a_resumed_trainer_trains_step_for_step_as_the_uninterrupted_one(tmp_path, weights):
    cfg = config(*weights)
    a = started(cfg, tmp_path)
    rows_a = {}
    for step in range(6):
        if step in (2, 3):
            save(a, cfg, step)  # keep=2: step_000000 is pruned here; the anchor stays
        rows_a[step] = a.train_step(batch(step), step=step, version=step)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_000002", "step_000003"]

    b = backend(cfg, tmp_path, seed=1)  # other initial weights: all of them come from the checkpoint
    assert b.resume()["step"] == 3
    for step in range(3, 6):
        row = b.train_step(batch(step), step=step, version=step)
        for key in COMPARED:
            assert row[key] == pytest.approx(rows_a[step][key], rel=1e-6, abs=1e-9), (step, key)
    # the old trainer took its own resumed weights as the reference: KL 0 here (an adapter of rank 4
    # moves the policy less in 3 steps: its KL is ~4e-6, still far from 0)
    assert rows_a[3]["kl"] > (1e-4 if not weights else 1e-6)
    assert b.anchor["sha256"] == a.anchor["sha256"] == verified_anchor(tmp_path / "checkpoints")[1]["sha256"]
    a.close()
    b.close()


def test_a_resume_applies_the_configs_optimizer_settings(tmp_path):
    cfg = config()
    a = started(cfg, tmp_path)
    a.train_step(batch(0), step=0, version=0)
    save(a, cfg, 1)
    b = backend(config("trainer.weight_decay=0.0"), tmp_path, seed=1)
    b.resume()
    assert {g["weight_decay"] for g in b.opt.param_groups} == {0.0}  # the checkpoint's 0.5 stayed before
    assert b.train_step(batch(1), step=1, version=1)["weight_decay"] == 0.0
    a.close()
    b.close()


def test_the_anchor_is_made_once_checked_and_survives_pruning(tmp_path):
    cfg = config()
    a = started(cfg, tmp_path)
    root = tmp_path / "checkpoints"
    first = os.stat(anchor_path(root) / "model.pt")
    assert first.st_nlink == 2  # hard-linked to step_000000's weights: no second copy on disk yet
    for step in (1, 2):
        save(a, cfg, step)
    assert not (root / "step_000000").exists() and os.stat(anchor_path(root) / "model.pt").st_nlink == 1
    assert keep_anchor(root)["step"] == 0  # an existing anchor is never rewritten
    assert os.stat(anchor_path(root) / "model.pt").st_ino == first.st_ino
    with open(anchor_path(root) / "model.pt", "r+b") as f:  # damaged on disk: refused, never replaced
        f.seek(100)
        f.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        backend(cfg, tmp_path, seed=1).train_step(batch(0), step=0, version=0)
    a.close()


def test_kl_without_an_anchor_is_one_line_saying_what_to_do(tmp_path):
    b = backend(config(), tmp_path, seed=0)  # no step_000000, no anchor (a run from before anchors)
    with pytest.raises(CheckpointError, match="KL anchor .* missing.*trainer.kl_coef=0"):
        b.train_step(batch(0), step=0, version=0)


def test_megatron_with_a_kl_term_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="megatron backend holds no reference model"):
        config("trainer.backend=megatron")


# -- what a resume changes, said or refused ---------------------------------------------------------

QUICKSTART = REPO / "configs" / "quickstart.yaml"


def test_a_longer_cosine_campaign_is_said_with_the_learning_rate_it_brings():
    saved = training_settings(load_config(QUICKSTART))
    line = resume_changes(saved, load_config(QUICKSTART, ["trainer.total_steps=300"]), step=250)
    # the figures: the quickstart's lr at step 250 of 250 is 3.0e-5, of 300 it is 4.75e-5
    assert "trainer.total_steps 250 -> 300" in line and "becomes 4.75e-05, was 3e-05" in line, line
    line = resume_changes(saved, load_config(QUICKSTART, ["trainer.weight_decay=0.5", "trainer.kl_coef=0.01"]),
                          step=100)
    assert "trainer.weight_decay 0.0 -> 0.5 (the optimizer's" in line and "trainer.kl_coef 0.0 -> 0.01" in line
    assert "\n" not in line
    assert resume_changes(saved, load_config(QUICKSTART), step=100) is None
    assert resume_changes(None, load_config(QUICKSTART, ["trainer.lr=1"]), step=100) is None  # an old checkpoint


@pytest.mark.parametrize("override, says", [("trainer.group_size=4", "trainer.group_size=4: the checkpoint"),
                                            ("trainer.total_steps=100", "nothing would train; raise it above 100")])
def test_a_change_a_resume_cannot_apply_is_refused(override, says):
    saved = training_settings(load_config(QUICKSTART))
    with pytest.raises(ResumeRefused, match=says):
        resume_changes(saved, load_config(QUICKSTART, [override]), step=100)


# -- sampling streams that continue -----------------------------------------------------------------

ARGS = model_args(ModelCfg(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=40), 40)


def engine(seed: int = 7) -> TorchEngine:
    """A rollout engine as a (re)started process builds it, loaded with the same weights."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # peaked enough that draws differ, flat enough that they vary
    layout = WeightLayout.from_model(model)
    buf = bytearray(layout.nbytes)
    layout.pack(model, memoryview(buf))
    eng = TorchEngine(ARGS, eos_id=-1, max_batch=4, temperature=1.0, seed=seed)
    eng.load_weights(0, memoryview(buf), layout)
    return eng


def generate(eng: TorchEngine, traj_ids: list[str], prompt=(5, 6, 7)) -> dict[str, list[int]]:
    reqs = [SeqRequest(t, list(prompt), max_new_tokens=12) for t in traj_ids]
    eng.add(reqs)
    while eng.num_active():
        eng.step()
    return {r.traj_id: r.tokens for r in reqs}


def test_a_restarted_rollout_continues_the_campaigns_streams():
    first = generate(engine(), ["g0-0"])["g0-0"]  # the campaign's first draws
    after_restart = generate(engine(), ["g57-1"])["g57-1"]  # a new process, later work
    assert after_restart != first  # the old engine reseeded per process and drew `first` again
    assert generate(engine(), ["g57-1"])["g57-1"] == after_restart  # same seed and history, same draws
    assert generate(engine(seed=8), ["g57-1"])["g57-1"] != after_restart  # another campaign seed
    # a trajectory's draws do not depend on the batch it shares (nor, so, on its replica)
    assert generate(engine(), ["g3-0", "g57-1", "g9-2"])["g57-1"] == after_restart


def test_a_draw_from_a_stream_follows_the_processed_distribution():
    probs = torch.tensor([0.1, 0.5, 0.0, 0.15, 0.25])
    n = 20000
    logits = probs.clamp_min(1e-30).log().expand(n, -1).contiguous()
    u = stream_uniforms(3, [f"t{i}" for i in range(n)], [0] * n)
    toks, mu = sample_tokens(logits, 1.0, 0.8, top_k=0, uniforms=u)  # top-p 0.8 drops the 0.1 token
    freq = torch.bincount(toks, minlength=5).float() / n
    kept = torch.tensor([0.0, 0.5, 0.0, 0.15, 0.25]) / 0.9
    assert torch.allclose(freq, kept, atol=0.015), freq
    assert torch.allclose(mu, kept[toks].log(), atol=1e-5)
