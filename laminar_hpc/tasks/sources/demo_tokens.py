"""The supervised warm-up's sequences from demonstrations (`warmup.data`, tasks/sources/demos.py): each
conversation tokenized as a rollout tokenizes an episode, the loss on the assistant turns only.

- The prompt (system? and user messages) is rendered as the task renders its prompts: a chat in
  the model's own chat template when the task's prompts are chats (a verl or chat row, an arith
  task, `task.chat_template: true`: the HF tokenizer's `apply_chat_template`; without a system
  message of its own, `task.system_prompt` is put first, as for a dataset's chat rows), else BOS
  and the user message filled into `task.prompt_template`, the text the model reads (the
  character tokenizer has no chat template).
- Each assistant turn is its text and the end-of-turn token: loss mask 1.
- The tool results after a turn are the tokens an episode appends there (tasks/tools/episode.py's
  `observation_ids`: the chat template's tool turn, or `<tool_response>...</tool_response>`
  without one): loss mask 0, context.

The warm-up passes `edit` to put label noise into the assistant turns (trainer/warmup.py: their
digits replaced at random with probability `warmup.label_noise`, as the built-in warm-up does).

    rows = DemoRows(demos, tok, fmt, chat=True, template="{prompt}", max_len=128)
    seqs, masks, starts = rows.batch(step=1, size=64)
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Callable

from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.sources.demos import Demo, DemoError
from laminar_hpc.tasks.tools.episode import ToolResult, observation_ids

if TYPE_CHECKING:
    from laminar_hpc.config.env import EnvCfg


class DemoRows:
    """The demonstrations as token sequences, drawn in a new order each epoch (by `seed`)."""

    def __init__(self, demos: list[Demo], tok, fmt, *, chat: bool, template: str = "{prompt}", max_len: int,
                 system: str | None = None, seed: int = 0, key: str = "warmup.data", path: str = ""):
        self.demos, self.tok, self.fmt, self.chat, self.template = demos, tok, fmt, chat, template
        self.system = system  # task.system_prompt: a chat demonstration without a system message gets it
        self.max_len, self.seed = max_len, seed
        bad, self.prompts = [], []
        for d in demos:
            try:
                self.prompts.append(self._prompt(d))
            except ValueError as err:
                bad.append(f"{key}: {path} line {d.line}: {err}")
        if bad:
            raise DemoError(bad)
        self.too_long = sum(1 for p in self.prompts if len(p) >= max_len)  # skipped: no room to learn a token
        self.cut = 0  # sequences cut at max_len (the last drawn batch's)
        self._orders: dict[int, list[int]] = {}
        if self.too_long == len(demos):
            raise DemoError([f"{key}: {path}: every demonstration's prompt fills model.max_seq_len={max_len}; "
                             "raise model.max_seq_len or shorten the prompts"])

    def _prompt(self, d: Demo) -> list[int]:
        if self.chat:
            messages = d.prompt
            if self.system is not None and all(m["role"] != "system" for m in messages):
                messages = ({"role": "system", "content": self.system},) + messages  # as a dataset's chat rows
            return encode_prompt(self.tok, Problem(-1, "", "", chat=True, messages=messages))
        roles = [m["role"] for m in d.prompt]
        if roles != ["user"]:
            raise ValueError(f"messages hold {' + '.join(roles)} before the first assistant turn, and the task's "
                             "prompts are text (one user message, filled into task.prompt_template); write one user "
                             "message, or make the prompts chats (task.chat_template: true, model.tokenizer: hf)")
        bos = [] if self.tok.bos_id is None else [self.tok.bos_id]
        return bos + self.tok.encode(self.template.format(prompt=d.prompt[0]["content"]))

    def sequence(self, i: int, edit: Callable[[str], str] | None = None) -> tuple[list[int], list[int], int]:
        """(prompt + episode tokens, loss mask over them (1: a model token to learn), prompt length)
        of demonstration `i`, cut at max_len; `edit` changes each assistant turn's text first."""
        tok, prompt = self.tok, self.prompts[i]
        seq, mask = list(prompt), [0] * len(prompt)
        episode = self.demos[i].episode
        k = 0
        while k < len(episode):
            m = episode[k]
            if m["role"] == "assistant":
                ids = tok.encode(edit(m["content"]) if edit is not None else m["content"]) + [tok.eos_id]
                seq += ids
                mask += [1] * len(ids)
                k += 1
                continue
            results = []
            while k < len(episode) and episode[k]["role"] == "tool":
                results.append(ToolResult(episode[k]["content"]))
                k += 1
            ids = observation_ids(self.fmt, tok, results, ended_with_eos=True)
            seq += ids
            mask += [0] * len(ids)
        return seq[:self.max_len], mask[:self.max_len], len(prompt)

    def order(self, epoch: int) -> list[int]:
        """The usable demonstrations (a prompt that leaves room) in epoch `epoch`'s order."""
        if epoch not in self._orders:
            usable = [i for i, p in enumerate(self.prompts) if len(p) < self.max_len]
            random.Random(f"demos:{self.seed}:{epoch}").shuffle(usable)
            self._orders = {epoch: usable}  # the previous epoch's is no longer drawn from
        return self._orders[epoch]

    def batch(self, step: int, size: int, edit: Callable[[str], str] | None = None):
        """Warm-up step `step`'s (from 1) sequences, masks and prompt lengths: `size` demonstrations,
        each epoch every usable one once, in the epoch's order."""
        n = len(self.prompts) - self.too_long
        seqs, masks, starts = [], [], []
        self.cut = 0
        for j in range((step - 1) * size, step * size):
            i = self.order(j // n)[j % n]
            seq, mask, p0 = self.sequence(i, edit)
            self.cut += len(seq) == self.max_len
            seqs.append(seq)
            masks.append(mask)
            starts.append(p0)
        return seqs, masks, starts


def demo_rows(path: str, task, tok, env_cfg: EnvCfg | None, *, max_len: int, seed: int) -> DemoRows:
    """`warmup.data` loaded, checked (tasks/sources/demos.py) and tokenized for this run's task, tokenizer
    and env. DemoError (one line per bad row) on bad input."""
    from laminar_hpc.tasks.sources.demos import load_demos
    from laminar_hpc.tasks.tools.episode import HermesFormat
    from laminar_hpc.tasks.tools.loader import load_format
    demos = load_demos(path, env_cfg)
    fmt = load_format(env_cfg) if env_cfg is not None and env_cfg.enabled else HermesFormat()
    chat = bool(task.problem(0).chat)
    return DemoRows(demos, tok, fmt, chat=chat, template=getattr(task, "template", "{prompt}"), max_len=max_len,
                    system=getattr(task, "system_prompt", None), seed=seed, path=path)


__all__ = ["DemoRows", "demo_rows"]
