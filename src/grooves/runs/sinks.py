"""Where step metrics go besides metrics.jsonl: TensorBoard (default) and W&B (optional)."""

from __future__ import annotations

import math
from pathlib import Path


class MetricSinks:
    def __init__(self, run_dir: Path, tensorboard: bool, wandb_project: str | None, run_name: str,
                 config: dict):
        self.tensorboard = None
        self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("log.wandb_project is set but wandb is not installed: "
                                   "pip install 'grooves[wandb]'") from None
            self.wandb = wandb.init(project=wandb_project, name=run_name, config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        finite = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.tensorboard is not None:
            for key, value in finite.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(finite, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
