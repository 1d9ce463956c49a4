"""Each trainer backend, in process, through the one interface the trainer loop uses
(trainer/backend.py): a train step on a tiny batch, checkpoint then resume restores the same
state, and what it publishes packs into its layout. Also: the warm-up's greedy evaluation
decodes exactly what the rollout engine decodes (it no longer goes through the engine)."""
from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_nested_equal

from laminar_hpc.config import load_config
from laminar_hpc.model.factory import build_model, build_tokenizer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.trainer.backend import TrainBackend, build_backend
from laminar_hpc.transport.protocol import Group, Trajectory

REPO = Path(__file__).resolve().parent.parent
# everything trainer/main.py calls; checked against the Protocol so the two cannot drift apart
INTERFACE = {"layout", "resume", "load_initial", "warm_up", "train_step", "weights", "save", "saves_done", "close"}
METRICS = {"loss", "lr", "is_weight_mean", "truncated_frac", "clipped_frac", "kl", "grad_norm", "reward_mean",
           "reward_std", "trajectories", "tokens", "staleness_mean", "staleness_max", "staleness_hist"}


def groups(first: int, *, n: int = 2, size: int = 3, vocab: int = 20, version: int = 0) -> list[Group]:
    gen = torch.Generator().manual_seed(first)
    out = []
    for g in range(first, first + n):
        prompt = torch.randint(4, vocab, (3 + g % 2,), generator=gen).tolist()
        trajs = []
        for k in range(size):
            toks = torch.randint(4, vocab, (2 + k,), generator=gen).tolist()
            trajs.append(Trajectory(traj_id=f"{g}-{k}", group_id=g, problem=g, version=version, prompt=prompt,
                                    tokens=toks, logprobs=(-torch.rand(len(toks), generator=gen) - 1.0).tolist(),
                                    rollout=0, t_start=0.0, reward=float(k == g % size)))
        out.append(Group(group_id=g, problem=g, trajectories=trajs))
    return out


def config(name: str, *overrides: str):
    return load_config(REPO / "configs" / name, list(overrides))


def make(cfg, tmp: Path, seed: int = 0):
    torch.manual_seed(seed)
    return build_backend(cfg, build_tokenizer(cfg.model), run_dir=tmp, ckpt_root=tmp / "checkpoints")


def state(backend) -> dict:
    return copy.deepcopy({"model": backend.model.state_dict(), "optim": backend.opt.state_dict()})


def test_interface_lists_what_the_protocol_declares():
    declared = {n for n, v in vars(TrainBackend).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert declared | set(TrainBackend.__annotations__) == INTERFACE


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny-emulated.yaml"])
def test_backend_trains_checkpoints_resumes_and_publishes(name, tmp_path):
    cfg = config(name, "trainer.lr_schedule=cosine", "trainer.total_steps=4")
    a = make(cfg, tmp_path)
    for member in INTERFACE:
        assert hasattr(a, member), member
    assert a.resume() is None  # nothing written yet

    before = copy.deepcopy(a.model.state_dict())
    m = a.train_step(groups(0), step=0, version=2)
    assert METRICS <= set(m)
    assert m["trajectories"] == 6 and m["staleness_max"] == 2 and m["staleness_hist"] == {"2": 6}
    with pytest.raises(AssertionError):  # the step changed the policy
        assert_nested_equal(before, a.model.state_dict())

    blocked = a.save(1, 3, meta={"dropped_groups": 4}, ledger={"consumed": [0, 1]})
    assert blocked >= 0
    (done,) = a.saves_done(wait=True)
    assert (done["step"], done["version"]) == (1, 3) and Path(done["path"]).name == "step_000001"
    saved = state(a)

    b = make(cfg, tmp_path, seed=1)  # other initial weights: resume must replace them all
    meta = b.resume()
    assert (meta["step"], meta["version"], meta["dropped_groups"]) == (1, 3, 4)
    assert meta["ledger"]["consumed"] == [0, 1] and meta["path"] == done["path"]
    assert_nested_equal(saved, state(b))
    ma, mb = (x.train_step(groups(2), step=1, version=3) for x in (a, b))  # the optimizer state came back too
    assert_nested_equal(state(a), state(b))
    assert ma["loss"] == mb["loss"] and ma["lr"] == mb["lr"]

    # what the publisher packs: the live policy, laid out by the backend's layout
    buf = bytearray(a.layout.nbytes)
    a.layout.pack(a.weights(), memoryview(buf))
    if name == "tiny.yaml":
        assert a.layout == WeightLayout.from_model(build_model(cfg.model, build_tokenizer(cfg.model)), "float32")
        other = build_model(cfg.model, build_tokenizer(cfg.model))
        a.layout.unpack(memoryview(buf), other)
        assert_nested_equal(a.model.state_dict(), other.state_dict())
        assert m["lr"] == cfg.trainer.lr and ma["lr"] < cfg.trainer.lr  # the cosine schedule, by step
    else:
        assert bytes(buf) == a.model.weights.numpy().tobytes() and buf[0] == 4  # version 3 trained into it
    a.close()
    b.close()


def test_warm_up_runs_on_the_torch_policy_and_is_skipped_by_the_emulated_one(tmp_path):
    import logging
    log = logging.getLogger("test")
    seen = []
    torch_backend = make(config("tiny.yaml"), tmp_path / "t")
    assert torch_backend.warm_up(lambda model: seen.append(model) or {"steps": 1}, log) == {"steps": 1}
    assert seen == [torch_backend.model]
    emulated = make(config("tiny-emulated.yaml"), tmp_path / "e")
    assert emulated.warm_up(lambda model: seen.append(model) or {"steps": 1}, log) is None
    assert len(seen) == 1


def test_kl_reference_is_the_policy_rl_starts_from(tmp_path):
    b = make(config("tiny.yaml", "trainer.kl_coef=0.5"), tmp_path)
    start = copy.deepcopy(b.model.state_dict())
    b.train_step(groups(0), step=0, version=0)
    m = b.train_step(groups(2), step=1, version=1)
    assert_nested_equal(start, b.ref_model.state_dict())
    assert m["kl"] > 0


# -- the warm-up's evaluation -----------------------------------------------------------------

def test_greedy_decode_matches_the_rollout_engine():
    """trainer/warmup.py decodes with the model package alone; the tokens must be the engine's,
    including sequences that finish early and leave the batch (cache slots move)."""
    from laminar_hpc.rollout.engine import SeqRequest, TorchEngine
    from laminar_hpc.tasks import build_task, encode_prompt
    from laminar_hpc.trainer.warmup import EVAL_OFFSET, greedy_decode
    cfg = config("tiny.yaml")
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(3)
    model = build_model(cfg.model, tok)
    with torch.no_grad():  # far sharper than at init, so greedy answers differ from prompt to prompt
        for p in model.parameters():
            p.mul_(30.0)
    task = build_task(cfg.task, cfg.seed)
    prompts = [encode_prompt(tok, task.problem(EVAL_OFFSET + i)) for i in range(12)]
    max_new = 10

    def engine(eos: int) -> list[list[int]]:
        eng = TorchEngine(model.args, eos, max_batch=len(prompts), temperature=0.0)
        layout = WeightLayout.from_model(model)
        buf = bytearray(layout.nbytes)
        layout.pack(model, memoryview(buf))
        eng.load_weights(0, memoryview(buf), layout)
        reqs = [SeqRequest(str(i), p, max_new) for i, p in enumerate(prompts)]
        eng.add(reqs)
        while eng.num_active():
            eng.step()
        return [r.tokens for r in reqs]

    # an end token the untrained model does emit, at different steps: some sequences leave early
    free = engine(eos=-1)
    eos = max(set(t for s in free for t in s[1:5]), key=lambda t: sum(s[1:5].count(t) for s in free))
    want = engine(eos)
    lengths = {len(s) for s in want}
    assert min(lengths) < max_new and max_new in lengths, lengths
    assert greedy_decode(model, prompts, eos, max_new) == want


# -- Megatron ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tasks, procid, follows", [(None, None, False), ("2", "0", False), ("2", "1", True)])
def test_trainer_entry_runs_rank_0_as_the_trainer_and_other_ranks_as_followers(tasks, procid, follows, tmp_path,
                                                                                monkeypatch):
    """`python -m laminar_hpc.trainer` in every task of a trainer step: rank > 0 only follows."""
    from laminar_hpc.trainer.megatron import runner
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LAMINAR_RDZV", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    if tasks:
        for k, v in {"SLURM_STEP_NUM_TASKS": tasks, "SLURM_PROCID": procid, "SLURM_JOB_ID": "7",
                     "SLURM_STEP_ID": "1"}.items():
            monkeypatch.setenv(k, v)
    followed = []
    monkeypatch.setattr(runner, "main", followed.append)
    argv = ["--run-dir", str(tmp_path)]
    assert runner.run_if_follower(argv) is follows
    assert followed == ([argv] if follows else [])
    assert os.environ.get("RANK") == procid
    if tasks:
        assert os.environ["LAMINAR_RDZV"] == f"file://{tmp_path}/megatron/rendezvous-7.1"


# one rank on the CPU (tests/megatron_shim.py), in a subprocess: the shim's patches stay there

MEGATRON = r'''
import json, sys, torch
sys.path.insert(0, {tests!r})
import megatron.core, megatron_shim
megatron_shim.install()
from pathlib import Path
from laminar_hpc.config import load_config
from laminar_hpc.model.factory import build_model, build_tokenizer
from laminar_hpc.trainer.backend import build_backend
from test_trainer_backend import INTERFACE, METRICS, groups
run = Path({run!r})
cfg = load_config({config!r}, ["trainer.backend=megatron", "trainer.megatron.dist_backend=gloo",
                               "trainer.megatron.micro_batch_size=2"])
tok = build_tokenizer(cfg.model)
torch.manual_seed(cfg.seed)
ours = build_model(cfg.model, tok)
b = build_backend(cfg, tok, run_dir=run, ckpt_root=run / "checkpoints")
out = {{"members": sorted(m for m in INTERFACE if hasattr(b, m)), "resume_empty": b.resume() is None}}
from laminar_hpc.model.weights import WeightLayout
out["layout_same"] = b.layout == WeightLayout.from_model(ours, "float32")
m = b.train_step(groups(0), step=0, version=1)
out["metrics"] = sorted(METRICS - set(m))
b.save(1, 2, meta={{"dropped_groups": 0}}, ledger={{"consumed": [0, 1]}})
out["done"] = b.saves_done(wait=True)
saved = b.export()
buf = bytearray(b.layout.nbytes)
b.layout.pack(b.weights(), memoryview(buf))
b.layout.unpack(memoryview(buf), ours)
out["published_is_export"] = all(torch.equal(p, saved[n]) for n, p in ours.named_parameters())
b.train_step(groups(2), step=1, version=2)
out["moved"] = any(not torch.equal(v, saved[n]) for n, v in b.export().items())
meta = b.resume()
out["meta"] = [meta["step"], meta["version"], meta["ledger"]["consumed"]]
out["restored"] = all(torch.equal(v, saved[n]) for n, v in b.export().items())
b.close(clean=True)
print("RESULT " + json.dumps(out))
'''


def test_megatron_backend_one_rank(tmp_path):
    pytest.importorskip("megatron.core")
    code = MEGATRON.format(tests=str(REPO / "tests"), run=str(tmp_path), config=str(REPO / "configs" / "tiny.yaml"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert out["members"] == sorted(INTERFACE) and out["resume_empty"] and out["layout_same"]
    assert out["metrics"] == []
    assert [(d["step"], d["version"]) for d in out["done"]] == [(1, 2)]
    assert out["published_is_export"] and out["moved"] and out["restored"]
    assert out["meta"] == [1, 2, [0, 1]]
