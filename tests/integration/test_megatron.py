"""Megatron-core backend on the CPU (gloo, 2 processes per case) against the plain torch backend.

Each case starts its own ranks as subprocesses (`python tests/integration/test_megatron.py --worker ...`)
that install the CPU shim (tests/megatron_shim.py), so no Megatron state or patch leaks into
pytest. A case checks, on one synthetic GRPO batch: the loss, the HF export before the step
(conversion both ways), the weights after one optimizer step (gradients, clipping and Adam),
and the exported model's logits against the torch model's; the DP2 case also round-trips a
dist_checkpointing checkpoint of the distributed optimizer.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parents[1]  # tests/, where megatron_shim.py lives (its parent: the repository)
LR, TEMP, CLIP = 1e-3, 0.9, 1.0  # gradient norms here are ~1.5-2.5: clipping is active
CASES = {  # name: (tensor, pipeline, world, model overrides)
    "tp2": (2, 1, 2, {"attention_bias": True}),  # Qwen2-style q/k/v bias, odd vocab padded over TP
    "pp2": (1, 2, 2, {}),  # tied embeddings across pipeline stages
    "dp2": (1, 1, 2, {"tie_embeddings": False}),
}


def setup(case: str):
    """(ModelArgs, TrainerCfg, reference Transformer, batch, second batch): the same in every process."""
    from laminar_hpc.config.schema import MegatronCfg, ModelCfg, TrainerCfg
    from laminar_hpc.model.factory import model_args
    from laminar_hpc.model.llama import Transformer, token_logprobs
    from laminar_hpc.trainer.batch import build_batch
    from laminar_hpc.transport.protocol import Group, Trajectory
    tp, pp, _, over = CASES[case]
    args = model_args(ModelCfg(**{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96,
                                  "max_seq_len": 32, "tie_embeddings": True, **over}), vocab_size=61)
    tcfg = TrainerCfg(lr=LR, grad_clip=CLIP, rho=1.2, clip_eps=0.2,
                      megatron=MegatronCfg(tensor_parallel=tp, pipeline_parallel=pp, micro_batch_size=2,
                                           distributed_optimizer=True, dist_backend="gloo"))
    torch.manual_seed(0)
    model = Transformer(args)
    gen = torch.Generator().manual_seed(1)

    def batch(first_group: int):
        groups = []
        for g in range(2):
            prompt = torch.randint(1, 61, (3 + g,), generator=gen).tolist()
            trajs = []
            for k in range(3):  # 6 rows: DP2 pads each rank to 2 micro-batches of 2
                toks = torch.randint(1, 61, (4 + 2 * k + g,), generator=gen).tolist()
                trajs.append(Trajectory(traj_id=str(k), group_id=first_group + g, problem=g, version=0, prompt=prompt,
                                        tokens=toks, logprobs=[0.0] * len(toks), rollout=0, t_start=0.0,
                                        reward=float(torch.rand((), generator=gen))))
            groups.append(Group(group_id=first_group + g, problem=g, trajectories=trajs))
        b = build_batch(groups)
        with torch.no_grad():  # behaviour log-probs near the policy's: some ratios truncated, some clipped
            lp = token_logprobs(model(b.inputs), b.targets, TEMP)
        b.behaviour_logp = (lp + 0.3 * torch.randn(lp.shape, generator=gen)) * b.mask
        return b
    return args, tcfg, model, batch(0), batch(2)


def torch_step(model, b, cfg) -> tuple[float, float]:
    """The torch backend's step (trainer/main.py) on `model`; returns the loss and gradient norm."""
    from laminar_hpc.model.llama import token_logprobs
    from laminar_hpc.trainer.loss import aipo_loss
    opt = getattr(model, "_opt", None) or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model._opt = opt
    out = aipo_loss(token_logprobs(model(b.inputs), b.targets, TEMP), b.behaviour_logp, b.advantages, b.mask,
                    rho=cfg.rho, clip_eps=cfg.clip_eps)
    opt.zero_grad()
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return out.loss.item(), float(norm)


def worker(case: str, rank: int, world: int, tmp: Path) -> None:
    sys.path.insert(0, str(HERE))
    import megatron_shim
    megatron_shim.install()
    import torch.distributed as dist

    from laminar_hpc.trainer.megatron.engine import MegatronEngine
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    args, tcfg, model, b1, b2 = setup(case)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    eng = MegatronEngine(args, tcfg, hf, seed=0)
    res = {"pre": eng.export_hf()}
    res["m1"] = eng.train_step(b1, lr=LR, temperature=TEMP)
    res["post1"] = eng.export_hf()
    if case == "dp2":
        ckpt = tmp / "ckpt"
        ckpt.mkdir(exist_ok=True)
        eng.save(ckpt)
        res["m2"] = eng.train_step(b2, lr=LR, temperature=TEMP)
        res["post2"] = eng.export_hf()
        eng.train_step(b1, lr=LR, temperature=TEMP)  # move away from the checkpoint, then come back
        eng.load(ckpt)
        res["m2_again"] = eng.train_step(b2, lr=LR, temperature=TEMP)
        res["post2_again"] = eng.export_hf()
    if rank == 0:
        torch.save(res, tmp / "result.pt")
    dist.destroy_process_group()


def run_case(case: str, tmp: Path, timeout_s: float = 150.0) -> dict:
    world = CASES[case][2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", case, str(r), str(world), str(tmp)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"megatron {case} ranks still running after {timeout_s:.0f}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"megatron {case} rank {r} exited {p.returncode}:\n{out[-4000:]}"
    return torch.load(tmp / "result.pt")


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a)


def update_error(meg: dict, ref: dict, start: dict) -> float:
    """|Megatron's update - torch's| / |torch's update| (L2 over all weights). Adam's first steps
    are ~lr * sign(g): an element whose gradient is rounding noise (k_proj's bias: zero in exact
    arithmetic) can move differently, so the maximum element difference says little."""
    num = sum(float(((meg[k] - ref[k].detach()) ** 2).sum()) for k in ref)
    den = sum(float(((ref[k].detach() - start[k]) ** 2).sum()) for k in ref)
    return (num / den) ** 0.5


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_matches_torch(case, tmp_path):
    from laminar_hpc.model.llama import Transformer
    res = run_case(case, tmp_path)
    args, cfg, model, b1, b2 = setup(case)
    hf0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert max_diff(res["pre"], hf0) == 0.0  # HF -> Megatron shards -> HF is exact
    loss1, norm1 = torch_step(model, b1, cfg)
    dloss = abs(res["m1"]["loss"] - loss1)
    assert dloss < 1e-5, f"{case}: Megatron loss {res['m1']['loss']} vs torch {loss1}"
    dnorm = abs(res["m1"]["grad_norm"] - norm1) / norm1
    assert dnorm < 1e-4, f"{case}: Megatron gradient norm {res['m1']['grad_norm']} vs torch {norm1}"
    hf1 = dict(model.named_parameters())
    dw = update_error(res["post1"], hf1, hf0)
    assert dw < 1e-3, f"{case}: Megatron's update differs from torch's by {dw:.1%} (L2)"
    # the exported weights, loaded into our own model, give the torch model's logits
    exported = Transformer(args)
    exported.load_state_dict({**res["post1"], **({"lm_head.weight": res["post1"]["model.embed_tokens.weight"]}
                                                 if args.tie_embeddings else {})})
    with torch.no_grad():
        dlogit = float((exported(b1.inputs) - model(b1.inputs)).abs().max())
    assert dlogit < 1e-4, f"{case}: exported logits differ by {dlogit}"
    print(f"{case}: |dloss| {dloss:.2e}  grad norm rel. diff {dnorm:.2e}  update diff {dw:.1e}  "
          f"|dlogits| {dlogit:.2e}")
    if case == "dp2":
        loss2, _ = torch_step(model, b2, cfg)
        assert abs(res["m2"]["loss"] - loss2) < 1e-5
        assert res["m2_again"]["loss"] == res["m2"]["loss"]  # the same state came back from disk
        assert max_diff(res["post2_again"], res["post2"]) == 0.0
        dw2 = update_error(res["post2"], dict(model.named_parameters()), hf0)
        assert dw2 < 1e-3
        print(f"dp2 checkpoint round trip: step-2 loss {res['m2']['loss']:.6f} == {res['m2_again']['loss']:.6f}, "
              f"update diff vs torch after 2 steps {dw2:.1e}")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))


SITE = '''import os, sys
if os.environ.get("LAMINAR_TEST_MEGATRON_SHIM"):  # written by tests/integration/test_megatron.py, for its run only
    sys.path.insert(0, {tests!r})

    class _ShimOnImport:  # install the CPU shim right after megatron.core is first imported
        def find_spec(self, name, path, target=None):
            if name == "megatron.core":
                sys.meta_path.remove(self)
                import importlib
                importlib.import_module(name)
                import megatron_shim
                megatron_shim.install()
            return None
    sys.meta_path.insert(0, _ShimOnImport())
'''


def test_campaign_with_megatron_trainer_and_resume(tmp_path):
    """The real trainer loop on the Megatron backend (DP2 on gloo, ranks spawned by the trainer),
    then a resume from its dist_checkpointing checkpoint."""
    import json

    from helpers import laminar, run_dir_logs  # (here: the module also runs as a worker, without tests/ on its path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE.format(tests=str(HERE)))
    env = {**os.environ, "LAMINAR_TEST_MEGATRON_SHIM": "1", "PYTHONPATH": f"{site}:{HERE.parent}",
           # a shell inside another launcher's world: not the trainer's (launch/processes.LAUNCHER_WORLD);
           # a trainer that took it waited for a rank 1 that nobody starts
           "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    run_dir = tmp_path / "run"
    over = ["trainer.backend=megatron", "trainer.megatron.dist_backend=gloo", "trainer.megatron.data_parallel=2",
            "trainer.megatron.micro_batch_size=2"]
    for extra in ([], ["--resume", "trainer.total_steps=15"]):
        res = laminar("run", str(HERE.parent / "configs/tiny.yaml"), "--run-dir", str(run_dir), *extra, *over,
                      env=env, timeout=240)
        assert res.returncode == 0, res.stderr[-3000:] + run_dir_logs(["--run-dir", str(run_dir)])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "event" not in r] == list(range(1, 16))
    assert "resumed from" in (run_dir / "logs" / "trainer-0.log").read_text()
    assert (run_dir / "checkpoints" / "step_000015" / "dist" / "metadata.json").is_file()
