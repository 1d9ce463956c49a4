"""Low-rank adapters (`model.lora`, issue 49): the config's refusals, the base every role builds
and its identity, the adapter version's layout on both sides of the weight path (PEFT's layers in
the trainer, the rollout engine's bank), several versions in one batch, the trainer backend's
optimizer, checkpoints (PEFT's format) and resume, and the export that PEFT and vLLM load.

    python -m pytest tests/unit/test_adapters.py -q
"""
from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO, train_groups

from laminar_hpc.checkpoint_format import ADAPTER_DIR, MANIFEST_FILE, CheckpointError
from laminar_hpc.config import ConfigError, load_config
from laminar_hpc.model.adapters import (
    AdapterBank, AdapterLayout, AdapterState, base_identity, build_base, peft_policy, peft_tensors,
)
from laminar_hpc.model.factory import build_tokenizer, model_args
from laminar_hpc.rollout.engine_interface import SeqRequest, VersionInFlightError
from laminar_hpc.rollout.torch_engine import TorchEngine
from laminar_hpc.trainer.backend_builders import build_backend

TINY = REPO / "configs" / "tiny.yaml"
LORA = ("model.lora.rank=4", "model.lora.alpha=8")


def config(*overrides: str):
    return load_config(TINY, [*LORA, *overrides])


def trained_policy(cfg, tok, seed: int):
    """A PEFT policy whose adapter is not zero (as after some training)."""
    policy = peft_policy(build_base(cfg, tok), cfg.model.lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return policy


def packed(layout, policy) -> memoryview:
    buf = memoryview(bytearray(layout.nbytes))
    layout.pack(policy, buf)
    return buf


@pytest.mark.parametrize("override, says", [
    ("model.lora.rank=0", "key 'model.lora.rank': an adapter needs rank >= 1"),
    ("model.lora.target_modules=[qproj]", "'qproj' is not a linear layer of this model; choose from q_proj"),
    ("model.lora.target_modules=[]", "key 'model.lora.target_modules': name at least one linear layer"),
    ("trainer.backend=megatron", "model.lora with trainer.backend='megatron': megatron-core ships no low-rank"),
])
def test_bad_adapter_settings_are_one_line_naming_the_field(override, says):
    with pytest.raises(ConfigError) as err:
        config(override)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_judge_trains_no_adapter():
    with pytest.raises(ConfigError, match=r"model.lora: a judge's weights are frozen"):
        load_config(REPO / "configs" / "tiny-judged.yaml", ["task.reward.judge.model.lora.rank=4"])


def test_every_role_builds_the_same_base_and_an_adapter_fits_only_its_own():
    cfg = config()
    tok = build_tokenizer(cfg.model)
    a, b = build_base(cfg, tok), build_base(cfg, tok)
    assert base_identity(a) == base_identity(b)
    other = build_base(config("seed=7"), tok)
    assert base_identity(other) != base_identity(a)
    lora = cfg.model.lora
    assert AdapterLayout.of(a, lora, "float32").digest == AdapterLayout.of(b, lora, "float32").digest
    assert AdapterLayout.of(other, lora, "float32").digest != AdapterLayout.of(a, lora, "float32").digest


def test_an_initial_checkpoint_is_the_base_of_every_role_and_an_adapters_state_is_refused(tmp_path):
    cfg = config()
    tok = build_tokenizer(cfg.model)
    warmed = build_base(config("seed=11"), tok)  # stands for a warm-up's weights
    torch.save(warmed.state_dict(), tmp_path / "warm.pt")
    base = build_base(config(f"trainer.init_checkpoint={tmp_path / 'warm.pt'}"), tok)
    assert base_identity(base) == base_identity(warmed) != base_identity(build_base(cfg, tok))
    torch.save(AdapterState(trained_policy(cfg, tok, 1)).state_dict(), tmp_path / "adapter.pt")
    with pytest.raises(ValueError, match=r"adapter.pt: an adapter's state, not a full model's"):
        build_base(config(f"trainer.init_checkpoint={tmp_path / 'adapter.pt'}"), tok)


def test_a_version_is_the_adapter_alone_and_the_engine_decodes_as_the_peft_policy():
    cfg = config()
    tok = build_tokenizer(cfg.model)
    policy = trained_policy(cfg, tok, seed=1)
    layout = AdapterLayout.of(build_base(cfg, tok), cfg.model.lora, "float32")
    args = model_args(cfg.model, tok.vocab_size)
    # A [rank, in] and B [out, rank] of 7 linear layers per decoder layer, float32
    per_layer = sum(4 * (4 * i + o * 4) for i, o in ((32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64),
                                                       (64, 32)))
    assert args.n_layers == 1 and sum(s.nbytes for s in layout.specs) == per_layer
    assert layout.nbytes < 0.25 * sum(p.numel() * 4 for p in build_base(cfg, tok).parameters())
    base = build_base(cfg, tok)
    rollout_layout = AdapterLayout.of(base, cfg.model.lora, "float32")
    bank = AdapterBank.attach(base, cfg.model.lora, slots=2)
    assert rollout_layout.digest == layout.digest
    rollout_layout.unpack(packed(layout, policy), bank.slot(1))
    x = torch.randint(0, tok.vocab_size, (3, 12))
    with torch.no_grad():
        bank.rows = torch.tensor([1, 1, 1])
        assert torch.allclose(base(x), policy(x), atol=1e-6)
        bank.rows = torch.tensor([0, 1, 0])  # slot 0 holds nothing yet: the base
        mixed = base(x)
        bank.rows = None
        plain = base(x)
    assert torch.allclose(mixed[1], policy(x)[1], atol=1e-6) and torch.equal(mixed[0], plain[0])
    assert not torch.allclose(plain[1], policy(x)[1], atol=1e-3)  # the adapter changes the output


def engine_with(cfg, tok, versions: list[tuple[int, memoryview]], layout) -> TorchEngine:
    base = build_base(cfg, tok)
    bank = AdapterBank.attach(base, cfg.model.lora, slots=2)
    engine = TorchEngine(model_args(cfg.model, tok.vocab_size), tok.eos_id, max_batch=4, model=base, adapters=bank)
    for v, buf in versions:
        engine.load_weights(v, buf, layout)
    return engine


def run_to_end(engine: TorchEngine) -> dict[str, tuple[list[int], list[float]]]:
    done = {}
    while engine.num_active():
        for out in engine.step():
            if out.finished:
                done[out.traj_id] = (out.request.tokens, out.request.logprobs)
    return done


def test_sequences_of_two_versions_decode_in_one_batch_each_under_its_own():
    cfg = config("model.max_seq_len=32")
    tok = build_tokenizer(cfg.model)
    layout = AdapterLayout.of(build_base(cfg, tok), cfg.model.lora, "float32")
    v1, v2 = packed(layout, trained_policy(cfg, tok, 1)), packed(layout, trained_policy(cfg, tok, 2))

    def request(name):
        return SeqRequest(name, [5, 6, 7, 8], max_new_tokens=10)
    mixed = engine_with(cfg, tok, [(1, v1)], layout)
    mixed.add([request("old")])
    mixed.step()
    mixed.load_weights(2, v2, layout)  # not in flight: "old" goes on under version 1, in its slot
    mixed.add([request("new")])
    got = run_to_end(mixed)
    full = engine_with(cfg, tok, [(1, v1)], layout)
    full.add([request("a")])
    full.load_weights(2, v2, layout)
    full.add([request("b")])
    with pytest.raises(VersionInFlightError, match=r"the 2 adapter slots hold versions \[1, 2\] of trajectories"):
        full.load_weights(3, v1, layout)  # both slots decode running sequences
    full.load_weights(3, v1, layout, in_flight=True)  # refresh in flight: every sequence moves to it
    assert {a.slot for a in full.active} == {full.slot} and full.version == 3
    alone1 = engine_with(cfg, tok, [(1, v1)], layout)
    alone1.add([request("old")])
    alone2 = engine_with(cfg, tok, [(2, v2)], layout)
    alone2.add([request("new")])
    want = {**run_to_end(alone1), **run_to_end(alone2)}
    for name in ("old", "new"):
        assert got[name][0] == want[name][0]
        assert got[name][1] == pytest.approx(want[name][1], abs=1e-5)
    assert got["old"][0] != got["new"][0]  # (the versions really differ)


def test_the_trainer_trains_and_publishes_the_adapter_alone(tmp_path):
    cfg = config("trainer.groups_per_step=2", "trainer.lr=0.05")
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    be = build_backend(cfg, tok, run_dir=tmp_path, ckpt_root=tmp_path / "checkpoints")
    frozen = {n: p.detach().clone() for n, p in be.model.named_parameters() if not p.requires_grad}
    trainable = [p for p in be.model.parameters() if p.requires_grad]
    assert frozen and all("lora_" not in n for n in frozen) and len(trainable) == 14
    before = packed(be.layout, be.weights()).tobytes()
    m = be.train_step(train_groups(0, n=2, vocab=tok.vocab_size), step=0, version=0)
    assert m["steps_skipped_nonfinite"] == 0
    # AdamW holds moments for the adapters alone; the base did not move; the version changed
    assert len(be.opt.state) == len(trainable) and all(p in be.opt.state for p in trainable)
    assert all(torch.equal(frozen[n], p) for n, p in be.model.named_parameters() if n in frozen)
    assert packed(be.layout, be.weights()).tobytes() != before
    assert be.layout.nbytes == sum(p.numel() * 4 for p in trainable)
    be.close()


def test_a_checkpoint_holds_the_adapter_in_peft_format_and_resumes_only_on_its_base(tmp_path):
    cfg = config("trainer.groups_per_step=2", "trainer.lr=0.05")
    tok = build_tokenizer(cfg.model)
    be = build_backend(cfg, tok, run_dir=tmp_path, ckpt_root=tmp_path / "checkpoints")
    be.train_step(train_groups(0, n=2, vocab=tok.vocab_size), step=0, version=0)
    be.save(1, 1, meta={"model": cfg.model.model_dump()}, ledger={"consumed": []})
    (done,) = be.saves_done(wait=True)
    assert "error" not in done, done
    path = tmp_path / "checkpoints" / "step_000001"
    files = json.loads((path / MANIFEST_FILE).read_text())
    assert {f"{ADAPTER_DIR}/adapter_config.json", f"{ADAPTER_DIR}/adapter_model.safetensors"} <= set(files)
    saved = torch.load(path / "model.pt")
    assert len(saved) == 14 and all(".lora_" in k for k in saved)  # the adapter, not the frozen base
    from peft import LoraConfig
    from safetensors.torch import load_file
    assert LoraConfig.from_pretrained(str(path / ADAPTER_DIR)).r == 4
    assert set(load_file(str(path / ADAPTER_DIR / "adapter_model.safetensors"))) == {s.name for s in be.layout.specs}
    want = packed(be.layout, be.weights()).tobytes()
    be.close()

    again = build_backend(cfg, tok, run_dir=tmp_path, ckpt_root=tmp_path / "checkpoints")
    assert again.resume()["step"] == 1 and packed(again.layout, again.weights()).tobytes() == want
    again.close()
    other = build_backend(config("trainer.groups_per_step=2", "seed=5"), tok, run_dir=tmp_path,
                          ckpt_root=tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=r"its adapter was trained on base \w+, this run builds base \w+"):
        other.resume()
    other.close()


def test_a_rollout_with_another_base_refuses_the_version_naming_it(tmp_path):
    from laminar_hpc.rollout.node import NodeWeights
    from laminar_hpc.transport.weight_store import WeightStore, digest_to_int
    cfg, tok = config(), None
    tok = build_tokenizer(cfg.model)
    trainer_layout = AdapterLayout.of(build_base(cfg, tok), cfg.model.lora, "float32")
    store = WeightStore.create(tmp_path / "relay", 2, trainer_layout.nbytes)
    slot, buf = store.begin(1)
    trainer_layout.pack(trained_policy(cfg, tok, 1), buf)
    store.commit(slot, 1, trainer_layout.nbytes, 0, digest_to_int(trainer_layout.digest))
    other = config("seed=3")
    base = build_base(other, tok)
    layout = AdapterLayout.of(base, other.model.lora, "float32")
    engine = TorchEngine(model_args(other.model, tok.vocab_size), tok.eos_id, max_batch=2, model=base,
                         adapters=AdapterBank.attach(base, other.model.lora, slots=2))
    weights = NodeWeights(tmp_path / "relay")
    assert weights.newest() == 1
    with pytest.raises(RuntimeError, match=rf"an adapter of another base than this rollout's \({layout.base}\)"):
        weights.pull(engine, layout, verify=False)
    del buf
    store.close()
    weights.store.close()


def test_the_emulated_engine_holds_adapter_versions_and_pays_their_stated_costs():
    """An emulated run with adapters moves the adapter's share of the bytes, loads a version in the
    adapter's time, holds `versions_per_replica` versions, each sequence under its own, and every
    decode step costs `adapter_decode_ms` more (Punica's figure, config/emulation.py)."""
    from laminar_hpc.config.model_cfg import adapter_slots
    from laminar_hpc.emulation.cost import CostModel
    from laminar_hpc.emulation.emulated_weights import EmulatedWeights, emulated_version_bytes
    from laminar_hpc.rollout.emulated_engine import EmulatedEngine
    plain = load_config(REPO / "configs" / "tiny-emulated.yaml", ["emulation.time_scale=0"])
    cfg = load_config(REPO / "configs" / "tiny-emulated.yaml", ["emulation.time_scale=0", *LORA,
                                                                 "model.lora.versions_per_replica=3"])
    e = cfg.emulation
    assert emulated_version_bytes(cfg) == int(e.weight_mb * 2**20 * e.adapter_weight_gb / e.nominal_weight_gb)
    assert emulated_version_bytes(plain) == int(e.weight_mb * 2**20) and adapter_slots(plain) == 0
    assert adapter_slots(cfg) == 3 and adapter_slots(load_config(TINY, list(LORA))) == max(
        2, load_config(TINY).controller.max_ahead_steps + 1)
    full, lora = CostModel(e), CostModel(e, adapters=True)
    assert lora.weight_load_s() == pytest.approx(e.adapter_weight_gb / e.pull_gbps)
    assert lora.decode_steps_s(8, 1000, 10) - full.decode_steps_s(8, 1000, 10) == pytest.approx(10 * e.adapter_decode_ms / 1e3)
    for steps in (1, 7, 40):  # the interrupted macro step's inverse agrees with the adapters' step cost
        assert lora.steps_within(8, 1000, lora.decode_steps_s(8, 1000, steps), 128) == steps

    layout = EmulatedWeights(emulated_version_bytes(cfg))
    engine = EmulatedEngine(e, seed=0, eos_id=2, vocab_size=50, max_batch=4, nbytes=layout.nbytes,
                            adapter_slots=adapter_slots(cfg))
    buf = memoryview(bytearray(layout.nbytes))
    for v in (0, 1, 2):  # each beside the sequences of the ones before
        assert engine.spare_version_slots() == 3 - v
        engine.load_weights(v, buf, layout)
        engine.add([SeqRequest(f"t{v}", [5, 6, 7], max_new_tokens=10**6)])
    assert sorted(engine.slot_version) == [0, 1, 2] and engine.spare_version_slots() == 0
    assert len({s.slot for s in engine.active}) == 3
    with pytest.raises(VersionInFlightError, match="the 3 adapter slots hold versions"):
        engine.load_weights(3, buf, layout)


def test_with_adapter_versions_pure_laminar_does_not_repack():
    """Repack empties draining replicas; with several adapter versions per replica none drains, and
    a move of a trajectory pinned to an older version would only bounce off the newer replicas."""
    from laminar_hpc.policy.modes import mode_plan
    pure = ("rollout.refresh_in_flight=never", "repack.enabled=true")
    assert mode_plan(load_config(TINY, list(pure))).repacks
    assert not mode_plan(config(*pure)).repacks


def test_a_campaign_with_tool_episodes_drains_instead_of_loading_beside():
    """A turn back from its tool is admitted under the engine's newest version: with tool episodes
    a replica must not hold trajectories of an older version beside it."""
    from types import SimpleNamespace

    from laminar_hpc.rollout.updates import ReplicaRefresh, build_updates
    pulls = []
    engine = SimpleNamespace(version=1, num_active=lambda: 3, max_batch=8, spare_version_slots=lambda: 2)
    host = SimpleNamespace(engine=engine, held=lambda: 3, pull=lambda: pulls.append(1))
    never = config("rollout.refresh_in_flight=never").rollout
    assert ReplicaRefresh(host, never).tick(newest=2) is False and pulls == [1]  # beside
    assert ReplicaRefresh(host, never, beside=False).tick(newest=2) is True and pulls == [1]  # drains
    tools = load_config(REPO / "configs" / "quickstart-tools.yaml", [*LORA, "rollout.refresh_in_flight=never"])
    assert tools.env.enabled and build_updates(tools, host).beside is False


def test_the_ideal_of_an_adapter_run_counts_the_adapters_decode_cost():
    from laminar_hpc.emulation.ideal import ideal_for_config
    plain = load_config(REPO / "configs" / "tiny-emulated.yaml")
    lora = load_config(REPO / "configs" / "tiny-emulated.yaml", list(LORA))
    e = plain.emulation
    assert ideal_for_config(plain).step_base_s == pytest.approx(e.decode_base_ms / 1e3)
    assert ideal_for_config(lora).step_base_s == pytest.approx((e.decode_base_ms + e.adapter_decode_ms) / 1e3)


def test_load_policy_merges_an_adapter_checkpoint_into_the_base_the_run_built(tmp_path):
    """trainer/checkpoint.load_policy (the bench's held-out evaluations): an adapter run's newest
    checkpoint, loaded on its base and merged, gives the trained policy's logits."""
    from laminar_hpc.model.adapters import AdapterState, build_base, peft_policy
    from laminar_hpc.trainer.checkpoint import load_policy, save_checkpoint
    cfg = config()
    tok = build_tokenizer(cfg.model)
    policy = peft_policy(build_base(cfg, tok), cfg.model.lora)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a trained adapter (B starts at zero)
    save_checkpoint(tmp_path, step=3, version=3, model=AdapterState(policy),
                    optimizer=torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad]), meta={}, keep=1)
    merged, meta = load_policy(cfg, tok, tmp_path)
    assert meta["step"] == 3 and not hasattr(merged, "peft_config")
    x = torch.randint(4, tok.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.allclose(merged(x), policy(x), atol=1e-5)
    assert load_policy(cfg, tok, tmp_path / "none")[1] is None
