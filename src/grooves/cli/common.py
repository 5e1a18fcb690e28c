"""What every ``grooves`` command shares: the consoles, the runs option and the error exit."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

out = Console()
err = Console(stderr=True, soft_wrap=True)  # no hard wraps: paths and messages stay copyable

RunsOption = Annotated[Path | None, typer.Option("--runs", envvar="GROOVES_RUNS",
                                                 help="Runs root folder (default: ./runs).")]


def _fail(message: str, code: int = 2) -> typer.Exit:
    from rich.markup import escape

    err.print(f"[bold red]error[/]: {escape(message)}", highlight=False)  # "[tasks]" is text, not markup
    return typer.Exit(code)


def _user_errors() -> tuple[type[Exception], ...]:
    from grooves.policy.checkpoints import CheckpointError
    from grooves.policy.models import ModelSpecError
    from grooves.tasks.sources import TaskSourceError
    from grooves.training.config import ConfigError
    from grooves.training.runfolder import NothingToResumeError, RunExistsError
    from grooves.runs.lock import RunLockedError

    return (ConfigError, CheckpointError, ModelSpecError, TaskSourceError, RunExistsError, NothingToResumeError,
            RunLockedError, FileNotFoundError, ModuleNotFoundError)


def num(value) -> str:
    return "-" if value is None else f"{value:.3f}"
