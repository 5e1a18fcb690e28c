"""``grooves sft``: supervised fine-tuning of a LoRA adapter, the warm start before RL."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _resume_command, _user_errors, err, num, out


def register(app: typer.Typer) -> None:
    app.command("sft")(sft)


def sft(
    config: Annotated[Path, typer.Argument(help="SFT configuration (TOML): [data] source = a chat JSONL file, "
                                           "'env:NAME' or 'run:NAME'; see docs/sft.md.")],
    steps: Annotated[int | None, typer.Option(min=1, help="Override the number of optimizer steps.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's newest complete "
                                         "checkpoint.")] = False,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Run folder (default: RUNS/<name>).")] = None,
    runs: RunsOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress.")] = False,
) -> None:
    """Fine-tune a LoRA adapter on transcripts (loss on the assistant's tokens only), in a run folder
    like grooves train's. RL continues from it: [model] adapter = "RUN@STEP".

    Progress goes to stdout: on a terminal a bar with the phase and the time left; to a file or a
    pipe one line per step (loss, held-out loss when measured, seconds, ETA).

    Exit codes: 0 done, 2 bad input, 130 Ctrl-C (after saving a checkpoint).
    """
    from grooves.training.config import ConfigError, load_config
    from grooves.training.sft import SFTConfig, run_sft_config

    if not config.is_file():
        raise _fail(f"config file {config} does not exist")
    try:
        cfg = load_config(config, SFTConfig)
        if steps is not None:
            cfg.steps = steps
    except ConfigError as error:
        raise _fail(f"invalid config {config}:\n{error}") from None
    try:
        run = run_sft_config(cfg, runs=runs, out=out_dir, resume=resume, console=out, progress=not quiet,
                             resume_command=_resume_command("sft", config, out_dir=out_dir, runs=runs))
    except (*_user_errors(), ValueError) as error:
        raise _fail(str(error)) from None
    except KeyboardInterrupt:
        err.print("aborted; the newest checkpoint is intact")
        raise typer.Exit(130) from None
    last = run.metrics[-1] if run.metrics else {}
    out.print(f"[bold]{run.name}[/]: step {run.step}, loss {num(last.get('loss/sft'))}, held-out loss "
              f"{num(last.get('val/loss/sft'))}; checkpoint {run.name}@latest in {run.dir}", highlight=False, soft_wrap=True)
    if run.halted_by == "interrupt":
        raise typer.Exit(130)
