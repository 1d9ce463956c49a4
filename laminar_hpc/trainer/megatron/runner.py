"""The Megatron trainer as a group of ranks: rank 0 runs the trainer loop, the others follow it.

Rank 0 is the trainer role (controller, ledger, publishing, checkpoint bookkeeping). Each
backend call it makes is first broadcast as a command over a CPU (gloo) group, so every rank
enters the same Megatron collectives in the same order:

    ("train", batch, lr, temperature)   every rank trains on the same batch (its DP share)
    ("export",)                         full HF-named weights gathered onto rank 0 (publish)
    ("save", dir) / ("load", dir)       dist_checkpointing of model and distributed optimizer
    ("stop",)

    # every rank, after torch.distributed.init_process_group (see start_ranks):
    ranks = Ranks(cfg, tok)
    if rank == 0: backend = MegatronBackend(ranks, ...)  # megatron/megatron_backend.py, used by trainer/main.py
    else: follow(ranks)                                  # returns at ("stop",)
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

log = logging.getLogger("laminar.trainer")

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.model.tokenizer import Tokenizer


def control_timeout_s(cfg: Config) -> float:
    """Followers wait in a broadcast while rank 0 waits for trajectories, weights or a checkpoint."""
    t = cfg.timeouts
    return t.trajectories_s + t.weights_s + t.checkpoint_s + t.startup_s + t.busy_s


def init_distributed(cfg: Config, rank: int, world: int, init_method: str) -> None:
    """The trainer's process group (NCCL on GPUs, gloo otherwise, as trainer.megatron.dist_backend says)."""
    mcfg = cfg.trainer.megatron
    want = mcfg.tensor_parallel * mcfg.pipeline_parallel * mcfg.data_parallel
    if world != want:
        raise ValueError(f"trainer world size {world} != trainer.megatron tensor_parallel * pipeline_parallel * "
                         f"data_parallel = {want}")
    if mcfg.dist_backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("trainer.megatron.dist_backend: nccl needs GPUs; this node has none (use gloo)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(mcfg.dist_backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.timeouts.startup_s + cfg.timeouts.busy_s))


class Ranks:
    """What every rank holds: the Megatron engine and the command channel."""

    def __init__(self, cfg: Config, tok: Tokenizer):
        from laminar_hpc.model.factory import build_model
        from laminar_hpc.trainer.megatron.engine import MegatronEngine
        self.cfg = cfg
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s(cfg)))
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank (or model.hf_path's)
        model = build_model(cfg.model, tok, "cpu")
        self.args = model.args
        hf = {k: v.detach() for k, v in model.state_dict().items()}
        self.engine = MegatronEngine(self.args, cfg.trainer, hf, seed=cfg.seed, control_group=self.group)
        del model, hf

    def bcast(self, cmd=None):
        box = [cmd]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def run(self, cmd: tuple):
        op = cmd[0]
        if op == "train":
            return self.engine.train_step(cmd[1], lr=cmd[2], temperature=cmd[3])
        if op == "export":
            return self.engine.export_hf()
        if op == "save":
            return self.engine.save(cmd[1])
        if op == "load":
            return self.engine.load(cmd[1])
        raise ValueError(f"unknown trainer command {op!r}")


def follow(ranks: Ranks) -> None:
    """A rank > 0: run rank 0's commands until it says stop."""
    while True:
        cmd = ranks.bcast()
        if cmd[0] == "stop":
            return
        ranks.run(cmd)


# -- starting the ranks ----------------------------------------------------------------------------

def adopt_slurm_ranks(run_dir) -> None:
    """A trainer step of several tasks (srun -n WORLD, launch/plan.py): each task takes its rank
    from Slurm, and the ranks meet through a file in the run directory, named after the job step
    (a restarted trainer is a new step: a new file). No MASTER_ADDR/PORT to agree on."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) <= 1:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_STEP_NUM_TASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    step = f"{os.environ.get('SLURM_JOB_ID', 'job')}.{os.environ.get('SLURM_STEP_ID', 'step')}"
    rdzv = Path(run_dir) / "megatron" / f"rendezvous-{step}"
    rdzv.parent.mkdir(parents=True, exist_ok=True)
    os.environ["LAMINAR_RDZV"] = f"file://{rdzv}"


def _launcher_init() -> str:
    return os.environ.get("LAMINAR_RDZV", "env://")


def _follower_main(run_dir: str, rank: int, world: int, init_method: str) -> None:
    """A spawned rank > 0 on this node: same config as rank 0, no controller connection."""
    from laminar_hpc.config import load_config
    from laminar_hpc.model.factory import build_tokenizer
    from laminar_hpc.startup.role import setup_logging
    setup_logging(f"trainer-rank{rank}")  # into rank 0's log (a spawned rank shares its stderr)
    cfg = load_config(Path(run_dir) / "config.yaml")
    torch.set_num_threads(cfg.trainer.torch_threads)
    t0 = time.monotonic()
    init_distributed(cfg, rank, world, init_method)
    log.info("trainer rank %d: joined the rendezvous in %.1fs", rank, time.monotonic() - t0)
    ranks = Ranks(cfg, build_tokenizer(cfg.model))
    log.info("trainer rank %d: started in %.1fs", rank, time.monotonic() - t0)
    follow(ranks)
    dist.destroy_process_group()


FOLLOWER_DIED_EXIT = 70  # rank 0's exit status when a rank it spawned died under it (EX_SOFTWARE)


class Followers:
    """The ranks > 0 that rank 0 spawned on this node, and a watch over them for rank 0's whole life.

    A follower that dies leaves rank 0 waiting for it in the rendezvous or in a collective until
    that one's timeout (timeouts.startup_s + busy_s: half an hour by default). The watch sees the
    death at once (each process's sentinel) and ends rank 0, naming the rank and its exit status,
    so that the supervisor restarts the trainer; the follower's own error is above it in the same
    log (spawned ranks write to rank 0's stderr). Under a launcher (srun, torchrun) the launcher
    ends the step when a task dies, and there is nothing to watch."""

    def __init__(self, procs: list, on_death=None):
        self.procs = procs
        self.on_death = on_death or _end_rank0
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="trainer-follower-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            ready = wait_for_any([*alive, self._stop_read])
            if self._stop_read in ready:
                return
            for sentinel in ready:
                proc = alive.pop(sentinel)
                proc.join(5)  # its sentinel closes as it exits: the status follows at once (not with join(0))
                self.on_death(proc)

    def stop_watching(self) -> None:
        """Rank 0 is about to stop them (or has failed): their deaths are expected from here on.
        Closes the watch's pipe once the watch has ended (called again: nothing more to do)."""
        if self._stop_write < 0:
            return
        if self._thread.is_alive():
            os.write(self._stop_write, b"x")
            self._thread.join(5)
        if not self._thread.is_alive():
            os.close(self._stop_read)
            os.close(self._stop_write)
            self._stop_read = self._stop_write = -1

    def join(self, timeout_s: float) -> None:
        """Wait for each (by process, within one deadline), then kill stragglers."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


def _end_rank0(proc) -> None:
    log.error(
        "trainer rank %s (pid %s) ended with exit status %s while rank 0 still needed it: rank 0 stops "
        "(exit %d) so that the trainer is restarted; the rank's own error is above in this log",
        proc.name.removeprefix("trainer-rank"), proc.pid, proc.exitcode, FOLLOWER_DIED_EXIT)
    for handler in logging.getLogger().handlers + logging.getLogger("laminar").handlers:
        handler.flush()
    os._exit(FOLLOWER_DIED_EXIT)  # from the watch thread: rank 0's main thread is inside a collective


def start_ranks(cfg: Config, run_dir: Path, tok: Tokenizer) -> tuple[Ranks, Followers | None]:
    """Rank 0 (this process) and its followers. Under a launcher that set RANK / WORLD_SIZE /
    MASTER_ADDR / MASTER_PORT (srun with ntasks = world, torchrun) every task runs this role and
    those with RANK > 0 only follow (see `main` here); otherwise the followers are spawned on
    this node, watched (Followers), and meet through a file in the run directory."""
    import torch.multiprocessing as mp
    m = cfg.trainer.megatron
    world = m.tensor_parallel * m.pipeline_parallel * m.data_parallel
    followers = None
    if "WORLD_SIZE" in os.environ:
        init = _launcher_init()
    else:
        rdzv = Path(run_dir) / "megatron" / f"rendezvous-{os.getpid()}"
        rdzv.parent.mkdir(parents=True, exist_ok=True)
        rdzv.unlink(missing_ok=True)
        init = f"file://{rdzv}"
        ctx = mp.get_context("spawn")
        procs = []
        for r in range(1, world):
            p = ctx.Process(target=_follower_main, args=(str(run_dir), r, world, init), name=f"trainer-rank{r}")
            p.start()
            procs.append(p)
        followers = Followers(procs)
    watch = StartWatch(cfg.timeouts.startup_s, followers)
    try:
        init_distributed(cfg, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", world)), init)
        watch.reached("the control group, the model and Megatron's groups")
        ranks = Ranks(cfg, tok)
        watch.done()
        return ranks, followers
    except BaseException:
        watch.done()
        stop_ranks(None, followers, 0.0, clean=False)  # rank 0 failed: its followers go with it
        raise


START_STUCK_EXIT = 71  # rank 0's exit status when the ranks' start outlived timeouts.startup_s


class StartWatch:
    """Rank 0's deadline for the ranks' start (rendezvous, groups, engine), which has none of its own
    short of the process group's timeout (startup_s + busy_s: half an hour by default). At
    `startup_s` it names the stage it was in and the followers still alive, and ends rank 0 so
    that the supervisor restarts the trainer. Each stage is logged with its time."""

    def __init__(self, startup_s: float, followers: Followers | None):
        self.t0 = time.monotonic()
        self.stage = "the rendezvous of the ranks"
        self.followers = followers
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(startup_s,), name="trainer-start-watch", daemon=True)
        self._thread.start()

    def reached(self, stage: str) -> None:
        log.info("trainer ranks: %s done in %.1fs; now %s", self.stage, time.monotonic() - self.t0, stage)
        self.stage = stage

    def done(self) -> None:
        if not self._done.is_set():
            log.info("trainer ranks: started in %.1fs", time.monotonic() - self.t0)
        self._done.set()

    def _watch(self, startup_s: float) -> None:
        if self._done.wait(startup_s):
            return
        if self.followers is not None:
            alive = ", ".join(p.name for p in self.followers.procs if p.is_alive()) or "none"
        else:  # a launcher's world: its other tasks should have joined
            alive = "none spawned here; the ranks are a launcher's: " + ", ".join(
                f"{k}={os.environ.get(k)}" for k in ("RANK", "WORLD_SIZE", "LAMINAR_RDZV", "MASTER_ADDR") if k in os.environ)
        log.error("trainer ranks: their start did not finish within timeouts.startup_s=%.0fs: rank 0 still waits "
                  "for %s (followers alive: %s); exiting with %d so that the trainer is restarted", startup_s,
                  self.stage, alive, START_STUCK_EXIT)
        for handler in logging.getLogger().handlers + logging.getLogger("laminar").handlers:
            handler.flush()
        if self.followers is not None:
            self.followers.stop_watching()
            for p in self.followers.procs:
                p.kill()
        os._exit(START_STUCK_EXIT)


def stop_ranks(ranks: Ranks | None, followers: Followers | None, timeout_s: float, clean: bool = True) -> None:
    """Tell the followers to stop, wait for them (by process, with a deadline), then kill stragglers.
    After a failure on rank 0 (`clean` false) the followers may sit in a collective that will never
    complete: they are killed without a stop command."""
    if followers is not None:
        followers.stop_watching()
    if ranks is not None and clean:
        ranks.bcast(("stop",))
    if dist.is_initialized():
        dist.destroy_process_group()
    if followers is not None:
        followers.join(timeout_s if clean else 0.0)


def run_if_follower(argv: list[str]) -> bool:
    """For `python -m laminar_hpc.trainer`, before the trainer role starts: a task of a Megatron
    trainer step (srun -n WORLD) takes its rank from Slurm; a rank > 0 (srun, torchrun) has no
    role of its own and follows rank 0 here until it stops (True). False: go on as the trainer."""
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        import argparse
        ap = argparse.ArgumentParser(add_help=False)
        ap.add_argument("--run-dir", required=True)
        adopt_slurm_ranks(ap.parse_known_args(argv)[0].run_dir)
    if int(os.environ.get("RANK", "0")) > 0:
        main(argv)
        return True
    return False


def main(argv: list[str] | None = None) -> None:
    """A follower task started by srun (RANK > 0 set): `python -m laminar_hpc.trainer.megatron --run-dir DIR`."""
    import argparse
    ap = argparse.ArgumentParser(description="Megatron trainer rank > 0 (follows rank 0)")
    ap.add_argument("--run-dir", required=True)
    a = ap.parse_args(argv)
    from laminar_hpc.config import load_config
    from laminar_hpc.startup.ownership import check_run_dir
    from laminar_hpc.model.factory import build_tokenizer
    check_run_dir(a.run_dir)  # as every role: a run directory another user could change is refused
    cfg = load_config(Path(a.run_dir) / "config.yaml")
    init_distributed(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), _launcher_init())
    follow(Ranks(cfg, build_tokenizer(cfg.model)))
    dist.destroy_process_group()
