"""Advantage estimators, policy losses and presets: pure tensor functions (torch only)."""

from grooves.algorithms.advantages import ESTIMATORS
from grooves.algorithms.losses import AGGREGATIONS, LOSSES, k3_kl, kl_ratio
from grooves.algorithms.presets import (
    PRESETS,
    Algorithm,
    cispo,
    dapo,
    dr_grpo,
    grpo,
    gspo,
    luspo,
    ppo,
    preset,
    rloo,
    sapo,
    vespo,
)
from grooves.algorithms.shaping import has_signal, overlong_penalty

__all__ = [
    "AGGREGATIONS", "ESTIMATORS", "LOSSES", "PRESETS", "Algorithm", "cispo", "dapo", "dr_grpo", "grpo",
    "gspo", "has_signal", "k3_kl", "kl_ratio", "luspo", "overlong_penalty", "ppo", "preset", "rloo", "sapo",
    "vespo",
]
