"""grooves: reinforcement-learning fine-tuning (GRPO family) of small LLMs on LoRA adapters.

The public API is this short flat list. Names are imported on first use, so
``import grooves`` (and ``grooves --help``) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "Policy": "grooves.policy",
    "LoRA": "grooves.policy",
    "Sampling": "grooves.policy",
    "Trajectory": "grooves.types",
    "Group": "grooves.types",
    "Reward": "grooves.rewards",
    "Component": "grooves.rewards",
    "Endpoint": "grooves.rewards",
    "load_tasks": "grooves.tasks",
    "train": "grooves.training",
    "sft": "grooves.training.sft",
    "Trainer": "grooves.training",
    "TrainingSession": "grooves.training.session",
    "gather_groups": "grooves.training.session",
    "RunConfig": "grooves.training",
    "load_config": "grooves.training",
    "run_config": "grooves.training",
}

__all__ = ["algorithms", "rewards", "training", *_EXPORTS]

if TYPE_CHECKING:
    from grooves import algorithms, rewards, training
    from grooves.policy import LoRA, Policy, Sampling
    from grooves.rewards import Component, Endpoint, Reward
    from grooves.tasks import load_tasks
    from grooves.training import RunConfig, Trainer, load_config, run_config, train
    from grooves.training.session import TrainingSession, gather_groups
    from grooves.training.sft import sft
    from grooves.types import Group, Trajectory


def __getattr__(name: str):
    if name in ("algorithms", "rewards", "training"):
        return importlib.import_module(f"grooves.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'grooves' has no attribute {name!r}")
