"""The run directory: every name and path in it, and atomic writes (the checkpoint folders'
format: checkpoint_format.py).

    run_dir/
      config.yaml            resolved config (what actually ran)
      run.json               run id of the current start, and every start (time, pid, host)
      job.json               the submitted job (`laminar submit`)
      endpoints/<name>.json  addresses roles publish for each other (controller, relays)
      logs/<role>.log        one log per process
      trace/<role>.<pid>.<start>.h5  event trace per process (HDF5, SWMR: readable while live)
      metrics.jsonl          one line per train step
      status.json            live status (controller, refreshed every second)
      controller_stats.json  the controller's counters at its end
      recoveries.json        the supervisor's restarts
      checkpoints/step_<N>/  trainer checkpoints (checkpoint_format.py)
      weights/v<N>.bin       partial-rollout over AReaL's update path: the version the trainer sends (raw packed bytes)
      wal/                   the controller's write-ahead log
      secrets/               the control plane's CURVE keys
      megatron/              rendezvous files of the Megatron trainer's ranks
      mpi/                   the relay tier's Open MPI session directories (TMPDIR of its ranks; 0700)
      hf/                    `laminar export-hf`'s default output
      submitit/              the submitted job's files (`laminar submit`)
      elastic/<job>/         an attach job's config (the campaign's, with its overrides)
      elastic/jobs.json      slurm.elastic's attach jobs; elastic/submitit/: their submitit files
      .lock                  held by the live campaign (launch/prepare.py)
      summary.json           written at the end of each start
      tensorboard/           TensorBoard event files (logging.tensorboard)
      wandb/                 Weights & Biases runs (logging.wandb; offline-run-* until synced)
      mlruns/                the default MLflow file store (logging.mlflow)
      trackers.json          the tracker runs' ids and how far metrics.jsonl was sent (metrics/trackers.py)
    <shm_dir>/laminar-<run id>/<what>   node-local shared memory (hand-off store, relay stores), in a
                                        directory of this start that only its user can enter (mode 0700)

`RunDir` is the only place that spells these names. It builds paths; the only file it touches
is run.json (the run id, `record_start`), so any process may build one (transport/shm_dir.py makes,
checks and removes the private shared-memory directory). It imports nothing from laminar_hpc
but the checkpoint format (a leaf too), so every layer may use it, and it imports no torch.

    rd = RunDir("runs/qs", shm_dir=cfg.relay.shm_dir)
    rd.endpoint("controller")     # runs/qs/endpoints/controller.json
    rd.shm_path("relay", 0)       # /dev/shm/laminar-<run id>/relay0
    rd.checkpoints()              # complete checkpoint folders, oldest first
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from laminar_hpc.checkpoint_format import checkpoint_name, list_checkpoints

# the errors of a disk that refuses a write (full, over quota, failing, read-only): a writer that
# must not end its role on them keeps its data and retries (controller/wal.py, metrics/jsonl.py)
DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.EROFS})
# no descriptor free (this process's limit, or the system's): a flood of connections can hold them
# for a while; writers that open a file treat it like a full disk (keep, retry, count, log once)
FD_ERRORS = frozenset({errno.EMFILE, errno.ENFILE})
TRANSIENT_ERRORS = DISK_ERRORS | FD_ERRORS


def transient_hint(err: OSError) -> str:
    """What to do about a transient write error, for its one log line."""
    if err.errno in FD_ERRORS:
        return "no file descriptor is free (too many open files or connections); retried by itself"
    return "free disk space; retried by itself"


NO_RUN_ID = "norun"  # the run id of a directory whose run.json is missing (roles started by hand, tests)


class RunDirError(RuntimeError):
    """A run directory that cannot be used as asked; the message names it and what to do."""


# -- atomic files ---------------------------------------------------------------------------------

def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temporary file and rename: readers see the old or the new file, never half."""
    if not isinstance(text, str):
        raise TypeError(f"atomic_write_text writes str, not {type(text).__name__}")
    atomic_write_bytes(path, text.encode(), mode)


def atomic_write_bytes(path: Path, data, mode: int = 0o600) -> None:
    """`atomic_write_text` for bytes (any buffer): readers see the whole file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any, mode: int = 0o644) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n", mode)


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


# -- the layout -----------------------------------------------------------------------------------

class RunDir:
    """Names and paths of one run directory. `shm_dir` (the config's `relay.shm_dir`) is needed
    only for the shared-memory names; `run_id` only where the caller already knows it. `os.fspath(rd)`
    is the directory, so a RunDir may be passed wherever a path is taken."""

    SUBDIRS = ("logs", "trace", "endpoints", "checkpoints")  # created with the directory

    def __init__(self, path: str | os.PathLike, shm_dir: str | os.PathLike | None = None,
                 run_id: str | None = None):
        self.path = Path(path)
        self.shm_dir = None if shm_dir is None else Path(shm_dir)
        self._run_id = run_id  # None: read from run.json when first asked

    @classmethod
    def of(cls, run_dir: "RunDir | str | os.PathLike") -> "RunDir":
        """`run_dir` as a RunDir (functions that take either)."""
        return run_dir if isinstance(run_dir, RunDir) else cls(run_dir)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # files at the top
    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def run_info(self) -> Path:
        return self.path / "run.json"

    @property
    def job(self) -> Path:
        return self.path / "job.json"

    @property
    def status(self) -> Path:
        return self.path / "status.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def controller_stats(self) -> Path:
        return self.path / "controller_stats.json"

    @property
    def recoveries(self) -> Path:
        return self.path / "recoveries.json"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def lock(self) -> Path:
        return self.path / ".lock"

    # experiment trackers (metrics/trackers.py)
    @property
    def trackers(self) -> Path:
        return self.path / "trackers.json"  # tracker run ids, metrics.jsonl bytes sent, failures

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        return self.path / "wandb"  # made by wandb itself inside the directory it is given (the run dir)

    @property
    def mlflow_dir(self) -> Path:
        return self.path / "mlruns"  # the MLflow file store when logging.mlflow.tracking_uri is unset

    # folders
    @property
    def endpoints_dir(self) -> Path:
        return self.path / "endpoints"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def trace_dir(self) -> Path:
        return self.path / "trace"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def wal_dir(self) -> Path:
        return self.path / "wal"

    @property
    def secrets_dir(self) -> Path:
        return self.path / "secrets"

    @property
    def mpi_dir(self) -> Path:
        return self.path / "mpi"  # the relay tier's Open MPI session directories: the run's, no shared /tmp

    @property
    def hf_dir(self) -> Path:
        return self.path / "hf"  # `laminar export-hf`'s default output

    @property
    def submitit_dir(self) -> Path:
        return self.path / "submitit"

    def judge_stats(self, name: str) -> Path:
        """A judge's own counters (judge/server.py rewrites it every few seconds; `laminar status` reads it)."""
        return self.path / "judges" / f"{name}.json"

    def joiner_dir(self, job: str) -> Path:
        """An attach job's folder (`laminar attach`: its config.yaml)."""
        return self.path / "elastic" / job

    @property
    def elastic_jobs(self) -> Path:
        return self.path / "elastic" / "jobs.json"  # slurm.elastic's attach jobs (launch/attach_jobs.py)

    @property
    def elastic_submitit_dir(self) -> Path:
        return self.path / "elastic" / "submitit"  # the attach jobs' submitit files

    @property
    def lineage(self) -> Path:
        return self.path / "lineage.json"  # every trainer start: version -> step (policy/lineage.py)

    @property
    def weights_dir(self) -> Path:
        return self.path / "weights"  # partial-rollout over AReaL's update path: the versions sent

    def weights_file(self, version: int) -> Path:
        return self.weights_dir / f"v{version:08d}.bin"

    def weights_files(self) -> dict[int, Path]:
        """version -> file of every complete version in `weights_dir` (temporary files excluded)."""
        out = {}
        for p in self.weights_dir.glob("v*.bin"):
            if p.stem[1:].isdigit():
                out[int(p.stem[1:])] = p
        return out

    def clear_weights(self) -> None:
        """Remove every version sent (a whole model each) and any half-written one; the folder stays."""
        for p in self.weights_dir.glob("*v*.bin*"):
            p.unlink(missing_ok=True)

    # files in the folders
    def endpoint(self, name: str) -> Path:
        return self.endpoints_dir / f"{name}.json"

    def endpoints(self, pattern: str = "*") -> list[Path]:
        """Published endpoint files whose name matches `pattern` (e.g. 'relay[0-9]*'), sorted."""
        return sorted(self.endpoints_dir.glob(f"{pattern}.json"))

    def log(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def trace_file(self, name: str, pid: int, tag: str = "") -> Path:
        """`<name>.<pid>.<tag>.h5`; the tag (the Tracer's: start time and a random part) keeps a
        reused pid from naming an earlier file. Without one, the `<name>.<pid>.h5` of older runs."""
        return self.trace_dir / (f"{name}.{pid}.{tag}.h5" if tag else f"{name}.{pid}.h5")

    def trace_files(self, role: str | None = None) -> list[Path]:
        """Trace files, sorted: every incarnation's HDF5 file (old and new names), and the JSON
        lines of runs made before the HDF5 format; with `role` (e.g. 'rollout-1') only that role's."""
        h5, jsonl = ("*.h5", "*.jsonl") if role is None else (f"{role}.*.h5", f"{role}.jsonl")
        return sorted([*self.trace_dir.glob(h5), *self.trace_dir.glob(jsonl)])

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / checkpoint_name(step)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        return list_checkpoints(self.checkpoints_dir)

    # run.json: which start of the run this is
    @property
    def run_id(self) -> str:
        """The id of the run's current start (read once), which names its shared memory."""
        if self._run_id is None:
            self._run_id = (read_json(self.run_info, {}) or {}).get("run_id") or NO_RUN_ID
        return self._run_id

    def starts(self) -> list[dict]:
        return (read_json(self.run_info) or {}).get("starts", [])

    def record_start(self, run_id: str) -> None:
        """A new start of the run, under a new run id (the launcher, once per start)."""
        info = read_json(self.run_info, {}) or {}
        info.setdefault("starts", []).append({"time": time.time(), "pid": os.getpid(), "host": os.uname().nodename})
        info["run_id"] = run_id
        atomic_write_json(self.run_info, info)
        self._run_id = run_id

    # node-local shared memory (transport/shm_dir.py makes, checks and removes the directory)
    def shm_path(self, kind: str, rank: int | None = None) -> Path:
        """Shared-memory file of this start of the run: 'handoff', or ('relay', rank), in `shm_run_dir`."""
        return self.shm_run_dir / f"{kind}{'' if rank is None else rank}"

    @property
    def shm_run_dir(self) -> Path:
        """This start's private shared-memory directory on each node: made (mode 0700) by the node's
        first writer (`WeightStore.create`), removed whole by the launchers' cleanup."""
        return self._shm() / f"laminar-{self.run_id}"

    def _shm(self) -> Path:
        if self.shm_dir is None:
            raise ValueError(f"RunDir({str(self.path)!r}) was built without shm_dir (the config's relay.shm_dir)")
        return self.shm_dir
