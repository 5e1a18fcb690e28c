"""The training loop, its config, checkpoints and the run store."""

from grooves.training.api import run_config, train
from grooves.training.config import ConfigError, OptimConfig, RunConfig, load_config
from grooves.training.runfolder import Run, RunExistsError
from grooves.training.sft import SFTConfig, sft
from grooves.training.trainer import Trainer

__all__ = ["ConfigError", "OptimConfig", "Run", "RunConfig", "RunExistsError", "SFTConfig", "Trainer", "load_config",
           "run_config", "sft", "train"]
