"""Tokenizers behind one small protocol.

`CharTokenizer` covers the built-in tasks and small CPU models (one token per printable ASCII
character); HF tokenizers for real checkpoints (`model/hf.py: HFTokenizer`) plug in behind the
same protocol. `bos_id` is None for a tokenizer whose model starts prompts without a BOS token
(SmolLM2, Qwen2): `tasks.encode_prompt` then prepends nothing.

    tok = CharTokenizer()
    ids = tok.encode("12+34=")          # no BOS/EOS added
    tok.decode(ids) == "12+34="
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
