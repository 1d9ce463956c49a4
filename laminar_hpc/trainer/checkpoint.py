"""Trainer checkpoints on the run directory's filesystem: atomic, verified, rotated, asynchronous.

The checkpoint format has two owners that split at torch: laminar_hpc/rundir.py holds the
names (`checkpoint_name`, MODEL_FILE, META_FILE, MANIFEST_FILE, COMPLETE_FILE, ...), the listing
and the verification; this module writes and loads the tensors. Nothing else spells a file name
of a checkpoint folder:

    checkpoints/step_000100/
      model.pt optim.pt rng.pt   state
      meta.json                  step, version, model shape
      ledger.json                the trainer's exactly-once ledger (absent in older checkpoints)
      dist/                      trainer.backend megatron: its dist_checkpointing shards
      manifest.json              sha256 of every file above
      COMPLETE                   written last: a directory without it is ignored
    checkpoints/anchor/          the campaign's initial policy, the KL reference (`keep_anchor`,
                                 `load_anchor`): made once from step_000000, never pruned

Written under a temporary name and renamed, so a crash mid-write never leaves a directory
that looks complete (`remove_unfinished` clears what a killed writer left). `load_latest`
verifies the manifest and falls back to the previous checkpoint when the newest is corrupt or
partial (saying so). A write that fails (a full disk) removes its temporary directory and
leaves every earlier checkpoint as it was.

A save is a `Snapshot` (host copies of the state, meta and ledger as JSON text) and its write
(`write_snapshot`). `AsyncCheckpointer` takes the snapshot of a module and its optimizer (the
only part training waits for) and writes it from one background thread, never from the live
model, so training can go on changing the weights while the files are written. The Megatron
backend builds its own snapshot (the gathered weights) and writes it the same way, adding its
shards (trainer/megatron/megatron_backend.py).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from laminar_hpc.checkpoint_format import (COMPLETE_FILE, LEDGER_FILE, MANIFEST_FILE, META_FILE, MODEL_FILE, OPTIM_FILE,
                                           RNG_FILE, CheckpointError, anchor_path, checkpoint_name, list_checkpoints,
                                           log, newest_verified, read_ledger, sha256, verified_anchor, verify)

if TYPE_CHECKING:
    from laminar_hpc.config.schema import Config

__all__ = ["AsyncCheckpointer", "CheckpointError", "DIST_OPTIMIZER", "Snapshot", "failure_line", "keep_anchor",
           "list_checkpoints", "load_anchor", "load_latest", "load_policy", "read_ledger", "remove_unfinished", "save_checkpoint",
           "snapshot", "verify", "write_snapshot"]

# the key of optim.pt when the optimizer state is elsewhere (the Megatron backend's dist/ shards):
# a module backend refuses to resume such a checkpoint instead of loading a wrong optimizer
DIST_OPTIMIZER = "megatron_dist_checkpoint"


# -- the snapshot: the part the caller waits for ------------------------------------------------

@dataclass
class Snapshot:
    """Everything one checkpoint writes, copied off the live state: written from another thread
    while training goes on."""
    step: int
    version: int
    model: dict
    optim: dict
    rng: dict
    meta_text: str
    ledger_text: str | None


def _to_host(obj, memo: dict):
    """A copy of a (nested) state dict that shares nothing with the live one: tensors are
    copied to CPU (optimizer steps update `exp_avg` and even `step` in place), containers and
    scalars are copied. Identical views (the tied embedding and lm_head) stay one tensor, so the
    file does not hold the weights twice."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t.device)
        if key not in memo:
            memo[key] = t.to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        out = type(obj)() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _to_host(v, memo)
        if hasattr(obj, "_metadata"):  # module versions that load_state_dict reads back
            out._metadata = copy.deepcopy(obj._metadata)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v, memo) for v in obj)
    return copy.deepcopy(obj)


def _rng_state() -> dict:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def snapshot(step: int, version: int, *, model_state: dict, optim_state: dict, meta: dict,
             ledger: dict | None) -> Snapshot:
    """A snapshot of state dicts the caller already owns (copies, or freshly gathered tensors),
    with this process's RNG state."""
    # meta and ledger become JSON text here, in the caller: that is their copy, and a value
    # that is not JSON fails at the call instead of later in the background thread.
    return Snapshot(step=step, version=version, model=model_state, optim=optim_state, rng=_rng_state(),
                    meta_text=json.dumps({**meta, "step": step, "version": version}, indent=1),
                    ledger_text=None if ledger is None else json.dumps(ledger))


def _module_snapshot(step: int, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
                     ledger: dict | None) -> Snapshot:
    return snapshot(step, version, model_state=_to_host(model.state_dict(), {}),
                    optim_state=_to_host(optimizer.state_dict(), {}), meta=meta, ledger=ledger)


# -- the write: shared by the synchronous and the asynchronous path -----------------------------

class _HashingWriter:
    """A file that hashes what goes through it, so the manifest needs no second read, and keeps
    the first write error: torch's writer may bury it under a later "unexpected pos" error."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.h.update(data)
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.f.flush()


def _write_file(path: Path, fill) -> str:
    # torch.save gets a Python file, not a path: given a path, its C++ writer reports a full
    # disk only as "unexpected pos 576 vs 534"; through a Python file we see the OSError (ENOSPC).
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        try:
            fill(w)
        except Exception:
            if w.error is not None:
                raise w.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return w.h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unfinished_name(name: str, pid: int | str) -> str:
    """Where checkpoint `name` is written before its rename (per process: two writers never collide)."""
    return f".{name}.tmp{pid}"


def remove_unfinished(root: Path) -> None:
    """Remove the temporary directories of writes cut short by a kill (a start does, before it
    writes): they never count as checkpoints, but each holds up to a whole model. A directory set
    aside while the same step was rewritten (`.old`) is kept: it may be the only copy of that step."""
    for tmp in Path(root).glob(_unfinished_name("*", "*")):
        shutil.rmtree(tmp, ignore_errors=True)


def write_snapshot(root: Path, snap: Snapshot, keep: int,
                   extra: Callable[[Path], dict[str, str]] | None = None) -> Path:
    """Write `snap` as checkpoint step_<step> under `root` (atomically, see the module's doc),
    then keep only the newest `keep`. `extra(tmp)`, when given, writes more files into the
    temporary directory (the Megatron backend's dist_checkpointing shards) and returns
    {relative path: sha256} for the manifest."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(snap.step)
    final = root / name
    tmp = root / _unfinished_name(name, os.getpid())
    old = root / f".{name}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    moved_old = renamed = False
    try:
        manifest = {}
        for fname, obj in ((MODEL_FILE, snap.model), (OPTIM_FILE, snap.optim), (RNG_FILE, snap.rng)):
            manifest[fname] = _write_file(tmp / fname, lambda f, obj=obj: torch.save(obj, f))
        texts = {META_FILE: snap.meta_text}
        if snap.ledger_text is not None:
            texts[LEDGER_FILE] = snap.ledger_text
        for fname, text in texts.items():
            manifest[fname] = _write_file(tmp / fname, lambda f, text=text: f.write(text.encode()))
        if extra is not None:
            manifest.update(extra(tmp))
        _write_file(tmp / MANIFEST_FILE, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(tmp)
        if final.exists():  # the same step again (resumed, then stopped): keep it until the new one is whole
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            moved_old = True
        os.replace(tmp, final)
        renamed = True
        _write_file(final / COMPLETE_FILE, lambda f: f.write(b"ok\n"))  # the marker goes last
        _fsync_dir(final)
        _fsync_dir(root)
    except BaseException:
        # even the marker can hit a full disk: undo the rename and bring back what was there
        if renamed:
            shutil.rmtree(final, ignore_errors=True)
        if moved_old:
            os.replace(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if moved_old:
        shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(root)[:-max(1, keep)]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def failure_line(root: Path, step: int, err: BaseException) -> str:
    """One line for the log and the controller: what failed, why, and what a resume would use."""
    prev = list_checkpoints(root)
    tail = f"the previous checkpoint {prev[-1].name} is intact" if prev else "there is no previous checkpoint"
    why = str(err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
    why = " ".join(why.split())  # torch errors can span lines
    return f"checkpoint {checkpoint_name(step)} in {root} not written: {why}; {tail}"


# -- public API -------------------------------------------------------------------------------

def save_checkpoint(root: Path, *, step: int, version: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, meta: dict, keep: int, ledger: dict | None = None) -> Path:
    """Write a checkpoint and return its directory; CheckpointError (one line) if it cannot be
    written, with the earlier checkpoints untouched."""
    root = Path(root)
    snap = _module_snapshot(step, version, model, optimizer, meta, ledger)
    try:
        return write_snapshot(root, snap, keep)
    except Exception as err:
        raise CheckpointError(failure_line(root, step, err)) from err


class AsyncCheckpointer:
    """At most one checkpoint write in flight, done by a background thread.

    `save` blocks for the host copy (and for the previous write, if still going); `poll`
    returns the writes that finished since the last call, a failure as {"error": one line}."""

    def __init__(self, root: Path, keep: int, timeout_s: float = 600.0):
        self.root, self.keep, self.timeout_s = Path(root), keep, timeout_s
        self._thread: threading.Thread | None = None
        self._step: int | None = None  # the step in flight, for the timeout message
        self._lock = threading.Lock()
        self._done: list[dict] = []

    def save(self, step: int, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             meta: dict, ledger: dict | None = None,
             extra: Callable[[Path, dict], dict[str, str]] | None = None) -> float:
        """Start writing a checkpoint; returns the seconds the caller was blocked. `extra(tmp,
        model_state)` writes more files from the snapshot's model state (an adapter in PEFT's
        format) and returns {relative path: sha256} for the manifest."""
        t0 = time.monotonic()
        self._join(self.timeout_s)
        snap = _module_snapshot(step, version, model, optimizer, meta, ledger)
        self._step = step
        self._thread = threading.Thread(target=self._run, args=(snap, extra), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()
        return time.monotonic() - t0

    def _run(self, snap: Snapshot, extra=None) -> None:
        # never raises: the training thread learns of a failure through poll()
        t0 = time.monotonic()
        try:
            path = write_snapshot(self.root, snap, self.keep,
                                  None if extra is None else (lambda tmp: extra(tmp, snap.model)))
            res = {"step": snap.step, "version": snap.version, "path": str(path), "write_s": time.monotonic() - t0}
        except BaseException as err:
            res = {"step": snap.step, "version": snap.version, "error": failure_line(self.root, snap.step, err)}
            log.error("%s", res["error"])
        with self._lock:
            self._done.append(res)

    def _join(self, timeout_s: float | None) -> None:
        t = self._thread
        if t is None:
            return
        t.join(self.timeout_s if timeout_s is None else timeout_s)
        if t.is_alive():
            raise TimeoutError(f"checkpoint {checkpoint_name(self._step)} to {self.root / checkpoint_name(self._step)} "
                               f"still being written after {self.timeout_s if timeout_s is None else timeout_s}s")
        self._thread = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> list[dict]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float | None = None) -> list[dict]:
        """Wait for the write in flight (TimeoutError after timeout_s), then poll()."""
        self._join(timeout_s)
        return self.poll()

    def close(self) -> list[dict]:
        return self.wait()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_latest(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    """Restore the newest checkpoint that verifies; its meta (with "path" and "ledger"), or None."""
    found = newest_verified(root)
    if found is None:
        return None
    path, meta = found
    state = torch.load(path / MODEL_FILE, map_location="cpu")
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        detail = [ln.strip() for ln in str(err).splitlines()[1:] if ln.strip()]
        raise CheckpointError(f"{path}: model shape differs from the config "
                              f"({detail[0] if detail else str(err)})") from None
    if optimizer is not None:
        optim = torch.load(path / OPTIM_FILE, map_location="cpu")
        if isinstance(optim, dict) and DIST_OPTIMIZER in optim:
            raise CheckpointError(f"{path} was written by trainer.backend: megatron (optimizer state in "
                                  f"{optim[DIST_OPTIMIZER]}/): resume it with that backend")
        optimizer.load_state_dict(optim)
    rng = torch.load(path / RNG_FILE)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    meta["path"] = str(path)
    return meta



# -- the KL anchor: the campaign's initial policy, kept for the whole campaign -------------------


def load_policy(cfg: Config, tok, root: Path) -> tuple[torch.nn.Module, dict | None]:
    """The policy of the newest checkpoint under `root` that verifies, as full weights (an adapter
    run's adapter loaded on the base the run built, then merged into it), and its meta (None: no
    checkpoint; the model is then as built)."""
    if cfg.model.lora is None:
        from laminar_hpc.model.factory import build_model
        model = build_model(cfg.model, tok)
        return model, load_latest(root, model, None)
    from laminar_hpc.model.adapters import AdapterState, build_base, peft_policy
    policy = peft_policy(build_base(cfg, tok), cfg.model.lora)
    meta = load_latest(root, AdapterState(policy), None)
    return policy.merge_and_unload(), meta

def keep_anchor(root: Path) -> dict | None:
    """Make checkpoints/anchor from step_000000 (the policy RL starts from: after the warm-up, or
    the initial checkpoint or model) unless it exists; returns its meta, or None when there is no
    anchor and no step_000000 to make it from (a run from before anchors whose first checkpoint
    was pruned). The weights are hard-linked where the filesystem allows (checkpoint files are
    never rewritten in place, only replaced), else copied; written under a temporary name and
    renamed, with a manifest and a COMPLETE marker, like a checkpoint."""
    root = Path(root)
    final = anchor_path(root)
    if (final / COMPLETE_FILE).exists():  # verified where it is loaded (load_anchor), not at every start
        try:
            return json.loads((final / META_FILE).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{final}: unreadable KL anchor ({err})") from None
    first = root / checkpoint_name(0)
    if not (first / COMPLETE_FILE).exists():
        return None
    meta0 = verify(first)  # the source must be whole before it becomes the reference for good
    tmp = root / _unfinished_name(final.name, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        try:
            os.link(first / MODEL_FILE, tmp / MODEL_FILE)
        except OSError:  # a filesystem without hard links (or across devices): a copy
            shutil.copyfile(first / MODEL_FILE, tmp / MODEL_FILE)
        meta = {"step": 0, "version": meta0["version"], "source": checkpoint_name(0),
                "model": meta0.get("model"), "made": time.time()}
        _write_file(tmp / META_FILE, lambda f: f.write(json.dumps(meta, indent=1).encode()))
        manifest = {MODEL_FILE: sha256(tmp / MODEL_FILE), META_FILE: sha256(tmp / META_FILE)}
        _write_file(tmp / MANIFEST_FILE, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one (no COMPLETE) from a killed writer
        os.replace(tmp, final)
        _write_file(final / COMPLETE_FILE, lambda f: f.write(b"ok\n"))
        _fsync_dir(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**meta, "sha256": manifest[MODEL_FILE]}


def load_anchor(root: Path, model: torch.nn.Module) -> dict:
    """Load the run's KL anchor into `model`; its meta (with "sha256"). CheckpointError, in one
    line with what to do, when the run has none."""
    found = verified_anchor(root)
    if found is None:
        raise CheckpointError(f"{anchor_path(root)}: the run's KL anchor (its initial policy) is missing and "
                              f"{checkpoint_name(0)} is gone, so trainer.kl_coef > 0 has no reference: set "
                              "trainer.kl_coef=0, or start a new run directory from these weights "
                              "(trainer.init_checkpoint=...)")
    path, meta = found
    model.load_state_dict(torch.load(path / MODEL_FILE, map_location="cpu"))
    return meta
