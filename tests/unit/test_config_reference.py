"""The configuration reference (config/reference.py): every key of the schema has a meaning, the
generated docs/config.md is fresh, and `laminar config` prints resolved values with meanings."""
from __future__ import annotations

import subprocess
import sys

from helpers import REPO
from laminar_hpc.config.reference import keys, markdown, undocumented
from laminar_hpc.config.schema import Config
from laminar_hpc.config.section import PosInt, Section


class Synthetic(Section):
    documented: PosInt = 1  # a key with its meaning
    # a meaning written above the key
    above: bool = False
    bare: int = 0


def test_every_key_of_the_schema_has_a_meaning():
    assert undocumented(Config) == [], "add a comment (at the end of the field's line, or above it) to each"
    assert len(keys(Config)) > 200


def test_a_key_without_a_comment_is_found():
    got = {k: v.meaning for k, v in keys(Synthetic)}
    assert got == {"documented": "a key with its meaning", "above": "a meaning written above the key", "bare": ""}
    assert undocumented(Synthetic) == ["bare"]


def test_the_reference_page_is_fresh():
    assert (REPO / "docs" / "config.md").read_text() == markdown(), \
        "docs/config.md is stale: regenerate it with python -c 'from laminar_hpc.config.reference import " \
        "markdown; open(\"docs/config.md\", \"w\").write(markdown())'"


def test_types_name_their_items_and_required_keys_name_their_variant():
    # issue 47: pydantic's FieldInfo printed inside list types, task.path "required" for every task type,
    # and a constant's name where its value belongs
    from laminar_hpc.config.shards import ROLLOUT_NODES_PER_SHARD
    ref = dict(keys(Config))
    assert all("FieldInfo" not in k.type for k in ref.values())
    assert ref["task.weights"].type == "list[float] | None"
    assert ref["emulation.lengths.tools.calls"].type == "list[int]"
    assert ref["task.path"].default == "(required for task.type dataset, jsonl)"
    assert f"one per {ROLLOUT_NODES_PER_SHARD} rollout nodes" in ref["controller.shards"].meaning


def test_laminar_config_prints_resolved_keys_with_their_meaning():
    res = subprocess.run([sys.executable, "-m", "laminar_hpc.cli", "config", str(REPO / "configs" / "quickstart.yaml"),
                          "trainer.lr", "trainer.lr=1e-4", "relay"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "trainer.lr = 0.0001    # learning rate (AdamW)"
    assert [ln.split(" = ")[0] for ln in lines[1:]] == [k for k, _ in keys(Config) if k.startswith("relay.")]
