"""The training core: the trainer, the loop, its config, checkpoints and SFT.

Names load on first use, so importing one module of this package (``grooves.training.config``,
say) does not load the loop and everything it needs. ``grooves.training.sft`` is the SFT module;
the ``sft`` function is ``grooves.sft``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "run_config": "grooves.training.api",
    "train": "grooves.training.api",
    "ConfigError": "grooves.training.config",
    "OptimConfig": "grooves.training.config",
    "RunConfig": "grooves.training.config",
    "load_config": "grooves.training.config",
    "Run": "grooves.training.runfolder",
    "RunExistsError": "grooves.training.runfolder",
    "SFTConfig": "grooves.training.sft",
    "Trainer": "grooves.training.trainer",
    "TrainingSession": "grooves.training.session",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from grooves.training.api import run_config, train
    from grooves.training.config import ConfigError, OptimConfig, RunConfig, load_config
    from grooves.training.runfolder import Run, RunExistsError
    from grooves.training.sft import SFTConfig
    from grooves.training.session import TrainingSession
    from grooves.training.trainer import Trainer


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'grooves.training' has no attribute {name!r}")
