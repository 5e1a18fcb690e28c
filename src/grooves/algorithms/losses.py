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

import math
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
    The cap on the weight is ``1 + eps_high``. TRL's ``epsilon_high`` with ``loss_type="cispo"`` *is*
    the cap itself, so ``eps_high = 4`` here is TRL's ``epsilon_high = 5``. ``eps_low = 1`` leaves the
    weight without a lower bound, as the paper. ``dual_clip`` does not apply (the weight is already
    capped); the config rejects it.
    """
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach()
    clipped = ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)) & (mask > 0)
    return PolicyLoss(-weight * per_token(advantages) * logp, clipped)


def sapo(logp, old_logp, advantages, mask, eps_low: float = 0.0, eps_high: float = 0.0, *,
         dual_clip: float | None = None, sapo_temperature_pos: float = 1.0,
         sapo_temperature_neg: float = 1.05) -> PolicyLoss:
    """SAPO: a soft, temperature-controlled gate on the ratio instead of a hard clip (Gao et al. 2025,
    arXiv:2511.20347).

    ``L_t = -f(r_t) * A``, ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``, ``tau = tau_pos`` if ``A > 0``
    else ``tau_neg``. The gradient is ``-A * 4 s (1 - s) * r_t * grad logp_t`` with
    ``s = sigmoid(tau (r_t - 1))``: exactly the on-policy gradient at ``r = 1`` and fading smoothly
    as ``r`` moves away. No hard clip: ``eps_*`` and ``dual_clip`` are unused and nothing counts as clipped.
    """
    ratio = torch.exp(log_ratio(logp, old_logp, mask))  # (B, T)
    adv = per_token(advantages)
    tau = torch.where(adv > 0, torch.full_like(adv, sapo_temperature_pos), torch.full_like(adv, sapo_temperature_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau  # (B, T)
    return PolicyLoss(-gate * adv, torch.zeros_like(mask, dtype=torch.bool))


# log W is kept inside [ln 1e-8, 20]: W never reaches 0 (ln 0) or overflows in float32
VESPO_LOG_W_MIN = math.log(1e-8)


def vespo(logp, old_logp, advantages, mask, eps_low: float = 0.0, eps_high: float = 0.0, *,
          dual_clip: float | None = None, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
          vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
          is_weight: torch.Tensor | None = None) -> PolicyLoss:
    """VESPO: a smooth Gamma-shaped weight on the *sequence* ratio, without length normalisation
    (Shen et al. 2026, arXiv:2602.10693).

    ``W_i = prod_t r_t = exp(sum_t (logp_t - old_logp_t))``; ``phi(W) = W^k * exp(lambda * (1 - W))``
    (``phi(1) = 1``); ``L_t = -sg(phi(W_i)) * A_i * logp_t``, with ``(k, lambda) = (k_pos, lambda_pos)``
    if ``A >= 0`` else ``(k_neg, lambda_neg)``. ``phi`` rises as ``W^k`` below 1 and decays as
    ``exp(-lambda W)`` above, so neither stale nor exploded sequences dominate. ``log W`` is clamped to
    ``[ln 1e-8, 20]`` and ``phi`` computed in log space. No hard clip: ``eps_*``, ``dual_clip`` unused.

    The paper's ``W`` is against the sampler ``mu``: given the sampler correction's per-token weight
    ``is_weight`` (``~ old / mu``, truncated or masked; 0 off ``mask``), ``W_i *= prod_t is_weight_t``
    (each log clamped to ``[ln 1e-8, 20]``, as TRL), instead of multiplying the loss by it.
    """
    log_w = (log_ratio(logp, old_logp, mask) * mask).sum(-1, keepdim=True)  # (B, 1)
    if is_weight is not None:  # a masked (0) weight gives ln 1e-8: the sequence's phi falls to ~0
        log_w = log_w + (torch.log(is_weight).clamp(VESPO_LOG_W_MIN, LOGRATIO_CLAMP) * mask).sum(-1, keepdim=True)
    log_w = log_w.clamp(VESPO_LOG_W_MIN, LOGRATIO_CLAMP).detach()
    adv = per_token(advantages)  # (B, 1) or (B, T)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(adv, vespo_k_pos), torch.full_like(adv, vespo_k_neg))
    lam = torch.where(nonneg, torch.full_like(adv, vespo_lambda_pos), torch.full_like(adv, vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # ln phi = lambda + k ln W - lambda W
    return PolicyLoss(-phi * adv * logp, torch.zeros_like(mask, dtype=torch.bool))


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


LOSSES = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo, "sapo": sapo, "vespo": vespo}

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


def seq_mean_token_sum(mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """LUSPO (Liu et al. 2026, arXiv:2602.05261): each sequence's loss *summed* over its tokens, then a
    mean over sequences. With GSPO's loss this is ``1/G' sum_i |o_i| * L_i``: GSPO's sequence loss scaled
    by the sequence's length, which removes GSPO's bias towards short responses."""
    sequences = (mask.sum(-1) > 0).sum().clamp(min=1)
    return mask / sequences


AGGREGATIONS = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean, "constant": constant,
                "seq_mean_token_sum": seq_mean_token_sum}


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (Schulman 2020).

    Non-negative, unbiased for the KL under samples from pi. With ``ratio`` (see ``kl_ratio``) it is
    multiplied by that importance ratio, ``k3_t * pi_theta / pi_old``: the bias-corrected estimator of
    DeepSeek-V3.2 (arXiv:2512.02556), TRL's ``use_bias_correction_kl``. The samples come from
    ``pi_old``, not ``pi_theta``; the ratio (with its gradient) makes the KL's gradient the unbiased
    reverse-KL gradient, even on-policy where its value is 1.
    """
    delta = ref_logp - logp
    kl = torch.exp(delta) - delta - 1
    return kl if ratio is None else kl * ratio


def kl_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """The importance ratio that ``k3_kl`` multiplies in, *with* its gradient through ``logp``.

    ``"token"``: ``r_t = exp(logp_t - old_logp_t)``, (B, T). ``"sequence"``: GSPO's
    ``s_i = exp(1/|o_i| sum_t (logp_t - old_logp_t))``, (B, 1): as TRL with
    ``importance_sampling_level="sequence"``, the sequence weight on every token's KL.
    """
    logr = log_ratio(logp, old_logp, mask)  # (B, T)
    if level == "token":
        return torch.exp(logr)
    if level == "sequence":
        return torch.exp((logr * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1))
    raise ValueError(f"level must be 'token' or 'sequence', not {level!r}")


# Losses whose importance ratio is the sequence's (TRL's importance_sampling_level="sequence").
SEQUENCE_RATIO_LOSSES = frozenset({"gspo"})
# Losses that take the sampler correction's token weight as ``is_weight`` instead of being multiplied by it.
IS_WEIGHT_LOSSES = frozenset({"vespo"})
