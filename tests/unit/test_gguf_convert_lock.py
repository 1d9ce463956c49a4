"""Two launchers converting one GGUF (model/gguf_convert.py): the second waits for the first's
lock instead of removing the entry the first is completing, and reads it when it is complete."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from laminar_hpc.model.gguf_cache import CacheError, cache_dir_for, private_cache_dir
from laminar_hpc.model.gguf_convert import convert_once

# another launcher: takes the entry's lock, says so, and on a line from us completes the entry
# (its manifest, written last) or not, then lets go
HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from laminar_hpc.model.gguf_cache import entry_lock, write_manifest
    out, gguf = Path(sys.argv[1]), Path(sys.argv[2])
    with entry_lock(out, 30):
        print("holding", flush=True)
        if sys.stdin.readline().strip() == "complete":
            write_manifest(out, gguf)
""")


@pytest.fixture
def half_made(tmp_path, monkeypatch):
    """A GGUF (never read here) and its cache entry as a converter leaves it between renaming the
    directory into place and writing its manifest."""
    monkeypatch.setenv("LAMINAR_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    private_cache_dir()
    out = cache_dir_for(gguf)
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"weights")
    return gguf, out


def hold(gguf, out):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(gguf)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_launcher_waits_for_the_one_converting_and_never_removes_its_entry(half_made):
    gguf, out = half_made
    holder = hold(gguf, out)
    try:
        said = []
        with pytest.raises(CacheError, match=r"another process has been converting this model for over 1s"):
            convert_once(str(gguf), say=said.append, wait_s=1.0)
        assert said == [] and (out / "model.safetensors").read_bytes() == b"weights"  # untouched
    finally:
        holder.communicate("leave\n", timeout=30)


def test_the_waiting_launcher_reads_the_entry_the_other_completed(half_made):
    gguf, out = half_made
    holder = hold(gguf, out)
    holder.stdin.write("complete\n")
    holder.stdin.flush()  # the holder writes the manifest, then lets go; we wait for its lock meanwhile
    said = []
    assert convert_once(str(gguf), say=said.append, wait_s=30) == out
    assert said == []  # read, not converted again
    assert holder.wait(timeout=30) == 0
