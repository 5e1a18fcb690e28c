"""Policy losses, loss aggregation and the KL penalty: pure functions of tensors.

Shapes: ``logp``, ``old_logp``, ``ref_logp`` and ``mask`` are ``(B, T)`` over completion
tokens; ``advantages`` is ``(B,)``. A loss returns per-token values (to be minimised) and
a boolean ``(B, T)`` mask of tokens where clipping changed the objective (for
``clipfrac``). Aggregation turns per-token values into one scalar through weights that
are computed once over the *whole* batch, so gradient accumulation over micro-batches
gives exactly the full-batch gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PolicyLoss(NamedTuple):
    per_token: torch.Tensor  # (B, T)
    clipped: torch.Tensor  # (B, T) bool


def ppo_clip(logp, old_logp, advantages, mask, eps_low: float, eps_high: float) -> PolicyLoss:
    """Token-level PPO clip with separate bounds (DAPO's clip-higher when eps_high > eps_low).

    ``r_t = exp(logp_t - old_logp_t)``;
    ``L_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)``  (Schulman et al. 2017; Yu et al. 2025).
    """
    ratio = torch.exp(logp - old_logp)  # (B, T)
    adv = advantages[:, None]  # (B, 1)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return PolicyLoss(torch.maximum(pg_loss1, pg_loss2), (pg_loss2 > pg_loss1) & (mask > 0))


def gspo(logp, old_logp, advantages, mask, eps_low: float, eps_high: float) -> PolicyLoss:
    """GSPO: a sequence-level, length-normalised ratio, clipped per sequence (Zheng et al. 2025).

    ``s_i = exp(1/|y_i| sum_t (logp_t - old_logp_t))``;
    ``L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.
    Written in the paper's GSPO-token form, ``w_t = sg(s_i) * exp(logp_t - sg(logp_t))``: the value
    of every token's weight is ``s_i`` and, with sequence-mean aggregation, the gradient equals
    the sequence form's.
    """
    lengths = mask.sum(-1).clamp(min=1)  # (B,)
    log_s = ((logp - old_logp) * mask).sum(-1) / lengths  # (B,)
    weight = torch.exp(log_s.detach()[:, None] + logp - logp.detach())  # (B, T), value s_i
    adv = advantages[:, None]
    pg_loss1 = -adv * weight
    pg_loss2 = -adv * torch.clamp(weight, 1 - eps_low, 1 + eps_high)
    return PolicyLoss(torch.maximum(pg_loss1, pg_loss2), (pg_loss2 > pg_loss1) & (mask > 0))


def cispo(logp, old_logp, advantages, mask, eps_low: float, eps_high: float) -> PolicyLoss:
    """CISPO: clip the importance weight, stop its gradient, keep every token's gradient.

    ``L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * logp_t``  (MiniMax-M1, Chen et al. 2025).
    """
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach()
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & (mask > 0)
    return PolicyLoss(-weight * advantages[:, None] * logp, clipped)


LOSSES = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}


# --- aggregation: per-token weights over the whole batch ---------------------------


def token_mean(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """DAPO: every token in the batch counts equally, ``1 / sum(mask)``."""
    return mask / mask.sum().clamp(min=1)


def seq_mean_token_mean(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """GRPO paper: mean over tokens within a sequence, then over sequences."""
    lengths = mask.sum(-1, keepdim=True)  # (B, 1)
    sequences = (lengths > 0).sum().clamp(min=1)
    return mask / lengths.clamp(min=1) / sequences


def constant(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """Dr. GRPO: sum over tokens divided by a constant, ``sequences * max_completion_length``."""
    sequences = (mask.sum(-1) > 0).sum().clamp(min=1)
    return mask / (sequences * max_len)


AGGREGATIONS = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean, "constant": constant}


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (Schulman 2020).

    Non-negative, unbiased for the KL under samples from pi.
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1
