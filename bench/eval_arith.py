"""Held-out accuracy of an arithmetic run (configs/smollm2-arith.yaml) on problems it never saw.

With operands 0..10 the training task has about 190 distinct problems, all of which a run meets;
the problems here are drawn with operands up to --max-value (default twice the config's) and kept
only when one operand is above the config's max_value, so none of them can have been trained on.
Greedy and sampled (temperature 1) accuracy, with the project's own engine, chat template and
reward, for the base model (no --run-dir) or a run's newest checkpoint.

    HF_HUB_OFFLINE=1 python bench/eval_arith.py configs/smollm2-arith.yaml                       # base model
    HF_HUB_OFFLINE=1 python bench/eval_arith.py configs/smollm2-arith.yaml --run-dir runs/smollm2-arith
    HF_HUB_OFFLINE=1 python bench/eval_arith.py configs/smollm2-arith.yaml --run-dir runs/lora model.lora.rank=16 model.lora.alpha=32
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch


from laminar_hpc.config import load_config
from laminar_hpc.model.factory import build_tokenizer
from laminar_hpc.model.hf import hf_model_args, load_hf_weights, resolve_hf_path
from laminar_hpc.rollout.torch_engine import TorchEngine
from laminar_hpc.rollout.evaluate import generate
from laminar_hpc.checkpoint_format import MODEL_FILE
from laminar_hpc.rundir import RunDir
from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.sources.arith import ArithTasks
from laminar_hpc.tasks.problem import Response
from laminar_hpc.tasks.rewards.scorer import final_number


def unseen_problems(cfg, n: int, max_value: int) -> list:
    """`n` problems with an operand above the config's max_value (the held-out index range)."""
    t = cfg.task
    src = ArithTasks(cfg.seed, ops=list(t.ops), operands=t.operands, max_value=max_value, instruction=t.instruction,
                     system_prompt=t.system_prompt, chat=t.chat_template)
    out, i = [], 0
    while len(out) < n:
        p = src.held_out(i)
        i += 1
        if max(int(x) for x in re.findall(r"\d+", p.prompt.split("?")[0])) > t.max_value:
            out.append(p)
    return out


def checkpoint_weights(cfg, tok, run_dir: str, newest: Path) -> dict[str, torch.Tensor]:
    """The full weights of a run's newest checkpoint: its model file, or for an adapter run
    (`model.lora`) the adapter merged into the base the run built (trainer/checkpoint.py)."""
    if cfg.model.lora is None:
        return torch.load(newest / MODEL_FILE, map_location="cpu", weights_only=True)
    from laminar_hpc.trainer.checkpoint import load_policy
    policy, meta = load_policy(cfg, tok, RunDir(run_dir).checkpoints_dir)
    if meta is None:
        raise SystemExit(f"{run_dir}: no complete adapter checkpoint")
    return policy.state_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--run-dir", help="evaluate this run's newest checkpoint (default: the base model)")
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--samples", type=int, default=2, help="samples per problem at temperature 1")
    ap.add_argument("--max-value", type=int, help="largest operand (default: twice the config's)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("overrides", nargs="*", help="the run's dotted overrides (model.lora.* for an adapter run)")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    if cfg.task.type != "arith" or not cfg.model.hf_path:
        ap.error(f"{args.config}: needs task.type arith and model.hf_path")
    if args.max_value is not None and args.max_value <= cfg.task.max_value:
        ap.error(f"--max-value {args.max_value} must exceed the config's task.max_value {cfg.task.max_value} "
                 "(only problems with a larger operand are unseen)")
    torch.set_num_threads(cfg.rollout.torch_threads)
    tok = build_tokenizer(cfg.model)
    path = resolve_hf_path(cfg.model.hf_path)
    problems = unseen_problems(cfg, args.problems, args.max_value or 2 * cfg.task.max_value)
    ids = [encode_prompt(tok, p) for p in problems]
    state = None
    if args.run_dir:
        ckpts = RunDir(args.run_dir).checkpoints()
        if not ckpts:
            ap.error(f"{args.run_dir}: no checkpoint")
        state = checkpoint_weights(cfg, tok, args.run_dir, ckpts[-1])
    figures = {"config": args.config, "run_dir": args.run_dir, "problems": len(problems),
               "checkpoint": str(ckpts[-1]) if args.run_dir else "base model"}
    for temp, reps in ((0.0, 1), (cfg.rollout.temperature, args.samples)):
        engine = TorchEngine(hf_model_args(path, max_seq_len=cfg.model.max_seq_len), tok.eos_id,
                             max_batch=cfg.rollout.max_batch, temperature=temp, top_p=cfg.rollout.top_p,
                             top_k=cfg.rollout.top_k, seed=cfg.seed)
        load_hf_weights(engine.model, path)
        if state is not None:
            engine.model.load_state_dict(state)
        engine.version = 0
        outs = [toks for toks, _ in generate(engine, [p for p in ids for _ in range(reps)],
                                             cfg.rollout.max_new_tokens, greedy=temp == 0)]
        texts = [tok.decode([x for x in o if x != tok.eos_id]) for o in outs]
        probs = [p for p in problems for _ in range(reps)]
        acc = sum(final_number(p, Response(t)) for t, p in zip(texts, probs)) / len(texts)
        name = "greedy" if temp == 0 else f"sampled_t{temp:g}"
        figures[name] = acc
        figures[f"{name}_examples"] = [[p.prompt, t] for p, t in zip(probs[::reps][:4], texts[::reps][:4])]
        print(f"{name}: {acc:.3f} over {len(texts)} answers", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
