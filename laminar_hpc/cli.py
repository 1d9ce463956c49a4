"""`laminar`: the command line.

    laminar run CONFIG [--run-dir DIR] [--resume|--overwrite] [key.path=value ...]   # this machine
    laminar submit CONFIG --cluster slurm|local|debug [--run-dir DIR] [key.path=value ...]
    laminar render-sbatch CONFIG [--run-dir DIR] [key.path=value ...] > job.sbatch
    laminar status RUN_DIR
    laminar attach RUN_DIR --rollouts N [--kind NAME] [rollout.key=value ...]   # extra rollouts, a job of their own
    laminar attach RUN_DIR --cluster slurm --rollouts N --partition P [--qos Q] [--time MIN] [--nodes K]
    laminar resume RUN_DIR [--cluster slurm|local|debug]
    laminar drive CONFIG --run-dir DIR          # inside an allocation (what job.sbatch runs)
    laminar trace summary RUN_DIR [--buckets N] [--json]       # throughput, bubbles, staleness, sync latency
    laminar trace plot RUN_DIR [-o report.png]                 # Gantt timeline and histograms, one PNG
    laminar trace export RUN_DIR --format perfetto [-o trace.json]   # open in ui.perfetto.dev
    laminar trace compare RUN_A RUN_B                          # the summary figures side by side
    laminar simulate CONFIG [--calibrate RUN_DIR] [--json OUT] # every mode and scaling curves, simulated
    laminar plan CONFIG --gpus N [-o PLAN.yaml]                # the split and knobs of N GPUs, ranked
    laminar export-hf RUN_DIR [--step N | --live] [-o OUT_DIR] [--dtype D]   # a weight version as an HF dir
    laminar eval RUN_DIR_OR_HF_DIR [--config CONFIG] [--step N] [--samples N] [--json OUT]   # the validation split
(`laminar simulate`'s arguments are sim/cli.py's.)
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from laminar_hpc.config import ConfigError, load_config
from laminar_hpc.config.backend_specs import trainer_backend

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config


def _load(args, progress: bool = False) -> Config:
    """The config of `args`, checked before anything starts. `progress`: the start check's steps
    and a GGUF's conversion are said on stdout, as the display's lines (`laminar run`); other
    commands print only their own output there (render-sbatch's script) and these on stderr."""
    say = (lambda line: print(line, flush=True)) if progress else (lambda line: print(f"laminar: {line}",
                                                                                        file=sys.stderr))
    notes: list[str] = []
    cfg = load_config(args.config, args.overrides, notes=notes, require_sections=True)
    for line in notes:  # paths read from the config's directory, where the working directory differs
        print(f"laminar: {line}", file=sys.stderr)
    from laminar_hpc.tasks.preflight import StartCheckError, check_files
    try:
        check_files(cfg)  # before a model's conversion: minutes that a missing file would waste
    except StartCheckError as err:
        raise ConfigError(f"{err} (in {args.config})") from None
    if cfg.model.hf_path or cfg.model.hf_tokenizer:  # so does a missing or unsupported checkpoint
        from laminar_hpc.model.gguf_cache import CacheError
        from laminar_hpc.model.hf import HFCheckpointError, preflight
        try:
            preflight(cfg.model)
            if cfg.model.hf_path:  # a GGUF is dequantised once here, not by every role at every start
                from laminar_hpc.model.gguf_convert import convert_once
                convert_once(cfg.model.hf_path, say=say)
        except (HFCheckpointError, CacheError) as err:
            key = "model.hf_path" if cfg.model.hf_path else "model.hf_tokenizer"
            raise ConfigError(f"{key}: {_one_line(err)} (in {args.config})") from None
    check_task(cfg, args.config, say=say if progress else None)
    return cfg


def check_task(cfg: Config, source: str, say: Callable[[str], None] | None = None) -> None:
    """Before anything starts (tasks/preflight.py): the dataset loads, tools and environments
    import, a chat renders with the tokenizer's chat template, each reward function is called on a
    sample row in the reward pool under its timeout. One line on the first failure; warnings and
    notes go to stderr."""
    from laminar_hpc.model.factory import build_tokenizer
    from laminar_hpc.tasks.preflight import StartCheckError, check_start
    try:
        judge = cfg.task.reward.judge
        notes = check_start(cfg, tokenizer=lambda: build_tokenizer(cfg.model), say=say,
                            judge_tokenizer=(lambda: build_tokenizer(judge.model)) if judge else None)
    except StartCheckError as err:
        raise ConfigError(f"{_one_line(err)} (in {source})") from None
    for line in notes:
        print(f"laminar: {line}", file=sys.stderr)


def _check_resume(cfg: Config, run_dir: Path) -> None:
    """Pre-flight of a resume: a model that differs from the checkpoint's, a training change a
    resume cannot apply, or checkpoints whose controller log is gone, fail here in one line,
    before any process starts or anything in the run directory is rewritten; a training change
    it applies is said in one line (config/resume_changes.py)."""
    from laminar_hpc.launch.prepare import check_resume_model, resume_training_changes
    from laminar_hpc.checkpoint_format import log_lost_under_checkpoints
    from laminar_hpc.rundir import RunDir
    from laminar_hpc.walformat import check_log
    if why := log_lost_under_checkpoints(RunDir(run_dir)):
        raise ConfigError(why)
    if why := check_log(RunDir(run_dir).wal_dir):  # damaged: the controller would refuse it too
        raise ConfigError(why)
    if line := resume_training_changes(run_dir, cfg):
        print(f"laminar: {line}", file=sys.stderr)
    if not trainer_backend(cfg).has_model:
        return  # an emulated trainer checkpoints emulation.weight_mb bytes: the model section is not its shape
    check_resume_model(run_dir, cfg.model.model_dump())


def _default_run_dir(cfg: Config) -> Path:
    return Path(f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _print_summary(summary: dict, run_dir: Path) -> None:
    keys = ("reward_first", "reward_last", "train_steps", "trajectories_consumed", "max_versions_in_flight",
            "mean_version_lag", "max_version_lag", "mean_step_lag", "max_step_lag", "actor_stall_s_mean", "wall_s")
    print("summary: " + " ".join(f"{k}={summary[k]:.3f}" if isinstance(summary[k], float) else f"{k}={summary[k]}"
                                 for k in keys))
    for name in ("eval_first", "eval_last"):
        ev = summary.get(name)
        if isinstance(ev, dict):
            print(f"{name}: reward={ev.get('reward', 0.0):.3f} at version {ev.get('version')} (step {ev.get('step')})")
    print(_failures_line(summary))
    if line := dropped_line(summary):
        print(line)
    if summary.get("tool_calls"):  # a tool task: its calls per episode and their latency
        lat = summary.get("tool_latency_s") or {}
        print(f"tools: calls={summary['tool_calls']} per_episode={summary.get('tool_calls_per_episode') or 0.0:.2f} "
              f"latency_p50={lat.get('p50') or 0.0:.4f}s p99={lat.get('p99') or 0.0:.4f}s "
              f"outcomes={summary.get('tool_outcomes')}")
    print(f"run directory: {run_dir}")


def dropped_line(summary: dict) -> str:
    """'dropped: 1,479 prompts over task.max_prompt_tokens (of 1,479 refused), 3 bad rows skipped
    (epochs 23.5)', or '' when nothing was dropped: what the filters took, where the user looks."""
    refused, too_long, skipped = (int(summary.get(k) or 0) for k in ("prompts_refused", "prompts_too_long",
                                                                     "rows_skipped"))
    if not (refused or skipped):
        return ""
    parts = []
    if too_long:
        parts.append(f"{too_long:,} prompts over task.max_prompt_tokens")
    if refused - too_long:
        parts.append(f"{refused - too_long:,} prompts that cannot be generated from (logs/controller-0.log names them)")
    if skipped:
        parts.append(f"{skipped:,} bad rows skipped (task.on_bad_row: skip)")
    epochs = summary.get("epochs")
    epochs_text = f" (the dataset's epochs: {epochs:.2f})" if isinstance(epochs, float) else ""
    return "dropped: " + ", ".join(parts) + epochs_text


def _failures_line(summary: dict) -> str:
    """'failures: rewards=3 (exception 3) tools=0': summary.json's reward_failures and, for a run
    with tools, tool_failures."""
    def part(name: str, d: dict, by: str) -> str:
        detail = ", ".join(f"{k} {v}" for k, v in sorted((d.get(by) or {}).items()) if v)
        return f"{name}={d.get('total', 0)}" + (f" ({detail})" if detail else "")
    parts = [part("rewards", summary.get("reward_failures") or {}, "by_reason")]
    if "tool_failures" in summary:
        parts.append(part("tools", summary["tool_failures"], "by_outcome"))
    firsts = (summary.get("reward_failures") or {}).get("first") or {}
    # each reason's first detail: what failed, without opening the logs
    return "failures: " + " ".join(parts) + "".join(f"\n  first {reason}: {_one_line(detail)}"
                                                   for reason, detail in firsts.items())


def _run(args: argparse.Namespace) -> int:
    from laminar_hpc.launch.local import RoleFailed, run_local
    from laminar_hpc.startup.signals import honour_sigint
    honour_sigint()  # a run in the background stops on SIGINT too
    if args.resume and not args.run_dir:
        raise ConfigError("--resume continues an existing run: name it with --run-dir DIR")
    run_dir = None
    try:  # Ctrl-C at any point, the start check and the roles' start-up included, gets its line
        cfg = _load(args, progress=True)
        run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(cfg)
        if args.resume:
            _check_resume(cfg, run_dir)
        summary = run_local(cfg, run_dir, resume=args.resume, overwrite=args.overwrite)
    except RoleFailed as err:
        print(f"laminar: error: {err}\nlaminar: run directory: {run_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n" + interrupted_line(args.config, run_dir), file=sys.stderr)
        return 130
    _print_summary(summary, run_dir)
    return 0 if summary["outcome"] == "completed" else 75


def interrupted_line(config: str, run_dir: Path | None) -> str:
    """What a Ctrl-C kept and how to go on, in one line."""
    from laminar_hpc.rundir import RunDir
    ckpts = RunDir(run_dir).checkpoints() if run_dir is not None and run_dir.is_dir() else []
    if not ckpts:
        where = f" --run-dir {run_dir} --overwrite" if run_dir is not None and run_dir.exists() else ""
        return (f"laminar: interrupted before the first checkpoint: every role was stopped, nothing to resume; "
                f"start again with: laminar run {config}{where}")
    return (f"laminar: interrupted; every role was stopped; kept {ckpts[-1]} (and the run's logs and traces in "
            f"{run_dir}). Continue with: laminar run {config} --run-dir {run_dir} --resume")


def _submit(args: argparse.Namespace) -> int:
    from laminar_hpc.launch.submit import submit
    cfg = _load(args)
    cluster = args.cluster or cfg.cluster
    if cluster is None:
        raise ConfigError("say where to run: --cluster slurm|local|debug, or `cluster:` in the config "
                          "(it is never guessed)")
    if args.dry_run:  # what would be asked of Slurm, without asking: the render-sbatch script
        if cluster != "slurm":
            raise ConfigError(f"--dry-run shows a Slurm job; this campaign runs on '{cluster}'")
        from laminar_hpc.launch.submit import render_sbatch
        sys.stdout.write(render_sbatch(cfg, args.config, args.overrides, run_dir=args.run_dir))
        return 0
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(cfg)
    job_id = submit(cfg, run_dir, cluster)
    print(f"submitted job {job_id} ({cluster})\nrun directory: {run_dir}\nwatch: laminar status {run_dir}")
    return 0


def _render(args: argparse.Namespace) -> int:
    from laminar_hpc.launch.submit import render_sbatch
    cfg = _load(args)
    sys.stdout.write(render_sbatch(cfg, args.config, args.overrides, run_dir=args.run_dir))
    return 0


def _config(args: argparse.Namespace) -> int:
    """`laminar config CONFIG [KEY ...] [key=value ...]`: the resolved config, defaults included,
    each key with its meaning (config/reference.py)."""
    from laminar_hpc.config import load_config
    from laminar_hpc.config.reference import resolved
    overrides = [x for x in args.items if "=" in x]
    wanted = [x for x in args.items if "=" not in x]
    rows = resolved(load_config(args.config, overrides), wanted)
    if wanted and not rows:
        raise SystemExit(f"laminar: error: no key {', '.join(wanted)} in the schema (docs/config.md lists them)")
    for key, value, meaning in rows:
        print(f"{key} = {json.dumps(value)}" + (f"    # {meaning}" if meaning else ""))
    return 0


def _import(args: argparse.Namespace) -> int:
    """`laminar import verl SCRIPT` / `trl CONFIG`: a verl run script or a TRL GRPOConfig as a laminar
    config (config/recipe_import.py)."""
    from laminar_hpc.config.recipe_import import import_recipe
    from laminar_hpc.rundir import atomic_write_text
    text, lines = import_recipe(args.source, Path(args.script), base_dir=Path.cwd(), allow_unknown=args.allow_unknown)
    for line in lines:  # what became of each setting, one line each
        print(line, file=sys.stderr)
    if args.output:
        atomic_write_text(Path(args.output), text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def _status(args: argparse.Namespace) -> int:
    from laminar_hpc.launch.status_report import status_report
    print(status_report(Path(args.run_dir)))
    return 0


def _attach(args: argparse.Namespace) -> int:
    from laminar_hpc.launch.attach import AttachError, attach
    if args.rollouts < 1 or args.nodes < 1 or args.time < 1:
        print("laminar: error: --rollouts, --nodes and --time must be at least 1", file=sys.stderr)
        return 2
    try:
        if args.cluster == "slurm":
            from laminar_hpc.launch.attach import joiner_config
            from laminar_hpc.launch.attach_jobs import submit_attach
            from laminar_hpc.rundir import RunDir
            cfg = joiner_config(RunDir(args.run_dir), args.overrides)
            per_node = -(-args.rollouts // args.nodes)
            job = submit_attach(Path(args.run_dir), cfg, rollouts_per_node=per_node, nodes=args.nodes,
                                partition=args.partition, qos=args.qos, time_min=args.time,
                                overrides=args.overrides, kind=args.kind)
            print(f"attach job {job}: {per_node} rollouts on each of {args.nodes} node(s) once it starts; "
                  f"`laminar status {args.run_dir}` shows them, `scancel {job}` makes them leave")
            return 0
        return attach(Path(args.run_dir), args.rollouts, args.overrides, kind=args.kind)
    except AttachError as err:
        print(f"laminar: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _resume(args: argparse.Namespace) -> int:
    from laminar_hpc.rundir import RunDir, RunDirError, read_json
    rd = RunDir(args.run_dir)
    run_dir = rd.path
    if not rd.config.is_file():
        raise RunDirError(f"cannot resume {run_dir}: it holds no config.yaml (is it a laminar run directory?); "
                          "start a run with `laminar run CONFIG --run-dir DIR`")
    cfg = load_config(rd.config)
    job = read_json(rd.job) or {}
    cluster = args.cluster or job.get("cluster")
    if cluster is None:  # a `laminar run` directory: continue it here, in the foreground
        args.config, args.overrides, args.resume, args.overwrite = str(rd.config), [], True, False
        return _run(args)
    from laminar_hpc.launch.submit import submit
    _check_resume(cfg, run_dir)  # config.yaml edited since the run started
    job_id = submit(cfg, run_dir, cluster, resume=True)
    print(f"resubmitted job {job_id} ({cluster}) continuing {run_dir}")
    return 0


def _drive(args: argparse.Namespace) -> int:
    from laminar_hpc.launch.slurm_driver import drive
    cfg = _load(args)
    _check_resume(cfg, Path(args.run_dir))  # every start of a job script resumes its run directory
    summary = drive(cfg, Path(args.run_dir))
    _print_summary(summary, Path(args.run_dir))
    return 0 if summary["outcome"] == "completed" else 75


def _trace(args: argparse.Namespace) -> int:
    """`laminar trace ...`: analyse the traces of a run (laminar_hpc/analysis/trace_command.py)."""
    from laminar_hpc.analysis import TraceAnalysisError
    from laminar_hpc.analysis.trace_command import trace_command
    try:
        return trace_command(args)
    except TraceAnalysisError as err:
        print(f"laminar: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _eval(argv: list[str]) -> int:
    """`laminar eval`: its own process (rollout/evaluate.py, which parses the arguments), as every
    part that runs a model."""
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    return subprocess.call([sys.executable, "-m", "laminar_hpc.rollout.evaluate", *argv], env=env)


def _export_hf(args: argparse.Namespace) -> int:
    """`laminar export-hf`: a checkpoint (or, with --live, the newest published version) of a run
    as a directory transformers loads (laminar_hpc/model/export.py)."""
    from laminar_hpc.model.export import export_run
    from laminar_hpc.model.hf import HFCheckpointError
    from laminar_hpc.checkpoint_format import CheckpointError
    from laminar_hpc.rundir import RunDir, RunDirError
    rd = RunDir(args.run_dir)
    if not rd.config.is_file():
        raise RunDirError(f"{rd}: no config.yaml (is it a laminar run directory?); give the directory "
                          "`laminar run` wrote")
    cfg = load_config(rd.config)
    try:
        done = export_run(cfg, RunDir(rd, shm_dir=cfg.relay.shm_dir), step=args.step, live=args.live,
                          out=args.output, dtype=args.dtype)
    except (HFCheckpointError, CheckpointError) as err:
        print(f"laminar: error: {_one_line(err)}", file=sys.stderr)
        return 2
    note = "" if done.hf_tokenizer else " (no tokenizer files: the run uses the built-in char tokenizer)"
    print(f"wrote {done.out}: {done.label}, {done.parameters:,} parameters{note}")
    if done.adapter is not None:
        print(f"wrote {done.adapter}: the adapter in PEFT's format (PeftModel.from_pretrained, vLLM's LoRARequest)")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (with what to do) instead of usage + error."""

    def error(self, message: str):
        self.exit(2, f"laminar: error: {_one_line(message)}; see `{self.prog} --help`\n")


def _one_line(text: str) -> str:
    return " ".join(str(text).splitlines()).strip()


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="laminar", description="Trajectory-level asynchronous RL on HPC clusters")
    sub = ap.add_subparsers(dest="command", required=True)

    def with_config(name: str, help_: str):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", help="YAML config (see configs/)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4")
        return p

    run = with_config("run", "run a campaign on this machine, every role as its own process")
    run.add_argument("--run-dir", help="run directory (default runs/<name>-<time>)")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    group.add_argument("--overwrite", action="store_true", help="replace the run in --run-dir")
    run.set_defaults(func=_run)

    sm = with_config("submit", "submit a campaign (submitit) and return at once")
    sm.add_argument("--cluster", choices=["slurm", "local", "debug"], help="where to run (never guessed)")
    sm.add_argument("--run-dir", help="run directory (default runs/<name>-<time>)")
    sm.add_argument("--dry-run", action="store_true",
                    help="print the job's components, layout and steps (as render-sbatch) and submit nothing")
    sm.set_defaults(func=_submit)

    rs = with_config("render-sbatch", "print a plain sbatch script for the campaign")
    rs.add_argument("--run-dir", help="default RUN_DIR in the script (default runs/<name>)")
    rs.set_defaults(func=_render)

    cf = sub.add_parser("config", help="the resolved config with defaults, each key with its meaning (docs/config.md)")
    cf.add_argument("config", help="YAML config (see configs/)")
    cf.add_argument("items", nargs="*", help="keys or sections to show (e.g. trainer.max_staleness controller), "
                                             "and dotted overrides (trainer.lr=3e-4)")
    cf.set_defaults(func=_config)

    im = sub.add_parser("import", help="a verl run script (python -m verl.trainer.main_ppo key=value ...) or a TRL "
                                       "GRPOConfig (YAML, or --key value) as a laminar config; each setting mapped, "
                                       "ignored (laminar decides it) or refused, one line each")
    im.add_argument("source", choices=["verl", "trl"])
    im.add_argument("script", help="verl: the run script or its Hydra overrides; trl: the YAML or the CLI arguments")
    im.add_argument("-o", "--output", help="the config to write (default: printed)")
    im.add_argument("--allow-unknown", action="store_true",
                    help="import without the keys neither the tool nor laminar knows (each is still named); by "
                         "default one stops the import, as the tool itself would refuse it")
    im.set_defaults(func=_import)

    st = sub.add_parser("status", help="job, steps, versions, throughput, last checkpoint of a run")
    st.add_argument("run_dir")
    st.set_defaults(func=_status)

    at = sub.add_parser("attach", help="extra rollouts for a running campaign, in a job of their own (they leave "
                                       "on SIGTERM or Ctrl-C)")
    at.add_argument("run_dir")
    at.add_argument("overrides", nargs="*", help="the joiners' own rollout.* settings, e.g. rollout.max_batch=128")
    at.add_argument("--rollouts", type=int, required=True, help="how many rollouts to add")
    at.add_argument("--kind", help="a name for these replicas in traces and summaries (default <backend>-b<max_batch>)")
    at.add_argument("--cluster", choices=["local", "slurm"], default="local",
                    help="local: on this machine, in the foreground; slurm: submit a job of their own and return")
    at.add_argument("--partition", help="(slurm) the partition, e.g. a preemptible one (default: the cluster's)")
    at.add_argument("--qos", help="(slurm) the QOS")
    at.add_argument("--time", type=int, default=60, help="(slurm) the job's time limit in minutes (default 60)")
    at.add_argument("--nodes", type=int, default=1, help="(slurm) nodes; the rollouts are spread over them (default 1)")
    at.set_defaults(func=_attach)

    re_ = sub.add_parser("resume", help="continue a run from its last checkpoint (resubmits a submitted one)")
    re_.add_argument("run_dir")
    re_.add_argument("--cluster", choices=["slurm", "local", "debug"])
    re_.set_defaults(func=_resume)

    dr = with_config("drive", "run the campaign driver inside a Slurm allocation (what job.sbatch runs)")
    dr.add_argument("--run-dir", required=True)
    dr.set_defaults(func=_drive)

    tr = sub.add_parser("trace", help="analyse a run's traces: summary, plot, export (Perfetto), compare")
    tsub = tr.add_subparsers(dest="trace_command", required=True, metavar="{summary,plot,export,compare}")
    ts = tsub.add_parser("summary", help="throughput, utilisation, bubbles by cause, staleness, lengths, "
                                         "weight-sync latency, recoveries")
    ts.add_argument("run_dir")
    ts.add_argument("--buckets", type=int, default=10, help="time buckets of the throughput table (default 10)")
    ts.add_argument("--json", action="store_true", help="print the figures as JSON")
    tp = tsub.add_parser("plot", help="one PNG: per-replica Gantt timeline, utilisation, staleness, lengths, "
                                      "sync latency")
    tp.add_argument("run_dir")
    tp.add_argument("-o", "--output", default="report.png", help="PNG to write (default report.png)")
    te = tsub.add_parser("export", help="Chrome Trace Event Format JSON for ui.perfetto.dev / chrome://tracing")
    te.add_argument("run_dir")
    te.add_argument("--format", default="perfetto", choices=["perfetto"], help="output format (default perfetto)")
    te.add_argument("-o", "--output", default="trace.json", help="file to write (default trace.json)")
    tc = tsub.add_parser("compare", help="the summary figures of two runs side by side, with B/A")
    tc.add_argument("run_a")
    tc.add_argument("run_b")
    tc.add_argument("--buckets", type=int, default=10, help="time buckets compared (default 10)")
    tr.set_defaults(func=_trace)
    ex = sub.add_parser("export-hf", help="write a checkpoint (or the live newest version) as a Hugging Face "
                                          "directory that transformers loads")
    ex.add_argument("run_dir")
    which = ex.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint of this train step (default: the newest that verifies)")
    which.add_argument("--live", action="store_true", help="the newest version in the running trainer's hand-off store")
    ex.add_argument("-o", "--output", help="directory to create (default RUN_DIR/hf/<step or version>)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="tensor dtype (default model.dtype)")
    ex.set_defaults(func=_export_hf)
    sub.add_parser("eval", help="generate and score the task's validation split with a run's checkpoint or a "
                   "Hugging Face directory (laminar eval TARGET [--config CONFIG]; see laminar eval -h)")
    sub.add_parser("plan", help="size a campaign: the split of N GPUs and the knobs that matter, ranked by the "
                   "simulator (laminar plan CONFIG --gpus N [-o PLAN.yaml]; see laminar plan -h)")
    sub.add_parser("simulate", help="discrete-event simulation of a whole cluster, every mode, scaling curves "
                   "(laminar simulate CONFIG [--calibrate RUN_DIR] [--json OUT]; see laminar simulate -h)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from laminar_hpc.launch.plan import LayoutError
    from laminar_hpc.startup.signals import as_interrupt
    from laminar_hpc.launch.submit import SubmitError
    from laminar_hpc.rundir import RunDirError
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # its own parser (laminar_hpc/sim/cli.py): no torch, no run directory
        from laminar_hpc.sim.cli import main as simulate
        return simulate(argv[1:])
    if argv[:1] == ["plan"]:  # its own parser (laminar_hpc/sim/plan_cli.py): the simulator's search
        from laminar_hpc.sim.plan_cli import main as plan
        return plan(argv[1:])
    if argv[:1] == ["eval"]:  # its own parser too (laminar_hpc/rollout/evaluate.py), in its own process
        return _eval(argv[1:])
    parser = build_parser()
    # dotted overrides may come before or after options: collect what argparse left over
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if r.startswith("-") or "=" not in r]
    if bad or (rest and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(bad or rest)} (options start with --; overrides look "
                     "like key.path=value)")
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *rest]
    if args.command == "run":
        signal.signal(signal.SIGTERM, as_interrupt)  # a batch system's SIGTERM: as Ctrl-C
    try:
        return args.func(args)
    except (ConfigError, RunDirError, SubmitError, LayoutError) as err:
        print(f"laminar: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. a run directory that cannot be created: name the path, not a traceback
        where = f"{err.filename}: " if err.filename else ""
        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        hint = "free some space or use another --run-dir" if full else "check the path and its permissions"
        print(f"laminar: error: {where}{_one_line(err.strerror or err)}; {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
