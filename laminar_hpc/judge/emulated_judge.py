"""An emulated judge (`task.reward.judge.kind: emulated`): no model, the emulation section's cost.

For benchmarks on emulated engines, where the rollouts' compute is the cost model's
(emulation/cost.py) and nothing reads the tokens: a batch of requests takes what a judge of
`emulation.judge_cost_ratio` times the policy's cost would, the prefill of every judge prompt
(its tokens with the campaign's tokenizer, BOS included) plus `emulation.judge_verdict_tokens` decode steps
of the batch, slept at `emulation.time_scale`, and each response scores as the synthetic task's
rule does (tasks/rewards/scorer.coin_flip: 0 or 1 from its text's CRC-32). The simulator
charges the same cost (sim/judges.py), so a run calibrates it.

    judge = EmulatedJudge(cfg.task.reward.judge, cfg)      # judge/server.py builds it
    judge.score([(problem, response, answer), ...])       # [Scored(0.0 or 1.0), ...], after the cost
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from laminar_hpc.emulation.cost import Clock, CostModel
from laminar_hpc.judge.judge_model import Scored
from laminar_hpc.judge.verdicts import render

if TYPE_CHECKING:
    from laminar_hpc.config import Config
    from laminar_hpc.config.judge import JudgeCfg


class EmulatedJudge:
    def __init__(self, cfg: "JudgeCfg", campaign: "Config", clock: Clock | None = None):
        from laminar_hpc.model.factory import build_tokenizer
        emu = campaign.emulation
        self.cfg, self.cost = cfg, CostModel(emu)
        self.ratio, self.verdict_tokens = emu.judge_cost_ratio, emu.judge_verdict_tokens
        self.tok = build_tokenizer(campaign.model)  # the policy's: what the prompt's tokens would be
        self.clock = clock or Clock(emu.time_scale if emu.time_scale > 0 else 1.0)

    def batch_s(self, prompt_tokens: list[int]) -> float:
        """Emulated seconds to score a batch of judge prompts of these lengths (sim/judges.score_s)."""
        return self.cost.judge_batch_s(sum(prompt_tokens), len(prompt_tokens), self.ratio, self.verdict_tokens)

    def score(self, requests: list[tuple[str, str, str]]) -> list[Scored]:
        lengths = [1 + len(self.tok.encode(render(self.cfg.template, problem=p, response=r, answer=a)))
                   for p, r, a in requests]  # (1 +: its BOS, as the model's prompt would begin)
        self.clock.spend(self.batch_s(lengths))
        # the synthetic task's rule (tasks/rewards/scorer.coin_flip), so that groups have variance
        return [Scored(float(zlib.crc32(r.encode()) % 2), verdict="emulated") for _, r, _ in requests]
