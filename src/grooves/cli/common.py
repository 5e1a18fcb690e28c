"""What every ``grooves`` command shares: the consoles, the runs option and the error exit."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


class Stdout(Console):
    """The commands' stdout. Text (a message, a command to copy) is never hard-wrapped, in a terminal
    or a file: a ``grooves train ...`` split over two lines pastes as two commands. Panels are laid
    out to the width. A table printed to a file or a pipe gets its natural width, every cell on one
    line: a file has no right edge, and Rich squeezing a table into 80 columns cuts numbers to
    ``0.…`` (a terminal shows what fits, as a terminal must)."""

    def print(self, *objects, soft_wrap: bool | None = None, **kwargs) -> None:
        if soft_wrap is None and all(isinstance(o, (str, Text)) for o in objects):
            soft_wrap = True
        tables = [o for o in objects if isinstance(o, Table)] if not self.is_terminal else []
        wide = max((self._natural(table) for table in tables), default=0)
        if wide <= self.width:
            return super().print(*objects, soft_wrap=soft_wrap, **kwargs)
        pinned, self.width = self._width, wide  # _width None: the width follows $COLUMNS or the terminal
        try:
            super().print(*objects, soft_wrap=soft_wrap, **kwargs)
        finally:
            self._width = pinned

    def _natural(self, table: Table) -> int:
        """The width at which no cell wraps."""
        return Measurement.get(self, self.options.update_width(1 << 16), table).maximum


out = Stdout()
err = Console(stderr=True, soft_wrap=True)  # no hard wraps: paths and messages stay copyable

RunsOption = Annotated[Path | None, typer.Option("--runs", envvar="GROOVES_RUNS",
                                                 help="Runs root folder (default: ./runs).")]


def _fail(message: str, code: int = 2) -> typer.Exit:
    from rich.markup import escape

    err.print(f"[bold red]error[/]: {escape(message)}", highlight=False)  # "[tasks]" is text, not markup
    return typer.Exit(code)


def _user_errors() -> tuple[type[Exception], ...]:
    from grooves.policy.checkpoints import CheckpointError
    from grooves.policy.engine import EngineError
    from grooves.policy.models import ModelSpecError
    from grooves.tasks.sources import TaskSourceError
    from grooves.training.config import ConfigError
    from grooves.training.runfolder import NothingToResumeError, RunExistsError
    from grooves.runs.lock import RunLockedError

    return (ConfigError, CheckpointError, ModelSpecError, TaskSourceError, RunExistsError, NothingToResumeError,
            RunLockedError, FileNotFoundError, ModuleNotFoundError, EngineError)


def num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _resume_command(command: str, config: Path, *, out_dir: Path | None = None, runs: Path | None = None) -> str:
    """The command that continues this run, with the folders given: what a paused or interrupted run prints."""
    words = ["grooves", command, str(config), "--resume"]
    words += ["--out", str(out_dir)] if out_dir else []
    words += ["--runs", str(runs)] if runs else []
    return shlex.join(words)


def _exit_for(run) -> None:
    """Exit codes a script can tell apart: 1 failed, 3 halted by an alert, 130 interrupted."""
    if run.halted_by == "failed":
        raise _fail(f"run {run.name} failed: {run.halt_reason}", code=1)
    if run.halted_by == "interrupt":
        raise typer.Exit(130)
    if run.halted_by:
        raise typer.Exit(3)
