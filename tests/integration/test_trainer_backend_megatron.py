"""The Megatron trainer backend through the one interface the trainer loop uses, on one CPU rank
(tests/megatron_shim.py) in a subprocess, so the shim's patches stay there."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, TRAIN_INTERFACE

# -- Megatron ------------------------------------------------------------------------------------


# one rank on the CPU (tests/megatron_shim.py), in a subprocess: the shim's patches stay there

MEGATRON = r'''
import json, sys, torch
sys.path.insert(0, {tests!r})
import megatron.core, megatron_shim
megatron_shim.install()
from pathlib import Path
from laminar_hpc.config import load_config
from laminar_hpc.model.factory import build_model, build_tokenizer
from laminar_hpc.trainer.backend_builders import build_backend
from helpers import TRAIN_INTERFACE as INTERFACE, TRAIN_METRICS as METRICS, train_groups as groups
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
    assert out["members"] == sorted(TRAIN_INTERFACE) and out["resume_empty"] and out["layout_same"]
    assert out["metrics"] == []
    assert [(d["step"], d["version"]) for d in out["done"]] == [(1, 2)]
    assert out["published_is_export"] and out["moved"] and out["restored"]
    assert out["meta"] == [1, 2, [0, 1]]


# a spawned rank that dies: rank 0 must not wait for it until the collective's timeout

DEAD_FOLLOWER = r'''
import logging, sys
from pathlib import Path
from laminar_hpc.config import load_config
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.trainer.megatron.runner import start_ranks
logging.basicConfig(level=logging.INFO)
cfg = load_config({config!r}, ["trainer.backend=megatron", "trainer.megatron.dist_backend=gloo",
                               "trainer.megatron.data_parallel=2", "timeouts.startup_s=30", "timeouts.busy_s=1"])
start_ranks(cfg, Path({run!r}), build_tokenizer(cfg.model))  # the run directory has no config.yaml
print("RENDEZVOUS DONE")
'''


def test_rank0_ends_when_a_spawned_rank_dies_naming_it(tmp_path):
    """Rank 1 cannot read its config (the run directory has none) and exits 1 before the
    rendezvous. Rank 0 ends at once with FOLLOWER_DIED_EXIT and a line naming rank 1 and its exit
    status, where it used to wait inside init_process_group until the rendezvous timed out
    (timeouts.startup_s + busy_s) with an error that named neither."""
    from laminar_hpc.trainer.megatron.runner import FOLLOWER_DIED_EXIT
    code = DEAD_FOLLOWER.format(run=str(tmp_path), config=str(REPO / "configs" / "tiny.yaml"))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert "RENDEZVOUS DONE" not in res.stdout
    assert res.returncode == FOLLOWER_DIED_EXIT, res.stderr[-3000:]
    assert "config.yaml" in res.stderr  # rank 1's own error, in the same log
    assert "trainer rank 1 " in res.stderr and "exit status 1 " in res.stderr, res.stderr[-2000:]
