"""A run folder's life: the run it holds, where a resume starts, and a Ctrl-C that saves first.

Shared by ``grooves train`` (``loop.TrainingRun``) and ``grooves sft`` (``sft.SFTRun``).
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from grooves.training import checkpoint as ckpt
from grooves.training.config import dump_config
from grooves.training.gather import Evaluation
from grooves.runs.sinks import MetricSinks
from grooves.runs.store import RunStore


class RunExistsError(RuntimeError):
    """The run folder already holds a run and resume was not asked for."""


class NothingToResumeError(RuntimeError):
    """Resume was asked for, but the run folder holds no run."""


@dataclass
class Run:
    """What a finished (or stopped) run leaves behind."""

    name: str
    dir: Path
    step: int
    metrics: list[dict] = field(default_factory=list)
    evaluations: dict[int, Evaluation] = field(default_factory=dict)
    # Why the run ended before its budget: "pause" or "stop" (an alert or the stop rule), "failed"
    # (train.max_failed_steps steps in a row did nothing), "interrupt" (Ctrl-C, after a checkpoint).
    halted_by: str | None = None
    halt_reason: str | None = None

    @property
    def checkpoint(self) -> str:
        return f"{self.name}@latest"


def resume_point(run_dir: Path, resume: bool, resume_command: str, console: Console) -> Path | None:
    """Check the run folder against ``resume`` and return the checkpoint to continue from: the
    newest one that verifies (damaged newer ones are set aside and named), or None."""
    has_run = (run_dir / "metrics.jsonl").exists() or ckpt.latest_checkpoint(run_dir)
    if has_run and not resume:
        raise RunExistsError(f"{run_dir} already holds a run: resume with `{resume_command}` to continue it, "
                             f"or give the new run another name")
    if resume and not has_run:
        raise NothingToResumeError(f"nothing to resume: {run_dir} holds no run yet (start it without resuming)")
    if not resume:
        return None
    ckpt.clean_partial(run_dir)
    latest, corrupt = ckpt.set_aside_corrupt(run_dir)
    for step, problem in corrupt:
        console.print(f"[yellow]checkpoint step {step} is corrupt[/] ({escape(problem)}); set aside as "
                      f"checkpoints/corrupt-{ckpt.step_dirname(step)}")
    if corrupt and latest is not None:
        console.print(f"resuming from the newest complete checkpoint, {latest.name}")
    return latest


def begin(store: RunStore, config, start: int) -> MetricSinks:
    """Open a run's metric sinks; a run starting at step 0 also seeds the global generators and
    writes its resolved ``config.toml``. ``config``: a RunConfig or an SFTConfig."""
    if start == 0:
        # Global generators drive LoRA dropout; seeding them makes a run independent of what
        # ran before it in the process (a resume restores them from the checkpoint instead).
        ckpt.seed_everything(config.seed)
        store.write_config(dump_config(config))
    return MetricSinks(store.dir, config.log.tensorboard, config.log.wandb_project, store.name,
                       config.model_dump(mode="json"))


class GracefulStop:
    """First Ctrl-C: finish the current step, checkpoint it and stop. Second Ctrl-C: abort now."""

    def __init__(self, console: Console):
        self.console = console
        self.requested = False
        self._previous = None

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.console.print("[yellow]stopping after this step and saving a checkpoint "
                           "(Ctrl-C again to abort without saving)[/]")
