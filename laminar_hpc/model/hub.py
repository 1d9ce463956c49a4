"""Hugging Face Hub names as checkpoints: `model.hf_path: org/name[@revision]` (and
`model.hf_tokenizer`), found in the Hugging Face cache through `huggingface_hub`.

    snapshot = hub_snapshot("HuggingFaceTB/SmolLM2-135M-Instruct")     # a directory in the cache
    snapshot = hub_snapshot("Qwen/Qwen2.5-0.5B-Instruct@main")

The cache is the one `huggingface_hub` uses, read from the environment at each call:
`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`. A snapshot already in the
cache is used without asking the network. Otherwise, unless `HF_HUB_OFFLINE` is set, the files a
checkpoint needs (config, safetensors, tokenizer and chat template; not every quantisation of a
GGUF repository) are downloaded into the cache. The launcher resolves the names before any role
starts, so the roles find them in the cache. Without network, or offline, and without the model
in the cache, the error is one line: where it looked and the command that downloads it.

A name is a Hub name only when no local file or directory has that path.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# org/name, each part as the Hub allows it, then an optional @revision (a branch, a tag or a commit)
HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
# what a checkpoint directory needs; a GGUF repository's files are named by the user, not fetched
PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*",
            "special_tokens_map.json", "vocab.*", "merges.txt", "chat_template.*", "*.jinja"]
_TRUE = ("1", "true", "yes", "on")


class HubError(ValueError):
    """A Hub name that cannot be resolved; one line with where it looked and what to run."""


def parse_hub_name(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` has the form of a Hub name, else None."""
    m = HUB_NAME.match(spec)
    if m is None or ".." in spec:
        return None
    return m.group("repo"), m.group("revision")


def cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it from the environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):  # the older name
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def download_command(repo: str, revision: str | None) -> str:
    return f"hf download {repo}" + (f" --revision {revision}" if revision else "")


def hub_snapshot(spec: str) -> Path:
    """The cache directory holding the snapshot `spec` (org/name[@revision]) names, downloaded first
    when it is not cached and the network may be used. Raises HubError."""
    parsed = parse_hub_name(spec)
    if parsed is None:
        raise HubError(f"'{spec}' is not a Hugging Face Hub name (org/name[@revision])")
    repo, revision = parsed
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise HubError(f"'{spec}': reading a Hub name needs huggingface_hub; pip install huggingface_hub") from None
    cache = cache_dir()
    where = f"looked in the Hugging Face cache {cache} (HF_HUB_CACHE / HF_HOME)"
    fetch = (f"download it with `{download_command(repo, revision)}` (the same HF_HOME / HF_HUB_CACHE), or give a "
             "local directory")
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=str(cache), local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except (OSError, ValueError) as err:
        raise HubError(f"'{spec}': the cached snapshot is unreadable ({' '.join(str(err).split())[:160]}); {where}; "
                       f"{fetch}") from None
    if offline():
        raise HubError(f"'{spec}' is neither a local path nor in the Hugging Face cache, and HF_HUB_OFFLINE forbids "
                       f"downloading it; {where}; {fetch}")
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=str(cache), allow_patterns=PATTERNS,
                                      endpoint=os.environ.get("HF_ENDPOINT") or None))
    except LocalEntryNotFoundError:  # no network: the Hub could not be reached
        raise HubError(f"'{spec}' is neither a local path nor in the Hugging Face cache, and the Hub cannot be "
                       f"reached (no network?); {where}; {fetch}") from None
    except HfHubHTTPError as err:  # a name or revision the Hub does not have, or a gated repository
        first = " ".join(str(err).split())[:200]
        raise HubError(f"'{spec}': the Hub refused it ({first}); check the name and revision, or log in with "
                       f"`hf auth login` for a gated model; {where}") from None
    except OSError as err:
        raise HubError(f"'{spec}': downloading it failed ({' '.join(str(err).split())[:200]}); {where}; {fetch}") \
            from None


__all__ = ["HubError", "cache_dir", "download_command", "hub_snapshot", "offline", "parse_hub_name"]
