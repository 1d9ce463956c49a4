"""`laminar eval`: the validation split of a config's task, generated and scored on its own, for
a run's checkpoint or a Hugging Face directory (what evaluation while training measures, with
the same problems, engine, chat template and reward pool: controller/evaluation.py).

    laminar eval runs/my-run                                 # the newest checkpoint, the run's own config
    laminar eval runs/my-run --config CONFIG --step 40 --samples 4 --pass-k 4
    laminar eval path/to/hf_dir --config CONFIG --json eval.json         # an exported or downloaded model
    python -m laminar_hpc.rollout.evaluate TARGET --config CONFIG         # what `laminar eval` runs

TARGET is a run directory (its config.yaml's model shape; --config gives the task, eval and
rollout settings, by default the run's own config.yaml) or a Hugging Face directory (config.json
+ safetensors; it replaces model.hf_path, and --step does not apply; --config is needed). Prints
one line of figures and writes them as JSON with --json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


def load_policy(cfg: Config, target: Path, step: int | None):
    """(model with the target's weights, tokenizer, model config, label)."""
    from laminar_hpc.model.export import checkpoint_version
    from laminar_hpc.model.factory import build_model, build_tokenizer
    from laminar_hpc.rundir import RunDir
    if (target / "config.json").is_file():  # a Hugging Face directory
        if step is not None:  # it holds one version: ignoring --step would evaluate another than asked
            from laminar_hpc.config import ConfigError
            raise ConfigError(f"--step {step} names a run's checkpoint, but {target} is a Hugging Face directory "
                              "(one version); leave --step out")
        model_cfg = cfg.model.model_copy(update={"hf_path": str(target), "tokenizer": cfg.model.tokenizer})
        tok = build_tokenizer(model_cfg)
        return build_model(model_cfg, tok), tok, model_cfg, f"hf:{target}"
    if not (target / "config.yaml").is_file():
        raise SystemExit(f"laminar eval: {target} is neither a run directory (config.yaml) nor a Hugging Face "
                         "directory (config.json); name one of them")
    model, tok, model_cfg, label = checkpoint_version(cfg, RunDir(target), step)
    return model, tok, model_cfg, label


def generate(engine, prompts: list[list[int]], max_new: int, greedy: bool) -> list[tuple[list[int], str]]:
    """Every prompt's (response tokens, finish) with continuous batching."""
    from laminar_hpc.rollout.engine_interface import SeqRequest
    reqs = [SeqRequest(str(i), p, max_new, greedy=greedy) for i, p in enumerate(prompts)]
    out: dict[str, tuple[list[int], str]] = {}
    pending = list(reqs)
    while pending or engine.num_active():
        k = engine.free_slots()
        if pending and k:
            batch, pending = pending[:k], pending[k:]
            ok = []
            for r in batch:
                if engine.refuse(r) is None:
                    ok.append(r)
                else:  # a prompt the engine cannot take: no response, scored by the reward as empty
                    out[r.traj_id] = ([], "error")
            step = engine.add(ok)
        else:
            step = engine.step()
        for o in step:
            if o.finished:
                toks = o.request.tokens if o.request is not None else []
                out[o.traj_id] = (toks, "error" if o.error else ("eos" if toks and toks[-1] == engine.eos_id
                                                                 else "length"))
    return [out[str(i)] for i in range(len(prompts))]


def evaluate(cfg: Config, model, tok, *, samples: int, pass_k: int, label: str) -> dict:
    import torch

    from laminar_hpc.metrics.eval_scores import component_means, eval_scores
    from laminar_hpc.model.factory import model_args
    from laminar_hpc.rollout.torch_engine import TorchEngine
    from laminar_hpc.tasks.sources.build import build_task, validation_problems
    from laminar_hpc.tasks.prompts import encode_prompt
    from laminar_hpc.tasks.rewards.reward_pool import score_all
    from laminar_hpc.tasks.problem import Response
    from laminar_hpc.tasks.rewards.scorer import RewardOutcome
    t0 = time.monotonic()
    torch.set_num_threads(cfg.rollout.torch_threads)
    problems = validation_problems(build_task(cfg.task, cfg.seed), cfg)
    if not problems:
        raise SystemExit("laminar eval: the task has no validation split; set task.validation_path or "
                         "task.validation_fraction")
    engine = TorchEngine(model_args(cfg.model, tok.vocab_size), tok.eos_id, max_batch=cfg.rollout.max_batch,
                         temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                         seed=cfg.seed, device=cfg.rollout.device)
    engine.model.load_state_dict(model.state_dict())
    engine.version = 0
    if cfg.env.enabled:  # a tool task: whole episodes, the calls run between turns (tasks/tools/episode_play.py)
        from laminar_hpc.tasks.tools.episode_play import play_episodes

        def decode(prefixes: list[list[int]], rooms: list[int]) -> list[list[int]]:
            return [toks[:r] for (toks, _), r in zip(generate(engine, prefixes, max(rooms), greedy=samples == 1), rooms)]
        scores = play_episodes(tok, [p for p in problems for _ in range(samples)], cfg.env,
                               max_new_tokens=cfg.rollout.max_new_tokens, max_len=cfg.model.max_seq_len,
                               reward=cfg.task.reward, decode=decode)
        outcomes = [RewardOutcome(reward=x) for x in scores]
    else:
        prompts = [encode_prompt(tok, p) for p in problems for _ in range(samples)]
        outs = generate(engine, prompts, cfg.rollout.max_new_tokens, greedy=samples == 1)
        outcomes = score_all(cfg.task.reward, [
            (problems[i // samples], Response(tok.decode([t for t in toks if t != tok.eos_id]), tuple(toks), finish))
            for i, (toks, finish) in enumerate(outs)])
    rewards: dict[int, list[float]] = {}
    failed: dict[str, int] = {}
    for i, o in enumerate(outcomes):
        rewards.setdefault(i // samples, []).append(float(o.reward))
        if o.error is not None:
            failed[o.error] = failed.get(o.error, 0) + 1
    row = eval_scores(rewards, pass_k=pass_k, threshold=cfg.eval.success_threshold)
    row.update(component_means([o.components for o in outcomes]))
    return {"target": label, **row, "eval_errors": sum(failed.values()), "reward_failed": failed,
            "greedy": samples == 1, "eval_s": time.monotonic() - t0}


def config_of(target: Path, config: str | None) -> str:
    """The config `laminar eval` reads: --config, else a run directory's own config.yaml."""
    from laminar_hpc.config import ConfigError
    if config is not None:
        return config
    if (target / "config.yaml").is_file():
        return str(target / "config.yaml")
    what = "a Hugging Face directory, which holds no task" if (target / "config.json").is_file() else \
        "not a run directory (no config.yaml)"
    raise ConfigError(f"{target} is {what}: give the task, eval and rollout settings with --config CONFIG")


def main(argv: list[str] | None = None) -> int:
    # the one parser of `laminar eval` (cli.py hands it every argument)
    ap = argparse.ArgumentParser(prog="laminar eval", description=__doc__.splitlines()[0])
    ap.add_argument("target", help="a run directory or a Hugging Face directory")
    ap.add_argument("--config", help="the task, eval and rollout settings (default: a run directory's own "
                                     "config.yaml)")
    ap.add_argument("--step", type=int, help="a run's checkpoint of this step (default: the newest that verifies)")
    ap.add_argument("--samples", type=int, help="per problem (default: eval.samples; 1: greedy)")
    ap.add_argument("--pass-k", type=int, help="default: eval.pass_k")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("overrides", nargs="*", help="key.path=value")
    args, rest = ap.parse_known_args(argv)  # overrides may also come after the options
    bad = [r for r in rest if r.startswith("-") or "=" not in r]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = [*args.overrides, *rest]
    from laminar_hpc.config import ConfigError, load_config
    from laminar_hpc.checkpoint_format import CheckpointError
    try:
        cfg = load_config(config_of(Path(args.target), args.config), args.overrides)
        samples = args.samples or cfg.eval.samples
        pass_k = args.pass_k or min(cfg.eval.pass_k, samples)
        if pass_k > samples:
            raise ConfigError(f"--pass-k {pass_k} needs at least as many --samples (got {samples})")
        model, tok, model_cfg, label = load_policy(cfg, Path(args.target), args.step)
        cfg = cfg.model_copy(update={"model": model_cfg})
        figures = evaluate(cfg, model, tok, samples=samples, pass_k=pass_k, label=label)
    except (ConfigError, CheckpointError, ValueError) as err:
        print(f"laminar eval: error: {err}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
