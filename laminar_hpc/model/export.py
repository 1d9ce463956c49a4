"""A weight version of a run as a Hugging Face directory (`laminar export-hf`).

    done = export_run(cfg, RunDir(run_dir, shm_dir=cfg.relay.shm_dir), step=None, live=False)
    print(done.out, done.label, done.parameters)

The version is a checkpoint (the newest that verifies, or the one of `step`) or, with `live`,
the newest version in the running trainer's hand-off store on this node. With adapters
(`model.lora`) the directory holds the policy merged into its base, and `adapter/` the adapter
alone in PEFT's format. Errors are
`CheckpointError` (no such version, a damaged or foreign one) or `HFCheckpointError` (writing).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laminar_hpc.checkpoint_format import (ADAPTER_DIR, MODEL_FILE, CheckpointError, checkpoint_name, checkpoint_step, newest_verified,
                                           verify)
from laminar_hpc.config import Config, ConfigError
from laminar_hpc.config.backend_specs import trainer_backend
from laminar_hpc.config.schema import ModelCfg
from laminar_hpc.rundir import RunDir


@dataclass
class Exported:
    out: Path
    label: str  # step_<N>-v<version>, or version_<N> for a live one
    parameters: int
    hf_tokenizer: bool  # False: the run uses the built-in char tokenizer, so no tokenizer files were written
    adapter: Path | None = None  # model.lora: the adapter directory (PEFT's format) beside the merged weights


def export_run(cfg: Config, rd: RunDir, *, step: int | None = None, live: bool = False, out: str | None = None,
               dtype: str | None = None) -> Exported:
    from laminar_hpc.model.hf import HFTokenizer, export_hf
    if not trainer_backend(cfg).has_model:
        raise ConfigError(f"{rd}: trainer.backend is {cfg.trainer.backend}, so its versions are cost-model bytes, not a "
                          "model; there is nothing to export")
    model, tok, model_cfg, label = live_version(cfg, rd) if live else checkpoint_version(cfg, rd, step)
    path = Path(out) if out else rd.hf_dir / label
    hf_tok = isinstance(tok, HFTokenizer)
    adapter = None
    if model_cfg.lora is not None:  # the adapter as PEFT saves it, then the policy merged into its base
        from laminar_hpc.model.adapters import AdapterState, write_peft_adapter
        adapter = path / ADAPTER_DIR
        state = {k: v.clone() for k, v in AdapterState(model).state_dict().items()}
        model = model.merge_and_unload()
    export_hf(model, path, source=model_cfg.hf_path, tokenizer=tok if hf_tok else None, dtype=dtype or model_cfg.dtype)
    if adapter is not None:
        write_peft_adapter(adapter, state, model_cfg.lora, model_cfg.hf_path)
    return Exported(path, label, sum(p.numel() for p in model.parameters()), hf_tok, adapter)


def _empty_model(cfg: Config, model_cfg: ModelCfg):
    """A model of `model_cfg`'s shape to load a version into, its tokenizer, and with adapters the
    identity of its base: the model is then the policy, PEFT's layers on the frozen base every
    role builds."""
    from laminar_hpc.model.factory import build_tokenizer, model_args
    from laminar_hpc.model.llama import Transformer
    tok = build_tokenizer(model_cfg)
    if model_cfg.lora is None:
        return Transformer(model_args(model_cfg, tok.vocab_size)), tok, None
    from laminar_hpc.model.adapters import base_identity, build_base, peft_policy
    base = build_base(cfg.model_copy(update={"model": model_cfg}), tok)
    identity = base_identity(base)
    return peft_policy(base, model_cfg.lora), tok, identity


def _load_state(model, state: dict, meta: dict, identity: str | None) -> None:
    """`state` (a checkpoint's model.pt) into `model`; an adapter only onto the base it was trained on."""
    if identity is None:
        model.load_state_dict(state)
        return
    from laminar_hpc.model.adapters import AdapterState
    had = (meta.get("adapter") or {}).get("base")
    if had != identity:
        raise RuntimeError(f"its adapter was trained on base {had}, the config builds base {identity}")
    AdapterState(model).load_state_dict(state)


def checkpoint_version(cfg: Config, rd: RunDir, step: int | None):
    """(model, tokenizer, model config, label) of a checkpoint: the newest that verifies, or `step`'s."""
    import torch
    root = rd.checkpoints_dir
    complete = rd.checkpoints()
    if not complete:
        raise CheckpointError(f"{root}: no complete checkpoint yet; wait for one (checkpoint.every_steps) or "
                              "export a live run's newest version with --live")
    if step is None:
        found = newest_verified(root)
        if found is None:
            raise CheckpointError(f"{root}: no checkpoint passes its checksums; pick one with --step")
        path, meta = found
    else:
        path = rd.checkpoint(step)
        if path not in complete:
            have = ", ".join(str(checkpoint_step(p)) for p in complete)
            raise CheckpointError(f"{root}: no complete checkpoint for step {step}; available steps: {have}")
        meta = verify(path)
    model_cfg = ModelCfg(**meta["model"]) if "model" in meta else cfg.model  # the shape it was written with
    model, tok, identity = _empty_model(cfg, model_cfg)
    try:
        _load_state(model, torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True), meta, identity)
    except (RuntimeError, OSError) as err:
        why = " ".join(str(err).splitlines()).strip()[:200]
        raise CheckpointError(f"{path / MODEL_FILE}: not this run's model ({why})") from None
    return model, tok, model_cfg, f"{checkpoint_name(meta['step'])}-v{meta['version']}"


def live_version(cfg: Config, rd: RunDir):
    """(model, tokenizer, model config, label) of the newest version in this node's hand-off store."""
    from laminar_hpc.model.weights import WeightLayout
    from laminar_hpc.transport.weight_store import WeightStore, digest_to_int
    path = rd.shm_path("handoff")
    if not path.exists():
        raise CheckpointError(f"{path}: no hand-off store, so the run is not live on this node; run this on the "
                              "trainer's node while it runs, or export a checkpoint (without --live)")
    model, tok, identity = _empty_model(cfg, cfg.model)
    if identity is None:
        layout, into = WeightLayout.from_model(model, cfg.trainer.publish_dtype), model
    else:
        from laminar_hpc.model.adapters import AdapterLayout, peft_tensors
        layout = AdapterLayout.of(model.get_base_model(), cfg.model.lora, cfg.trainer.publish_dtype, identity)
        into = peft_tensors(model, layout)
    store = WeightStore.open(path)
    try:
        newest = store.latest()
        if newest is not None and newest.digest != digest_to_int(layout.digest):
            raise CheckpointError(f"{path}: version {newest.version} has another weight layout than "
                                  f"{rd.config} describes")
        info = store.read(lambda view: layout.unpack(view, into))
    finally:
        store.close()
    if info is None:
        raise CheckpointError(f"{path}: no version published yet; try again after the trainer's first publish")
    return model, tok, cfg.model, f"version_{info.version:06d}"
