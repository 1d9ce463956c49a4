"""Adapter versions on vLLM (`model.lora` with `rollout.backend: vllm`): what `VllmEngine` asks
of vLLM to hold several adapter versions on one base and run each request under its own.

vLLM starts with the real base (`model.hf_path`, not dummy weights: the base never changes) and
LoRA enabled: `enable_lora=True`, `max_loras` = the versions a replica holds
(`config.model_cfg.adapter_slots`), `max_lora_rank` = vLLM's smallest allowed rank at or above
`model.lora.rank` (vllm/config/lora.py: MaxLoRARanks). Each version pulled from the relay is
written as a PEFT adapter directory (the format vLLM's LoRA loader reads) and registered with
`LLMEngine.add_lora(LoRARequest(name, id, path))`; a request is added with the `LoRARequest` of
its version; a version's slot taken by a newer one is removed (`remove_lora`) with its directory.
vLLM ids must be positive: a version's id is version + 1.

    slots = VllmAdapterSlots(llm, api.LoRARequest, root, cfg.model.lora, slots=3)
    request = slots.load(slot=1, version=7, tensors=layout.views(buf))
    llm.llm_engine.add_request(rid, prompt, params, lora_request=slots.requests[1])
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laminar_hpc.config.model_cfg import LoraCfg
    from laminar_hpc.config.schema import Config

# vllm/config/lora.py: MaxLoRARanks, the max_lora_rank values vLLM accepts
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_kwargs(cfg: Config) -> dict:
    """The `vllm.LLM` arguments of an adapter run: LoRA on, the versions a replica holds, the rank."""
    from laminar_hpc.config.model_cfg import adapter_slots
    rank = cfg.model.lora.rank
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"model.lora.rank={rank}: vLLM serves adapters of rank {VLLM_LORA_RANKS[-1]} at most")
    return {"enable_lora": True, "max_loras": adapter_slots(cfg), "max_lora_rank": fits[0]}


class VllmAdapterSlots:
    """The adapter version of each slot as vLLM holds it: a PEFT directory under `root` and its
    `LoRARequest` (None: the slot holds nothing yet)."""

    def __init__(self, llm, lora_request, root: Path, lora: LoraCfg, slots: int, base_model: str | None = None):
        self.llm, self.lora_request, self.root, self.lora = llm, lora_request, Path(root), lora
        self.base_model = base_model
        self.requests: list = [None] * slots

    def load(self, slot: int, version: int, tensors: dict) -> object:
        """Register `version` (saved name -> tensor, `AdapterLayout.views`) in `slot`, replacing what
        the slot held; its LoRARequest."""
        from laminar_hpc.model.adapters import write_peft_adapter
        old = self.requests[slot]
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
            self.requests[slot] = None
        out = self.root / f"v{version:08d}"
        shutil.rmtree(out, ignore_errors=True)  # a version loaded again (a restarted trainer's numbering)
        write_peft_adapter(out, tensors, self.lora, self.base_model)
        request = self.lora_request(lora_name=f"v{version}", lora_int_id=version + 1, lora_path=str(out))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of version {version} from {out}")
        self.requests[slot] = request
        return request

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
