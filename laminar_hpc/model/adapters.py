"""Low-rank adapters (`model.lora`): the base every role builds, the byte layout of an adapter
version, the trainer's PEFT model and the rollout engine's adapter bank.

A version is the adapters' A and B tensors alone, named as PEFT saves them
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so the relays move megabytes
where full weights are gigabytes. Every role builds the frozen base itself, from `model.*` and
the campaign's seed (`build_base`), and an adapter version only fits the base it was trained on:
the layout's digest holds the base's identity (`base_identity`: a hash of its weights), so a
rollout whose base differs refuses the version by the same digest check as any other layout.

    base = build_base(cfg, tok, device="cpu")            # the same weights in every role
    layout = AdapterLayout.of(base, cfg.model.lora, "float32")
    # trainer: PEFT's LoRA layers (freeze the base, train A and B)
    policy = peft_policy(base, cfg.model.lora)
    layout.pack(policy, buf)
    # rollout engine: every decoder linear gets a bank of `slots` adapter versions; each batch row
    # picks its own (one batched product for the whole batch, not one pass per version)
    bank = AdapterBank.attach(base, cfg.model.lora, slots=2)
    layout.unpack(buf, bank.slot(0))
    bank.rows = torch.tensor([0, 1, 0])                  # batch row -> slot, set before each forward

The engine's mixed-version product is the gathered form of the per-request LoRA kernels of
S-LoRA / Punica (Sheng et al. 2023, Chen et al. 2023): A and B gathered per row, two batched
matrix products. A batch whose rows share one version takes two plain matrix products.
"""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xxhash
from torch import nn

from laminar_hpc.model.weights import DTYPES, TensorSpec, WeightLayout, copy_tensor
from laminar_hpc.transport.weight_store import Checksummer

if TYPE_CHECKING:
    from laminar_hpc.config.model_cfg import LoraCfg
    from laminar_hpc.config.schema import Config
    from laminar_hpc.model.llama import Transformer
    from laminar_hpc.model.tokenizer import Tokenizer

ADAPTER = "default"  # the name PEFT gives the one adapter it trains (in its parameters' names)
PEFT_PREFIX = "base_model.model."  # what PEFT puts before the base's module names


def build_base(cfg: Config, tok: Tokenizer, device: str = "cpu") -> Transformer:
    """The frozen base of an adapter run, the same in every role: `model.hf_path`'s weights, or a
    fresh model drawn from the campaign's seed (as the trainer draws its initial weights); then
    `trainer.init_checkpoint`'s weights where set (a full model's state dict, e.g. a warm-up's)."""
    from laminar_hpc.model.factory import build_model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        base = build_model(cfg.model, tok, device)
    path = cfg.trainer.init_checkpoint
    if path:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if any(".lora_" in k for k in state):
            raise ValueError(f"trainer.init_checkpoint {path}: an adapter's state, not a full model's; a base is "
                             "full weights (export an adapter run with laminar export-hf and set model.hf_path)")
        try:
            base.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"trainer.init_checkpoint {path}: not a model of this model.* shape "
                             f"({' '.join(str(err).split())[:160]})") from None
    return base


def base_identity(model: nn.Module) -> str:
    """A hash of the base's names, shapes and weights (read as float32, which every dtype of a
    base converts to exactly): what makes an adapter version fit one base only."""
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}{tuple(p.shape)}".encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def hf_base_identity(cfg: Config, args) -> str:
    """`base_identity` of the base `build_base` would build from `model.hf_path` (a directory of
    safetensors), read tensor by tensor without building it: a vLLM rollout loads the base itself
    and checks adapter versions against this. Each tensor is cast as `build_base` casts it
    (float32, then `model.dtype`)."""
    from safetensors import safe_open

    from laminar_hpc.model.hf import resolve_hf_path
    from laminar_hpc.model.llama import Transformer
    where: dict[str, Path] = {}
    for f in sorted(resolve_hf_path(cfg.model.hf_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))
    with torch.device("meta"):
        shapes = Transformer(args)
    dtype = getattr(torch, cfg.model.dtype)
    h = xxhash.xxh3_128()
    for name, p in shapes.named_parameters():
        if name not in where:
            raise ValueError(f"model.hf_path {cfg.model.hf_path}: no tensor {name} in its safetensors files")
        with safe_open(str(where[name]), framework="pt") as st:
            t = st.get_tensor(name).to(torch.float32).to(dtype).float()
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def target_paths(model: Transformer, lora: LoraCfg) -> list[str]:
    """The module path of every linear layer that gets an adapter, in the model's order."""
    wanted = set(lora.target_modules)
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in wanted
            and name.startswith("model.layers.")]


def _saved(path: str, part: str) -> str:
    return f"{PEFT_PREFIX}{path}.{part}.weight"


@dataclass(frozen=True)
class AdapterLayout:
    """The byte layout of one adapter version (a `model.layout.PublishedLayout`): the A and B
    tensors of every target in the base's order, under PEFT's saved names, 64-byte aligned."""
    flat: WeightLayout
    base: str  # base_identity of the base it fits
    rank: int
    alpha: float

    @classmethod
    def of(cls, base: Transformer, lora: LoraCfg, dtype: str, identity: str | None = None) -> "AdapterLayout":
        if dtype not in DTYPES:
            raise ValueError(f"weight dtype '{dtype}' is not supported; allowed: {', '.join(DTYPES)}")
        item = torch.empty((), dtype=DTYPES[dtype]).element_size()
        specs, offset = [], 0
        for path in target_paths(base, lora):
            lin = base.get_submodule(path)
            for part, shape in (("lora_A", (lora.rank, lin.in_features)), ("lora_B", (lin.out_features, lora.rank))):
                n = shape[0] * shape[1] * item
                specs.append(TensorSpec(_saved(path, part), shape, offset, n))
                offset += (n + 63) // 64 * 64
        return cls(WeightLayout(dtype, tuple(specs), offset), identity or base_identity(base), lora.rank, lora.alpha)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def digest(self) -> str:
        desc = json.dumps([self.flat.digest, self.base, self.rank, self.alpha])
        return hashlib.sha256(desc.encode()).hexdigest()[:16]

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return self.flat.specs

    @property
    def dtype(self) -> str:
        return self.flat.dtype

    def views(self, buf: memoryview) -> dict[str, torch.Tensor]:
        return self.flat.views(buf)

    @torch.no_grad()
    def pack(self, policy: nn.Module, buf: memoryview) -> None:
        """buf <- the trained adapter of a PEFT model (`peft_policy`)."""
        params = dict(policy.named_parameters())
        for name, view in self.views(buf).items():
            copy_tensor(view, params[live_name(name)].detach())

    @torch.no_grad()
    def unpack(self, buf: memoryview, dst: dict[str, torch.Tensor], *, checksum: bool = False) -> int | None:
        """Copy a version into `dst` (saved name -> tensor: `AdapterBank.slot`, or a PEFT model's
        adapter through `peft_tensors`); with `checksum`, the buffer's checksum (a version is
        megabytes: hashed in one pass before the copy)."""
        value = None
        if checksum:
            hasher = Checksummer()
            hasher.update(buf[:self.nbytes])
            if len(buf) > self.nbytes:
                hasher.update(buf[self.nbytes:])
            value = hasher.value()
        for name, view in self.views(buf).items():
            copy_tensor(dst[name], view)
        return value


def live_name(saved: str) -> str:
    """A saved adapter tensor's name in the PEFT model that trains it (PEFT names the adapter)."""
    head, part, tail = saved.rpartition(".lora_")
    kind, _, rest = tail.partition(".")
    return f"{head}.lora_{kind}.{ADAPTER}.{rest}"


def peft_policy(base: Transformer, lora: LoraCfg) -> nn.Module:
    """The trainer's policy: PEFT's LoRA layers on `base` (frozen), B at zero so that the policy
    starts as the base."""
    from peft import get_peft_model
    return get_peft_model(base, peft_config(lora))


def peft_config(lora: LoraCfg, base_model: str | None = None):
    from peft import LoraConfig
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none", base_model_name_or_path=base_model)


def peft_tensors(policy: nn.Module, layout: AdapterLayout) -> dict[str, torch.Tensor]:
    """The PEFT model's adapter tensors under their saved names (what `layout.unpack` fills)."""
    params = dict(policy.named_parameters())
    return {s.name: params[live_name(s.name)].data for s in layout.specs}


def saved_name(live: str) -> str:
    """A PEFT model's adapter tensor name as PEFT saves it (without the adapter's name)."""
    return live.replace(f".{ADAPTER}.", ".")


def write_peft_adapter(out: Path, state: dict[str, torch.Tensor], lora: LoraCfg,
                       base_model: str | None = None) -> dict[str, str]:
    """Write `state` (an `AdapterState`'s tensors) as PEFT saves an adapter: adapter_config.json
    and adapter_model.safetensors in `out`, which PEFT (`PeftModel.from_pretrained`) and vLLM
    (`LoRARequest`) load. Returns {file name: sha256}."""
    from safetensors.torch import save_file

    from laminar_hpc.checkpoint_format import sha256
    out.mkdir(parents=True, exist_ok=True)
    save_file({saved_name(k): v.detach().cpu().contiguous() for k, v in state.items()},
              str(out / "adapter_model.safetensors"))
    peft_config(lora, base_model).save_pretrained(str(out))
    return {f.name: sha256(f) for f in sorted(out.iterdir()) if f.is_file()}


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights as a plain Transformer names them: a PEFT policy's adapters merged into a
    copy of its base (the policy itself is left as it is)."""
    if not hasattr(model, "peft_config"):
        return model.state_dict()
    return copy.deepcopy(model).merge_and_unload().state_dict()


class AdapterState:
    """What a checkpoint of an adapter run holds of the model: the trainable adapter tensors
    (under PEFT's live names), not the frozen base every role rebuilds. Has the two methods the
    checkpoint code calls on a module (`state_dict`, `load_state_dict`)."""

    def __init__(self, policy: nn.Module, names: list[str] | None = None):
        # `names`: the trainable tensors' (a frozen copy of the policy, the KL reference, names the policy's)
        self.policy = policy
        self.names = names if names is not None else [n for n, p in policy.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, torch.Tensor]:
        params = dict(self.policy.named_parameters())
        return {n: params[n].detach() for n in self.names}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if set(state) != set(mine):
            missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
            raise RuntimeError("Error(s) in loading the adapter state:\n"
                               f"not an adapter of this model.lora (missing {missing[:2]}, unexpected {extra[:2]})")
        with torch.no_grad():
            for name, t in state.items():
                if tuple(t.shape) != tuple(mine[name].shape):
                    raise RuntimeError("Error(s) in loading the adapter state:\n"
                                       f"{name}: shape {tuple(t.shape)}, this model.lora has {tuple(mine[name].shape)}")
                mine[name].copy_(t)


class AdapterBank:
    """The rollout engine's adapters: every target linear layer of the base replaced by a
    `BankedLinear` holding `slots` adapter versions; `rows` (batch row -> slot) picks each
    sequence's version for the next forward."""

    def __init__(self, layers: dict[str, "BankedLinear"], slots: int):
        self.layers, self.slots = layers, slots
        self._rows: torch.Tensor | None = None
        self.one_slot: int | None = None  # every row's slot when they share one (read by every layer)
        for layer in layers.values():
            layer.bank = self

    @property
    def rows(self) -> torch.Tensor | None:
        return self._rows

    @rows.setter
    def rows(self, rows: torch.Tensor | None) -> None:
        # whether the batch holds one version is decided here, once per forward, not in each layer
        self._rows = rows
        self.one_slot = int(rows[0]) if rows is not None and rows.numel() and bool((rows == rows[0]).all()) \
            else None

    @classmethod
    def attach(cls, base: Transformer, lora: LoraCfg, slots: int) -> "AdapterBank":
        layers = {}
        for path in target_paths(base, lora):
            parent, _, child = path.rpartition(".")
            banked = BankedLinear(base.get_submodule(path), lora.rank, lora.alpha / lora.rank, slots)
            setattr(base.get_submodule(parent), child, banked)
            layers[path] = banked
        return cls(layers, slots)

    def slot(self, slot: int) -> dict[str, torch.Tensor]:
        """Saved name -> the tensors of slot `slot` (what `AdapterLayout.unpack` fills)."""
        out = {}
        for path, layer in self.layers.items():
            out[_saved(path, "lora_A")] = layer.lora_A[slot]
            out[_saved(path, "lora_B")] = layer.lora_B[slot]
        return out


class BankedLinear(nn.Module):
    """A frozen linear layer plus `slots` low-rank adapters: y = W x + scale * B[s] A[s] x, with
    s the slot of the row's sequence (`AdapterBank.rows`). A slot never loaded is zero: the base."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, slots: int):
        super().__init__()
        self.base, self.scale = base, scale
        w = base.weight
        self.register_buffer("lora_A", torch.zeros(slots, rank, base.in_features, dtype=w.dtype, device=w.device))
        self.register_buffer("lora_B", torch.zeros(slots, base.out_features, rank, dtype=w.dtype, device=w.device))
        self.bank: AdapterBank | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.bank.rows if self.bank is not None else None
        if rows is None:
            return y
        s = self.bank.one_slot
        if s is not None:  # one version for the whole batch
            return y + self.scale * ((x @ self.lora_A[s].T) @ self.lora_B[s].T)
        a, b = self.lora_A[rows], self.lora_B[rows]  # [batch, rank, in], [batch, out, rank]
        return y + self.scale * torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
