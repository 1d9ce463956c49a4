"""A campaign with low-rank adapters (`model.lora`, issue 49) through every real role: the trainer
publishes the adapter alone (its bytes, not the model's, cross the relay tier), each rollout
decodes under it on the base it built itself, a resume continues from the adapter checkpoint,
and `laminar export-hf` writes the merged model and an adapter directory that PEFT loads onto
the base with the same outputs.

    python -m pytest tests/integration/test_adapters_run.py -q
"""
from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO, laminar

from laminar_hpc.metrics.jsonl import read_steps
from laminar_hpc.metrics.trace import read_trace

TINY = str(REPO / "configs" / "tiny.yaml")
LORA = ("model.lora.rank=4", "model.lora.alpha=8")
pytestmark = pytest.mark.slow


def events(run_dir, pattern: str, ev: str) -> list[dict]:
    return [e for p in sorted((run_dir / "trace").glob(pattern)) for e in read_trace(p) if e["ev"] == ev]


def test_a_campaign_of_adapters_publishes_them_alone_resumes_and_exports(tmp_path):
    from laminar_hpc.config import load_config
    from laminar_hpc.model.adapters import AdapterLayout, build_base
    from laminar_hpc.model.factory import build_tokenizer
    run = tmp_path / "run"
    res = laminar("run", TINY, "--run-dir", str(run), *LORA, "trainer.total_steps=6", timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = load_config(TINY, list(LORA))
    tok = build_tokenizer(cfg.model)
    base = build_base(cfg, tok)
    adapter_bytes = AdapterLayout.of(base, cfg.model.lora, "float32").nbytes
    full_bytes = sum(p.numel() * 4 for p in base.parameters())
    published = events(run, "trainer-*.h5", "publish")
    assert published and {e["nbytes"] for e in published} == {adapter_bytes} and adapter_bytes < full_bytes / 4
    pulled = {e["version"] for e in events(run, "rollout-*.h5", "weights_pulled")}
    assert max(pulled) >= 5  # the rollouts took the adapters as they came
    assert json.loads((run / "summary.json").read_text())["outcome"] == "completed"

    res = laminar("run", TINY, "--run-dir", str(run), "--resume", *LORA, "trainer.total_steps=8", timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in read_steps(run / "metrics.jsonl")] == list(range(1, 9))
    assert "resumed from" in (run / "logs" / "trainer-0.log").read_text()

    out = tmp_path / "hf"
    res = laminar("export-hf", str(run), "-o", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the adapter in PEFT's format" in res.stdout
    # PEFT's own loader: the exported adapter on the base (as Hugging Face holds it) is the merged model
    transformers = pytest.importorskip("transformers")
    from peft import PeftModel

    from laminar_hpc.model.hf import export_hf
    export_hf(base, tmp_path / "base")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tuned = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")),
                                      str(out / "adapter"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    x = torch.randint(0, tok.vocab_size, (2, 10))
    with torch.no_grad():
        want, got, before = merged(x).logits, tuned(x).logits, plain(x).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(before, want, atol=1e-4)  # eight steps moved the adapter off zero


def versions_at_once(run_dir) -> tuple[int, int]:
    """Over the rollouts: the most versions one replica generated at once, and how many versions
    a replica loaded while trajectories of an older one were still generating there."""
    most = beside = 0
    for path in sorted((run_dir / "trace").glob("rollout-*.h5")):
        live: dict[str, int] = {}
        for e in read_trace(path):
            if e["ev"] == "traj_started":
                live[e["traj"]] = e["version"]
            elif e["ev"] == "traj_finished":
                live.pop(e["traj"], None)
            elif e["ev"] == "migrated_out":  # repack moved them on (full weights, pure laminar): not here now
                for t in e["traj_ids"]:
                    live.pop(t, None)
            elif e["ev"] == "weights_pulled" and live:
                beside += 1
            most = max(most, len(set(live.values())))
    return most, beside


def test_pure_laminar_with_adapters_loads_each_version_beside_the_running_ones_without_a_drain(tmp_path):
    """Pure laminar (one version per trajectory) drains a replica before each version with full
    weights; with adapters its engine holds several (up to versions_per_replica) and loads beside."""
    pure = ("rollout.refresh_in_flight=never", "controller.hold_for_newest_s=0")
    seen = {}
    for name, extra in (("full", ()), ("adapters", LORA)):
        run = tmp_path / name
        res = laminar("run", TINY, "--run-dir", str(run), *pure, *extra, timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        assert not events(run, "rollout-*.h5", "refreshed_in_flight")  # no trajectory changed version
        seen[name] = versions_at_once(run)
    assert seen["full"] == (1, 0)  # drained before every load
    from laminar_hpc.config import load_config
    from laminar_hpc.config.model_cfg import adapter_slots
    most, beside = seen["adapters"]
    # loads beside running trajectories are the guarantee (no drain); whether a new version's
    # trajectories start before the old ones end is timing (tiny's last a few tokens: on a busy
    # machine the next work can arrive after them; fresh-clone CI once saw 9 loads beside and no
    # overlap). Two versions decoding in one batch: tests/unit/test_adapters.py; 4 at once on the
    # long-tail workload: docs/adapters.md
    assert 1 <= most <= adapter_slots(load_config(TINY, [*pure, *LORA])) and beside >= 3, seen
