"""Truncated importance sampling between the sampler and the trainer: pure tensor functions.

The sampler that made a trajectory (an older adapter, a remote service, vLLM) is not exactly
the policy the trainer differentiates. The policy loss's ratio ``r_t = pi_theta / pi_old``
corrects for the updates *within* a step; this weight corrects for the gap between
``pi_old`` (the trainer's logprobs before the update) and ``mu`` (the sampler's):

    token level:     w_t = exp(old_t - mu_t)
    sequence level:  w_i = exp(sum_t (old_t - mu_t))      (one weight for all of a sequence's tokens)

and then either truncates it (``w = min(w, C)``, the TIS of Yao et al. 2025) or masks it
(``w = w if w <= C else 0``, MIS: a token or sequence whose weight passes the cap is left out).
The weight is a constant (no gradient) that multiplies each token's policy loss; the loss's
normalisation is unchanged, so a masked token counts in the denominator as a zero.

Shapes: ``old_logp``, ``sampler_logp`` and ``mask`` are ``(B, T)`` over completion tokens.
Log-ratios are taken on ``mask`` tokens only and clamped to ``+-LOGRATIO_CLAMP`` before ``exp``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grooves.algorithms.losses import LOGRATIO_CLAMP, k3_kl, log_ratio

LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")


class ImportanceWeights(NamedTuple):
    weights: torch.Tensor  # (B, T) the correction per token: 0 outside mask and where masked
    ratios: torch.Tensor  # (n,) the untruncated weights: one per mask token, or one per sequence
    masked: torch.Tensor  # (B, T) bool: mask tokens whose weight was dropped (mode "mask")
    truncated: torch.Tensor  # (B, T) bool: mask tokens whose weight was cut to the cap (mode "truncate")


@torch.no_grad()
def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                       level: str = "token", mode: str = "truncate", cap: float = 3.0) -> ImportanceWeights:
    """The truncated (or masked) importance weight of every completion token; see the module docstring."""
    if level not in LEVELS or mode not in MODES:
        raise ValueError(f"level must be one of {LEVELS} and mode one of {MODES}, not {level!r}/{mode!r}")
    on = mask > 0
    logr = log_ratio(old_logp, sampler_logp, mask)  # (B, T), 0 off the mask
    if level == "token":
        ratio = torch.exp(logr)  # (B, T)
        ratios = ratio[on]
    else:
        seq = torch.exp((logr * mask).sum(-1).clamp(-LOGRATIO_CLAMP, LOGRATIO_CLAMP))  # (B,)
        ratio = seq[:, None].expand_as(mask)
        ratios = seq[on.any(-1)]
    over = (ratio > cap) & on
    if mode == "truncate":
        weights = torch.clamp(ratio, max=cap)
        masked, truncated = torch.zeros_like(on), over
    else:
        weights = torch.where(over, torch.zeros_like(ratio), ratio)
        masked, truncated = over, torch.zeros_like(on)
    return ImportanceWeights(weights * mask, ratios, masked, truncated)


@torch.no_grad()
def sampler_kl(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler || trainer) under the sampler's tokens:
    ``exp(old - mu) - (old - mu) - 1`` on ``mask`` tokens, 0 elsewhere.  (B, T)"""
    delta = log_ratio(old_logp, sampler_logp, mask)
    return k3_kl(torch.zeros_like(delta), delta) * (mask > 0)
