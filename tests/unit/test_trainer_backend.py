"""Each trainer backend, in process, through the one interface the trainer loop uses
(trainer/backend_interface.py): a train step on a tiny batch, checkpoint then resume restores the same
state, and what it publishes packs into its layout. Also: the warm-up's greedy evaluation
decodes exactly what the rollout engine decodes (it no longer goes through the engine)."""
from __future__ import annotations

import copy
import inspect
import os
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import REPO, TRAIN_INTERFACE, TRAIN_METRICS, assert_nested_equal, train_groups

from laminar_hpc.config import load_config
from laminar_hpc.model.factory import build_model, build_tokenizer
from laminar_hpc.model.weights import WeightLayout
from laminar_hpc.trainer.backend_interface import TrainBackend
from laminar_hpc.trainer.backend_builders import build_backend


def config(name: str, *overrides: str):
    return load_config(REPO / "configs" / name, list(overrides))


def make(cfg, tmp: Path, seed: int = 0):
    torch.manual_seed(seed)
    return build_backend(cfg, build_tokenizer(cfg.model), run_dir=tmp, ckpt_root=tmp / "checkpoints")


def state(backend) -> dict:
    return copy.deepcopy({"model": backend.model.state_dict(), "optim": backend.opt.state_dict()})


def test_interface_lists_what_the_protocol_declares():
    declared = {n for n, v in vars(TrainBackend).items() if inspect.isfunction(v) and not n.startswith("_")}
    assert declared | set(TrainBackend.__annotations__) == TRAIN_INTERFACE


@pytest.mark.parametrize("name", ["tiny.yaml", "tiny-emulated.yaml"])
def test_backend_trains_checkpoints_resumes_and_publishes(name, tmp_path):
    cfg = config(name, "trainer.lr_schedule=cosine", "trainer.total_steps=4")
    a = make(cfg, tmp_path)
    for member in TRAIN_INTERFACE:
        assert hasattr(a, member), member
    assert a.resume() is None  # nothing written yet

    before = copy.deepcopy(a.model.state_dict())
    m = a.train_step(train_groups(0), step=0, version=2)
    assert TRAIN_METRICS <= set(m)
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
    ma, mb = (x.train_step(train_groups(2), step=1, version=3) for x in (a, b))  # the optimizer state came back too
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


# -- the warm-up's evaluation -----------------------------------------------------------------

def test_greedy_decode_matches_the_rollout_engine():
    """trainer/warmup.py decodes with the model package alone; the tokens must be the engine's,
    including sequences that finish early and leave the batch (cache slots move)."""
    from laminar_hpc.rollout.torch_engine import SeqRequest, TorchEngine
    from laminar_hpc.tasks.sources.build import build_task
    from laminar_hpc.tasks.prompts import encode_prompt
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
    # run_if_follower sets the rank's variables in os.environ itself: restored after the test (they
    # leaked once, and a later campaign test in the same worker waited for a world of two)
    with mock.patch.dict(os.environ):
        assert runner.run_if_follower(argv) is follows
        assert followed == ([argv] if follows else [])
        assert os.environ.get("RANK") == procid
        if tasks:
            assert os.environ["LAMINAR_RDZV"] == f"file://{tmp_path}/megatron/rendezvous-7.1"
    assert "WORLD_SIZE" not in os.environ


# one rank on the CPU (tests/megatron_shim.py), in a subprocess: the shim's patches stay there


def _exit_with(code: int) -> None:
    os._exit(code)


def test_the_follower_watch_reports_a_death_once_and_leaves_no_descriptor_behind():
    """trainer/megatron/runner.Followers: the watch names a follower that died; stopping it
    closes its pipe (a trainer that restarts its ranks would otherwise gather descriptors)."""
    import multiprocessing
    from laminar_hpc.trainer.megatron.runner import Followers
    before = set(os.listdir("/proc/self/fd"))
    proc = multiprocessing.get_context("fork").Process(target=_exit_with, args=(3,))
    proc.start()
    died = []
    seen = threading.Event()
    watch = Followers([proc], on_death=lambda p: (died.append(p.exitcode), seen.set()))
    assert seen.wait(30), "the watch never saw the follower exit"
    watch.stop_watching()
    watch.stop_watching()  # again: nothing left to close
    assert died == [3]
    proc.close()  # the process's own descriptor (its sentinel)
    assert set(os.listdir("/proc/self/fd")) - before == set()


def test_a_start_of_the_ranks_that_outlives_startup_s_ends_rank_0_naming_its_stage():
    """trainer/megatron/runner.StartWatch: a rendezvous or group creation that never completes
    (a rank stuck in its start) waited half an hour (the process group's timeout); now rank 0
    names where it waited at timeouts.startup_s and exits, for the supervisor to restart it."""
    import subprocess
    import sys
    code = ("import logging, sys, time\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
            "from laminar_hpc.trainer.megatron.runner import StartWatch\n"
            "w = StartWatch(1.0, None)\n"
            "w.reached('the control group')\n"
            "time.sleep(60)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    from laminar_hpc.trainer.megatron.runner import START_STUCK_EXIT
    assert res.returncode == START_STUCK_EXIT, res.stderr
    assert "the rendezvous of the ranks done in" in res.stderr
    assert "did not finish within timeouts.startup_s=1s: rank 0 still waits for the control group" in res.stderr


def test_a_start_that_finishes_in_time_is_left_alone():
    from laminar_hpc.trainer.megatron.runner import StartWatch
    w = StartWatch(0.2, None)
    w.done()
    w._thread.join(5)
    assert not w._thread.is_alive()  # the watch ended without acting (it would have exited this process)
