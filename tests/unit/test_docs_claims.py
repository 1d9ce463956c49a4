"""Issue 28's out-of-date texts, each checked against the behaviour it describes: the computation
(which was right) and the words (which were not) must agree."""
from __future__ import annotations

import inspect
import re

import torch
from helpers import REPO

from laminar_hpc.config.schema import ControllerCfg
from laminar_hpc.policy.scheduling import keep_no_signal
from laminar_hpc.trainer.corrections import decoupled, prepare
from laminar_hpc.trainer.loss import agg_coef, group_advantages, policy_loss
from laminar_hpc.transport.security import auth_enabled


def test_auth_auto_authenticates_on_loopback_as_its_comment_says():
    assert auth_enabled(ControllerCfg(host="127.0.0.1", auth="auto"))  # every socket, loopback too
    src = (REPO / "laminar_hpc/config/schema.py").read_text()
    comment = src[:src.index('    auth: Literal["auto", "curve", "none"]')].rsplit("configured_host", 1)[1]
    assert "not a loopback" not in comment and "loopback too" in comment


def test_dr_grpo_is_trls_dr_grpo_not_verls_sum_norm():
    torch.manual_seed(0)
    loss_mat, max_len = torch.randn(3, 5), 8
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    ours = float((agg_coef(mask, "seq-mean-token-sum-norm", max_len) * loss_mat).sum())
    trl = float((loss_mat * mask).sum() / (loss_mat.size(0) * max_len))  # TRL's loss_type "dr_grpo"
    verl = float((loss_mat * mask).sum(-1).sum() / max_len)  # verl's agg_loss, loss_scale_factor = max_len
    assert abs(ours - trl) < 1e-6 and abs(ours - verl) > 1e-3  # verl's is 3x: not divided by the sequences
    row = next(line for line in (REPO / "docs/corrections.md").read_text().splitlines()
               if line.startswith("| `seq-mean-token-sum-norm`"))
    assert "TRL's `loss_type: dr_grpo`" in row and "is not the same" in row


def test_decoupled_masks_a_large_prox_mu_and_learning_md_says_so():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -3.0]])  # prox/mu = 1 and e^2 > rho
    t = decoupled(prepare(logp, mu, torch.ones(1, 1), torch.ones(1, 2)), rho=2.0, clip_eps=0.2, prox_logp=None)
    assert t.masked.tolist() == [[False, True]] and float(t.weight[0, 1]) == 0.0  # masked, not capped at 2
    text = " ".join((REPO / "docs/learning.md").read_text().split())
    assert "truncated weight prox/mu" not in text and "masked (weight 0" in text


def test_kept_no_signal_groups_dilute_the_gradient_as_the_docstring_says():
    def grad(rewards: list[list[float]]) -> torch.Tensor:
        adv = group_advantages(torch.tensor(rewards)).reshape(-1, 1)
        n = adv.shape[0]
        logp = torch.full((n, 3), -1.0, requires_grad=True)
        policy_loss(logp, logp.detach(), adv, torch.ones(n, 3), correction="aipo", rho=2.0).loss.backward()
        return logp.grad[:2]  # the group with signal
    alone, with_kept = grad([[1.0, 0.0]]), grad([[1.0, 0.0], [1.0, 1.0]])
    assert torch.allclose(with_kept, alone / 2)  # not "nothing": half the gradient (token-mean over both)
    doc = " ".join(inspect.getdoc(keep_no_signal).split())
    assert "add nothing to the gradient" not in doc and re.search(r"dilute", doc)
