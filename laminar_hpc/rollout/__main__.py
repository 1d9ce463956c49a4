"""`python -m laminar_hpc.rollout --run-dir DIR --rank N`: one rollout replica (rollout/main.py)."""
import argparse

from laminar_hpc.startup.signals import install_stop_handlers

install_stop_handlers()  # first: Slurm's signals can arrive while torch/mpi4py still import

from laminar_hpc.startup.role import start_role  # noqa: E402
from laminar_hpc.rollout.main import Rollout  # noqa: E402
from laminar_hpc.rollout.node import find_local_relay  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="a rollout replica of a campaign")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--relay", default="auto", help="relay rank to pull from, or 'auto': the relay on this node")
    ap.add_argument("--config", help="this rollout's own config (an attach job's joiners: launch/attach.py)")
    ap.add_argument("--kind", default="campaign", help="what traces call this replica's kind (an attach job's joiners)")
    args = ap.parse_args(argv)
    flags = install_stop_handlers()  # already installed by __main__ before the heavy imports
    ctx = start_role("rollout", args.rank, args.run_dir, config=args.config)
    try:
        relay = find_local_relay(ctx) if args.relay == "auto" else int(args.relay)
        ctx.log.info("pulling weights from relay %d", relay)
        # traces and `laminar trace summary` attribute work per kind of replica (elastic joiners)
        ctx.tracer.emit("replica", kind=args.kind, max_batch=ctx.cfg.rollout.max_batch, relay=relay,
                        joiner=args.rank >= ctx.cfg.rollout.count)
        rollout = Rollout(ctx, relay)
        try:
            rollout.run(flags)
            if args.rank >= ctx.cfg.rollout.count and flags.get("stop") and not rollout.stopping:
                rollout.leave(grace_s=ctx.cfg.timeouts.shutdown_s / 2)  # a joiner whose job ends
        finally:
            rollout.scoring.close()  # the reward pool's workers
            rollout.episodes.close()  # the tool loop (running tool processes are killed)
    finally:
        ctx.tracer.flush()
        ctx.ctrl.close(linger_ms=1000)
        ctx.log.info("stopped")



main()
