"""The training loop, its config, checkpoints and the run store."""

from grooves.train.api import run_config, train
from grooves.train.config import ConfigError, RunConfig, load_config
from grooves.train.loop import Run, RunExistsError
from grooves.train.trainer import Trainer

__all__ = ["ConfigError", "Run", "RunConfig", "RunExistsError", "Trainer", "load_config", "run_config", "train"]
