"""Policy losses, loss aggregation and the KL penalty: pure functions of tensors.

Shapes: ``logp``, ``old_logp``, ``ref_logp`` and ``mask`` are ``(B, T)`` over completion
tokens; ``advantages`` is ``(B,)`` (one per sequence) or ``(B, T)`` (one per token, as in
Tinker's ``Datum``). A loss returns per-token values (to be minimised) and
a boolean ``(B, T)`` mask of tokens where clipping changed the objective (for
``clipfrac``). Aggregation turns per-token values into one scalar through weights that
are computed once over the *whole* batch, so gradient accumulation over micro-batches
gives exactly the full-batch gradient.

Tinker's losses (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``) are the same
per-token values *summed* over tokens, with no normalisation: ``TINKER_LOSSES`` maps their names
to these functions, and the caller's per-token ``weights`` (1 where Tinker has none) do the sum.

Every ratio is built by ``log_ratio``: positions outside ``mask`` get a log-ratio of 0 (they never
enter ``exp``, so a garbage or ``-inf`` sampler logprob on a masked token cannot make ``inf * 0 =
NaN``) and the rest is clamped to ``+-LOGRATIO_CLAMP`` (``exp(20)`` is 4.9e8, finite in float32).
Inside the clamp the values and gradients are exactly those of ``exp(logp - old_logp)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


LOGRATIO_CLAMP = 20.0


class PolicyLoss(NamedTuple):
    per_token: torch.Tensor  # (B, T)
    clipped: torch.Tensor  # (B, T) bool


def log_ratio(logp, old_logp, mask, clamp: float = LOGRATIO_CLAMP) -> torch.Tensor:
    """``logp - old_logp`` on ``mask`` tokens, clamped to ``[-clamp, clamp]``; 0 elsewhere.  (B, T)"""
    return torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp)).clamp(-clamp, clamp)


def dual_clip_bound(per_token_loss, adv, dual_clip: float | None) -> torch.Tensor:
    """Dual-clip PPO (Ye et al. 2020): for ``A < 0`` the loss is at most ``-c * A``, so one token whose
    ratio exploded cannot dominate the batch; ``A >= 0`` is left alone. ``None`` = off."""
    if dual_clip is None:
        return per_token_loss
    bounded = torch.minimum(per_token_loss, -adv * dual_clip)
    return torch.where(adv < 0, bounded, per_token_loss)


def ppo_clip(logp, old_logp, advantages, mask, eps_low: float, eps_high: float, *,
             dual_clip: float | None = None) -> PolicyLoss:
    """Token-level PPO clip with separate bounds (DAPO's clip-higher when eps_high > eps_low).

    ``r_t = exp(logp_t - old_logp_t)``;
    ``L_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)``  (Schulman et al. 2017; Yu et al. 2025);
    with ``dual_clip = c`` and ``A < 0``: ``L_t = min(L_t, -c A)`` (Ye et al. 2020).
    """
    ratio = torch.exp(log_ratio(logp, old_logp, mask))  # (B, T)
    adv = per_token(advantages)  # (B, 1) or (B, T)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = dual_clip_bound(torch.maximum(pg_loss1, pg_loss2), adv, dual_clip)
    return PolicyLoss(loss, (pg_loss2 > pg_loss1) & (mask > 0))


def gspo(logp, old_logp, advantages, mask, eps_low: float, eps_high: float, *,
         dual_clip: float | None = None) -> PolicyLoss:
    """GSPO: a sequence-level, length-normalised ratio, clipped per sequence (Zheng et al. 2025).

    ``s_i = exp(1/|y_i| sum_t (logp_t - old_logp_t))``;
    ``L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.
    Written in the paper's GSPO-token form, ``w_t = sg(s_i) * exp(logp_t - sg(logp_t))``: the value
    of every token's weight is ``s_i`` and, with sequence-mean aggregation, the gradient equals
    the sequence form's. ``dual_clip`` bounds it as in ``ppo_clip``.
    """
    lengths = mask.sum(-1).clamp(min=1)  # (B,)
    log_s = (log_ratio(logp, old_logp, mask) * mask).sum(-1) / lengths  # (B,)
    weight = torch.exp(log_s.detach()[:, None] + logp - logp.detach())  # (B, T), value s_i (logp is finite)
    adv = per_token(advantages)
    pg_loss1 = -adv * weight
    pg_loss2 = -adv * torch.clamp(weight, 1 - eps_low, 1 + eps_high)
    loss = dual_clip_bound(torch.maximum(pg_loss1, pg_loss2), adv, dual_clip)
    return PolicyLoss(loss, (pg_loss2 > pg_loss1) & (mask > 0))


def cispo(logp, old_logp, advantages, mask, eps_low: float, eps_high: float, *,
          dual_clip: float | None = None) -> PolicyLoss:
    """CISPO: clip the importance weight, stop its gradient, keep every token's gradient.

    ``L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * logp_t``  (MiniMax-M1, Chen et al. 2025).
    The cap on the weight is ``1 + eps_high`` (TRL's ``epsilon_high`` with ``loss_type="cispo"``);
    ``eps_low = 1`` leaves it without a lower bound, as the paper. ``dual_clip`` does not apply
    (the weight is already capped); the config rejects it.
    """
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach()
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & (mask > 0)
    return PolicyLoss(-weight * per_token(advantages) * logp, clipped)


def importance_sampling(logp, old_logp, advantages, mask, eps_low: float = 0.0, eps_high: float = 0.0,
                        **_) -> PolicyLoss:
    """Tinker's ``importance_sampling``: the REINFORCE objective corrected for the sampler.

    ``L_t = -exp(logp_t - old_logp_t) * A_t``, no clipping (``eps_*`` are ignored); Tinker
    sums it over every token, so tokens outside the completion carry ``A_t = 0``.
    """
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    return PolicyLoss(-ratio * per_token(advantages), torch.zeros_like(mask, dtype=torch.bool))


def cross_entropy(logp, old_logp, advantages, mask, eps_low: float = 0.0, eps_high: float = 0.0,
                  **_) -> PolicyLoss:
    """Tinker's ``cross_entropy``: ``L_t = -logp_t``; the caller weights tokens (``weights``) and sums.

    Only ``logp`` is used; the other arguments keep the signature of the policy losses.
    """
    return PolicyLoss(-logp, torch.zeros_like(logp, dtype=torch.bool))


def per_token(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages as a ``(B, 1)`` column (one per sequence) or unchanged ``(B, T)`` (one per token)."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


LOSSES = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}

# Tinker's loss names -> (loss, default eps_low, default eps_high). Tinker's clip thresholds are
# ratio bounds: ``clip_low_threshold = 1 - eps_low``, ``clip_high_threshold = 1 + eps_high``.
TINKER_LOSSES = {
    "cross_entropy": (cross_entropy, 0.0, 0.0),
    "importance_sampling": (importance_sampling, 0.0, 0.0),
    "ppo": (ppo_clip, 0.2, 0.2),
    "cispo": (cispo, 0.2, 0.2),
}


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
