"""The ``grooves`` command: thin wrappers over the library.

Bad input (an invalid config, a missing file, an unknown model or checkpoint) prints one
clear message and exits with code 2. Heavy imports happen inside the commands so that
``grooves --help`` answers at once.
"""

from __future__ import annotations

import typer

from grooves.cli import models, train
from grooves.cli.helptext import TextGroup, plain_help

app = typer.Typer(
    name="grooves",
    help="RL fine-tuning (GRPO family) of small LLMs on LoRA adapters. Runs live under a runs root "
    "(--runs, $GROOVES_RUNS, default ./runs); a checkpoint is named RUN@STEP or RUN@latest.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=TextGroup,
)


def _register_groups() -> None:
    from grooves.cli import backend, base, dashboard, drift, envs, evals, learn, review, rewards, rm, sft

    app.command()(train.train)
    app.command()(train.probe)
    app.command()(models.sample)
    app.command("runs")(models.list_runs)
    app.command()(models.serve)
    app.command()(models.merge)
    app.command()(models.export)
    app.command()(train.demo)
    app.add_typer(backend.app, name="backend")
    app.add_typer(base.app, name="base")
    app.add_typer(envs.app, name="env")
    app.add_typer(rm.app, name="rm")
    app.add_typer(rewards.rubric_app, name="rubric")
    app.add_typer(rewards.judge_app, name="judge")
    review.register(app)
    sft.register(app)
    drift.register(app)
    dashboard.register(app)
    evals.register(app)
    learn.register(app)
    plain_help(app)


_register_groups()


def main() -> None:
    import sys

    app(args=optional_ray_address(sys.argv[1:]))


def optional_ray_address(argv: list[str]) -> list[str]:
    """``grooves train CONFIG --ray`` with no ADDRESS means a local Ray instance: Typer has no
    options whose value may be left out, so a bare ``--ray`` gets the value ``local`` here."""
    if not argv or argv[0] != "train" or "--ray" not in argv:
        return argv
    at = argv.index("--ray")
    if at + 1 == len(argv) or argv[at + 1].startswith("-"):
        return [*argv[: at + 1], "local", *argv[at + 1 :]]
    return argv


if __name__ == "__main__":
    main()
