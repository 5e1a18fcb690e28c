"""DAPO's reward-side extras: overlong shaping and the zero-variance group test."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment added to the reward (DAPO, Yu et al. 2025, eq. 13).

    ``0`` while ``|y| <= L_max - L_buf``; ``penalty * ((L_max - L_buf) - |y|) / L_buf`` inside the
    buffer; ``-penalty`` beyond ``L_max``. ``lengths`` is ``(N,)``.
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float)
    start = max_len - buffer
    inside = (start - lengths.float()) / buffer
    shaped = torch.where(lengths <= start, torch.zeros_like(inside), inside)
    return penalty * shaped.clamp(min=-1.0)


def has_signal(rewards: torch.Tensor, tol: float = 1e-8) -> bool:
    """False when every reward in a group is the same: its advantages would all be zero."""
    return bool(rewards.numel() >= 2 and (rewards.max() - rewards.min()) > tol)
