"""Tokenizers behind one small protocol.

`CharTokenizer` covers the built-in tasks and small CPU models (one token per printable ASCII
character); HF tokenizers for real checkpoints (`model/hf.py: HFTokenizer`) plug in behind the
same protocol. `bos_id` is None for a tokenizer whose model starts prompts without a BOS token
(SmolLM2, Qwen2): `tasks/prompts.encode_prompt` then prepends nothing.

Chat tasks (`Problem.chat`) are rendered by the tokenizer's own chat template: a tokenizer that
has one offers `chat_prompt(messages) -> str`; `hf_chat_prompt` is that method for a transformers
tokenizer (its `apply_chat_template`, ending with the assistant's generation prompt). The
character tokenizer has no chat template: chat tasks need `model.tokenizer: hf` (the start check
says so in one line).

    tok = CharTokenizer()
    ids = tok.encode("12+34=")          # no BOS/EOS added
    tok.decode(ids) == "12+34="
    hf_chat_prompt(hf_tok, [{"role": "user", "content": "What is 2 + 3?"}])
    # SmolLM2: '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\n'
    #          '<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n'
"""
from __future__ import annotations

import string
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    # optional: `chat_prompt(messages: list[dict[str, str]]) -> str`, the messages ({"role",
    # "content"}) in the model's chat template up to where the assistant's answer starts


def hf_chat_prompt(hf_tokenizer, messages: list[dict[str, str]], source: str = "the tokenizer") -> str:
    """`messages` ([{"role": "system"|"user"|"assistant", "content": ...}]) rendered as text by a
    transformers tokenizer's own chat template, ending with the generation prompt. The template's
    special tokens stay in the text as written (`<|im_start|>`); a tokenizer that maps special
    tokens written in text to their ids (`HFTokenizer.encode`) then gives exactly the ids of
    `apply_chat_template(messages, add_generation_prompt=True)`."""
    if not getattr(hf_tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {source} has no chat template; set model.hf_tokenizer to one that has "
                         "(e.g. the -Instruct checkpoint's)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["content"], str):
            raise ValueError(f"chat message {i} ({m!r}): expected {{'role': ..., 'content': <text>}}")
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise ValueError(f"{source}: the chat template rendered {type(text).__name__}, not text")
    return text


class CharTokenizer:
    """PAD, BOS, EOS, UNK, newline, then the 95 printable ASCII characters."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

    def __init__(self) -> None:
        chars = "\n" + "".join(c for c in string.printable if c.isprintable())
        self._chars = chars
        self._index = {c: i + len(self.SPECIALS) for i, c in enumerate(chars)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(self.SPECIALS))
        self.vocab_size = len(self.SPECIALS) + len(chars)

    def encode(self, text: str) -> list[int]:
        return [self._index.get(c, self.unk_id) for c in text]

    def decode(self, ids: list[int]) -> str:
        n = len(self.SPECIALS)
        return "".join(self._chars[i - n] for i in ids if i >= n)
