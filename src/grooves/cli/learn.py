"""``grooves learn CONFIG``: continuous learning from what ``grooves serve --capture`` recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _user_errors, err, out


def register(app: typer.Typer) -> None:
    app.command("learn")(learn)


def learn(
    config: Annotated[Path, typer.Argument(help="Learn config: a run config plus [sampler] url and [learn] "
                                           "capture (docs/learn.md).")],
    rollback: Annotated[bool, typer.Option("--rollback", help="Point the alias back at the checkpoint it served "
                                           "before the current one, and exit (loads no model).")] = False,
    max_steps: Annotated[int | None, typer.Option(min=1, help="Stop once the run has this many steps "
                                                  "(overrides learn.max_steps).")] = None,
    runs: RunsOption = None,
) -> None:
    """Sample G alternatives of each new captured prompt through the server, score them, train a
    step, and move the served alias to the new checkpoint only if the gate lets it through.

    Runs until stopped (Ctrl-C or SIGTERM finish the current step first); a restart, even after
    kill -9, goes on where it stopped without scoring a prompt twice.
    """
    import signal
    import threading

    from grooves.policy.engine import EngineError
    from grooves.training.config import load_config
    from grooves.training.session import RunHalted
    from grooves.workflows.learn import LearnConfig, Learner
    from grooves.workflows.learn import rollback as roll_back
    from grooves.workflows.learn_state import PublishError

    errors = (*_user_errors(), PublishError, EngineError)
    try:
        settings = load_config(config, LearnConfig)
        if max_steps is not None:
            settings.learn.max_steps = max_steps
        if rollback:
            before, after = roll_back(settings, runs)
            out.print(f"{settings.learn.alias}: {settings.name}@{before} -> {settings.name}@{after}",
                      highlight=False)
            return
        learner = Learner(settings, runs=runs, console=err)
    except errors as error:
        raise _fail(str(error)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    err.print(f"[bold]grooves learn[/]: {settings.name}, reading {learner.capture.path}; "
              f"{settings.learn.alias} serves {settings.name}@{learner.ledger.history()[-1].step}", highlight=False)
    try:
        learner.run(stop)
    except (RunHalted, PublishError, EngineError) as error:
        raise _fail(str(error), 1) from None
    finally:
        learner.close()
