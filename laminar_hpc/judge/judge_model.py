"""A judge's model: scores a batch of requests at once, its weights frozen.

- `label`: one forward pass over the batch (right-padded: a causal model's logits at a
  sequence's last token do not see the padding after it); the probabilities of each label's
  first token there, normalised over the labels, weigh their scores.
- `classifier`: a Hugging Face `...ForSequenceClassification` checkpoint (transformers), one
  forward pass per batch (right-padded, with the attention mask); its head gives the score (one
  label: the scalar; two: the probability of the second).
- `generative`: each verdict decoded greedily, up to `max_new_tokens`, the whole batch at once on
  the model's KV cache (model/llama.py, as the rollouts' torch engine uses it; a role does not
  import another role's package); verdicts.read_verdict reads it.

    model = JudgeModel.build(cfg.task.reward.judge)
    model.score([("2+3=", "5", "5"), ...])   # [Scored(score, error, verdict), ...]

A request the model cannot take (a prompt longer than its max_seq_len) scores 0 with the reason;
it never fails the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from laminar_hpc.config.judge import label_tokens
from laminar_hpc.judge.verdicts import SHOWN, label_score, read_verdict, render

if TYPE_CHECKING:
    from laminar_hpc.config.judge import JudgeCfg


@dataclass(frozen=True)
class Scored:
    score: float
    error: str | None = None
    verdict: str = ""


def right_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows as one [len(rows), longest] tensor padded on the right, and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, :len(r)] = torch.tensor(r)
        mask[k, :len(r)] = 1
    return ids, mask


def judge_prompts(requests: list[tuple[str, str, str]], tok, cfg: JudgeCfg, max_len: int, room: int,
                  vocab: int | None = None) -> tuple[list[Scored | None], list[list[int]], list[int]]:
    """Each (problem, response, answer)'s judge prompt as token ids. Returns the answers so far (a
    0-score Scored saying why for a prompt that cannot be judged, None for one that can), the
    prompts that can, and their places in `requests`."""
    out: list[Scored | None] = []
    prompts: list[list[int]] = []
    where: list[int] = []
    for i, (problem, response, answer) in enumerate(requests):
        ids = tok.encode(render(cfg.template, problem=problem, response=response, answer=answer))
        if not ids or len(ids) + room > max_len:
            less = f" less {room} to answer" if room else ""
            out.append(Scored(0.0, f"the judge's prompt is {len(ids)} tokens, over its model.max_seq_len "
                                   f"({max_len}){less}; shorten task.reward.judge.template or raise the "
                                   "judge's max_seq_len"))
        elif vocab is not None and max(ids) >= vocab:
            out.append(Scored(0.0, f"token id {max(ids)} is outside the judge's vocabulary of {vocab}: "
                                   "its tokenizer is not the one task.reward.judge.model names"))
        else:
            out.append(None)
            prompts.append(ids)
            where.append(i)
    return out, prompts, where


class JudgeModelError(ValueError):
    """A judge that cannot score anything (a label with no token); the message names the key."""


def label_ids(cfg: JudgeCfg, tok) -> dict[str, int]:
    """A label judge's labels' first tokens with its tokenizer ({} for another kind);
    JudgeModelError naming the key when they cannot be told apart."""
    if cfg.kind != "label":
        return {}
    try:
        return label_tokens(cfg.labels, tok.encode)
    except ValueError as err:
        raise JudgeModelError(str(err)) from None


def check_classifier(path, kinds: list[str], num_labels: int) -> None:
    """JudgeModelError unless the checkpoint at `path` (its architectures and labels) is a reward
    model: a sequence classifier with one label (its scalar is the score) or two."""
    if not any(a.endswith("ForSequenceClassification") for a in kinds):
        raise JudgeModelError(f"task.reward.judge.model.hf_path: {path} holds {kinds or 'no architecture'}, not a "
                              "sequence classifier (...ForSequenceClassification); a causal LM judges with "
                              "kind: label or generative")
    if num_labels not in (1, 2):
        raise JudgeModelError(f"task.reward.judge.model.hf_path: {path} has {num_labels} labels; a reward model "
                              "has one (its scalar is the score) or two (the second's probability is)")


class JudgeModel:
    def __init__(self, cfg: JudgeCfg, tok, model: torch.nn.Module):
        self.cfg, self.tok, self.model = cfg, tok, model.eval().requires_grad_(False)
        self.max_len = model.args.max_seq_len
        self.label_ids = label_ids(cfg, tok)

    @classmethod
    def build(cls, cfg: JudgeCfg) -> "JudgeModel":
        from laminar_hpc.model.factory import build_model, build_tokenizer
        torch.set_num_threads(cfg.torch_threads)
        tok = build_tokenizer(cfg.model)
        if cfg.kind == "classifier":
            return ClassifierJudge(cfg, tok)
        torch.manual_seed(cfg.seed)  # a fresh model (no checkpoint): the same judge at every start
        model = build_model(cfg.model, tok, cfg.device)
        if cfg.init_checkpoint:
            model.load_state_dict(torch.load(cfg.init_checkpoint, map_location=cfg.device))
        return cls(cfg, tok, model)

    def score(self, requests: list[tuple[str, str, str]]) -> list[Scored]:
        """(problem, response, answer) each -> its Scored, in order."""
        room = 1 if self.cfg.kind == "label" else 2  # a generative verdict needs room for a token
        out, prompts, where = judge_prompts(requests, self.tok, self.cfg, self.max_len, room)
        if prompts:
            scored = self._labels(prompts) if self.cfg.kind == "label" else self._generate(prompts)
            for i, s in zip(where, scored):
                out[i] = s
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _labels(self, prompts: list[list[int]]) -> list[Scored]:
        batch, _ = right_padded(prompts, getattr(self.tok, "pad_id", 0) or 0)
        logits = self.model(batch.to(self.cfg.device))
        last = torch.tensor([len(p) - 1 for p in prompts])
        probs = torch.softmax(logits[torch.arange(len(prompts)), last].float(), dim=-1).cpu()
        names = list(self.label_ids)
        ids = torch.tensor([self.label_ids[n] for n in names])
        out = []
        for row in range(len(prompts)):
            p = probs[row, ids].tolist()
            out.append(Scored(label_score(dict(zip(names, p)), self.cfg.labels),
                              verdict=" ".join(f"{n.strip()}:{v:.3f}" for n, v in zip(names, p))))
        return out

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]]) -> list[Scored]:
        """Greedy verdicts for the whole batch at once, on the model's KV cache (model/llama.py):
        right-padded prefill, then one token per sequence per step; a sequence's padding lies past
        its own position, which the cache's mask hides."""
        from laminar_hpc.model.llama import KVCache
        n, eos, dev = len(prompts), self.tok.eos_id, self.cfg.device
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        width = int(lens.max())
        batch = right_padded(prompts, 0)[0].to(dev)
        dtype = next(self.model.parameters()).dtype
        cache = KVCache(self.model.args, n, dtype=dtype, device=dev)
        positions = torch.arange(width, device=dev).expand(n, width)
        logits = self.model(batch, cache=cache, positions=positions, key_len=width)
        nxt = logits[torch.arange(n), lens - 1].argmax(-1)
        pos = lens.clone()
        out_ids: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        for _ in range(self.cfg.max_new_tokens):
            for row in range(n):
                if not done[row]:
                    tok = int(nxt[row])
                    if tok == eos:
                        done[row] = True
                    else:
                        out_ids[row].append(tok)
                        done[row] = int(pos[row]) + 1 >= self.max_len  # no room for another token
            if all(done):
                break
            logits = self.model(nxt.unsqueeze(1), cache=cache, positions=pos.unsqueeze(1), key_len=int(pos.max()) + 1)
            nxt = logits[:, -1].argmax(-1)
            pos = pos + 1
        out = []
        for ids in out_ids:
            text = self.tok.decode(ids)
            score, why = read_verdict(text, self.cfg)
            out.append(Scored(score, why, text[:SHOWN]))
        return out


class ClassifierJudge:
    """A discriminative reward model: a transformers `...ForSequenceClassification` checkpoint."""

    def __init__(self, cfg: JudgeCfg, tok):
        from transformers import AutoConfig, AutoModelForSequenceClassification
        path = cfg.model.hf_path
        conf = AutoConfig.from_pretrained(path)
        check_classifier(path, list(conf.architectures or []), conf.num_labels)
        self.cfg, self.tok = cfg, tok
        dtype = getattr(torch, cfg.model.dtype)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(cfg.device).eval()
        self.model.requires_grad_(False)
        self.pad = getattr(tok, "pad_id", None) or 0
        if self.model.config.pad_token_id is None:  # how it finds each row's last token in a padded batch
            self.model.config.pad_token_id = self.pad
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 0) or cfg.model.max_seq_len)
        self.vocab = int(self.model.config.vocab_size)

    @torch.inference_mode()
    def score(self, requests: list[tuple[str, str, str]]) -> list[Scored]:
        out, rows, where = judge_prompts(requests, self.tok, self.cfg, self.max_len, 0, vocab=self.vocab)
        if rows:
            ids, mask = right_padded(rows, self.pad)
            logits = self.model(input_ids=ids.to(self.cfg.device), attention_mask=mask.to(self.cfg.device)).logits.float()
            heads = logits[:, 0] if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)[:, 1]
            for i, value in zip(where, heads.cpu().tolist()):
                out[i] = Scored(float(value), verdict=f"{value:.4f}")
        return out  # type: ignore[return-value]
