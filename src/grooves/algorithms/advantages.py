"""Advantage estimators: pure functions of a flat reward vector and its group ids.

Every estimator has the signature ``fn(rewards, group, eps) -> advantages`` where
``rewards`` and ``group`` are ``(N,)`` tensors (``group[i]`` is the index of trajectory
i's group, 0..K-1). Groups may have different sizes (failed rewards are left out before
this point). The advantage of a trajectory is shared by all of its tokens.
"""

from __future__ import annotations

import torch


def _group_stats(rewards: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory group mean, unbiased group std and group size, each ``(N,)``."""
    k = int(group.max()) + 1
    count = torch.zeros(k, dtype=rewards.dtype).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(k, dtype=rewards.dtype).index_add_(0, group, rewards) / count
    sq = torch.zeros(k, dtype=rewards.dtype).index_add_(0, group, (rewards - mean[group]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[group], std[group], count[group]


def group_mean(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Dr. GRPO: ``A_i = r_i - mean(r_group)`` (no std scaling; Liu et al. 2025)."""
    mean, _, _ = _group_stats(rewards, group)
    return rewards - mean


def group_mean_std(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``, std unbiased (Shao et al. 2024)."""
    mean, std, _ = _group_stats(rewards, group)
    return (rewards - mean) / (std + eps)


def leave_one_out(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """RLOO: ``A_i = r_i - (sum_j r_j - r_i) / (G - 1)``, the mean of the *other* samples.

    Equals ``G / (G - 1) * (r_i - mean)`` (Kool et al. 2019; Ahmadian et al. 2024).
    """
    mean, _, count = _group_stats(rewards, group)
    others = (mean * count - rewards) / (count - 1).clamp(min=1)
    return rewards - others


def batch_std(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++-baseline: ``A_i = (r_i - mean(r_group)) / (std(all centred rewards) + eps)``.

    The group mean removes the prompt's difficulty; one batch-wide std keeps the relative
    scale between groups (Hu et al. 2025).
    """
    centred = group_mean(rewards, group)
    std = centred.std() if centred.numel() > 1 else centred.new_tensor(0.0)
    return centred / (std + eps)


def no_baseline(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Plain REINFORCE: ``A_i = r_i``."""
    return rewards.clone()


ESTIMATORS = {
    "group_mean": group_mean,
    "group_mean_std": group_mean_std,
    "leave_one_out": leave_one_out,
    "batch_std": batch_std,
    "none": no_baseline,
}
