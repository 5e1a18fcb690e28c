"""The ``grooves`` command: thin wrappers over the library.

Bad input (an invalid config, a missing file, an unknown model or checkpoint) prints one
clear message and exits with code 2. Heavy imports happen inside the commands so that
``grooves --help`` answers at once.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _user_errors, err, num, out

app = typer.Typer(
    name="grooves",
    help="RL fine-tuning (GRPO family) of small LLMs on LoRA adapters. Runs live under a runs root "
    "(--runs, $GROOVES_RUNS, default ./runs); a checkpoint is named RUN@STEP or RUN@latest.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="Run configuration (TOML); see docs/config.md.")],
    steps: Annotated[int | None, typer.Option(help="Override the number of training steps.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's last complete "
                                         "checkpoint.")] = False,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Run folder (default: RUNS/<name>).")] = None,
    runs: RunsOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    ack: Annotated[list[str] | None, typer.Option("--ack", help="With --resume: accept the alerts of this "
                                                  "detector (e.g. collapse); they only warn from now on. "
                                                  "Repeatable.")] = None,
) -> None:
    """RL-train a LoRA adapter as CONFIG describes; checkpoints go to the run folder.

    Exit code 3 when a reward-hacking alert paused or stopped the run (the alerts section of the config).
    """
    from grooves.training.config import ConfigError, load_config

    if not config.is_file():
        raise _fail(f"config file {config} does not exist")
    try:
        cfg = load_config(config)
        if steps is not None:
            cfg.steps = steps
    except ConfigError as error:
        raise _fail(f"invalid config {config}:\n{error}") from None
    except ValueError as error:  # a bad --steps value fails validation on assignment
        raise _fail(f"--steps: {error}") from None
    from grooves.training.api import run_config

    from grooves.monitors import DETECTORS

    if ack and not resume:
        raise _fail("--ack acknowledges an alert of a paused run: use it with --resume")
    unknown = sorted(set(ack or ()) - {d.name for d in DETECTORS})
    if unknown:
        raise _fail(f"--ack {', '.join(unknown)}: not a detector; allowed: {', '.join(d.name for d in DETECTORS)}")
    try:
        run = run_config(cfg, runs=runs, out=out_dir, resume=resume, progress=not quiet, acknowledge=tuple(ack or ()),
                         resume_command=f"grooves train {config} --resume")
    except _user_errors() as error:
        raise _fail(str(error)) from None
    last = run.metrics[-1] if run.metrics else {}
    out.print(f"[bold]{run.name}[/]: step {run.step}, reward {last.get('reward/total', float('nan')):.3f}; "
              f"checkpoint {run.name}@latest in {run.dir}")
    if run.halted_by:
        raise typer.Exit(3)


@app.command()
def probe(
    config: Annotated[Path, typer.Argument(help="Run configuration (TOML) to probe; see docs/config.md.")],
    steps: Annotated[int, typer.Option(min=1, help="Step budget (the config's steps if fewer).")] = 40,
    k: Annotated[int, typer.Option("--k", min=1, help="Samples shown in each of top, bottom and random.")] = 5,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the probe from its last checkpoint.")] = False,
    ack: Annotated[list[str] | None, typer.Option("--ack", help="With --resume: accept this detector's "
                                                  "alerts (repeatable).")] = None,
    runs: RunsOption = None,
) -> None:
    """Train a short probe (<NAME>-probe), stop early on an alert or a clear held-out gain, then review.

    The probe validates and checkpoints at least every 10 steps and pauses on any alert; it
    stops early once the held-out reward beats step 0 by more than 2 standard errors of the
    per-task differences (from step 10 on). Then it prints the top, bottom and random
    samples of its last step with every reward component, reason and veto.
    """
    from grooves.cli.review import review
    from grooves.policy.checkpoints import runs_root
    from grooves.training.api import run_config
    from grooves.training.config import ConfigError, load_config
    from grooves.training.probe import heldout_rose, probe_config

    if not config.is_file():
        raise _fail(f"config file {config} does not exist")
    try:
        cfg = probe_config(load_config(config), steps)
    except ConfigError as error:
        raise _fail(f"invalid config {config}:\n{error}") from None
    try:
        run = run_config(cfg, runs=runs, resume=resume, acknowledge=tuple(ack or ()), stop_rule=heldout_rose(),
                         resume_command=f"grooves probe {config} --resume")
    except _user_errors() as error:
        raise _fail(str(error)) from None
    why = run.halt_reason or f"the budget of {cfg.steps} steps is spent"
    out.print(f"[bold]{run.name}[/]: probed {run.step} steps; stopped because {why}", highlight=False)
    review(run.name, step=[run.step], k=k, runs=runs_root(runs))
    out.print(f"Next: label what you see (grooves review {run.name} --label), add a guard for a hack "
              f"(grooves guard suggest {run.name}), or train long (grooves train {config}).", highlight=False)
    if run.halted_by == "pause":
        raise typer.Exit(3)


@app.command()
def sample(
    model: Annotated[str, typer.Argument(help="Model spec (bundled:smollm2-135m-instruct, tiny, a folder, a hub "
                                         "id) or a checkpoint RUN@STEP / RUN@latest.")],
    prompt: Annotated[str, typer.Argument(help="User message.")],
    n: Annotated[int, typer.Option("-n", min=1, help="Completions to sample.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="New tokens per completion.")] = 128,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    runs: RunsOption = None,
) -> None:
    """Generate completions of PROMPT with a base model or a checkpoint."""
    from grooves.policy import Policy, Sampling

    try:
        policy = Policy.load(model, runs=runs)
        sampling = Sampling(temperature=temperature, top_p=top_p or 1.0, max_new_tokens=max_tokens, seed=seed)
    except (*_user_errors(), ValueError) as error:
        raise _fail(str(error)) from None
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    for i, completion in enumerate(policy.sampler().generate([messages], n=n, sampling=sampling)[0]):
        if n > 1:
            out.print(f"[dim]--- {i + 1} ({completion.finish_reason}, {len(completion.token_ids)} tokens)[/]")
        out.print(completion.text, highlight=False, markup=False)


@app.command("runs")
def list_runs(runs: RunsOption = None) -> None:
    """List runs with their last step, newest checkpoint and rewards."""
    from rich.table import Table

    from grooves.policy.checkpoints import list_checkpoints, runs_root
    from grooves.training.store import read_metrics

    root = runs_root(runs)
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    folders = [p for p in folders if (p / "metrics.jsonl").exists()]
    if not folders:
        out.print(f"no runs under {root}")
        return
    table = Table("run", "last step", "checkpoint", "reward", "val reward", title=f"runs in {root}")
    for folder in folders:
        rows = read_metrics(folder / "metrics.jsonl")
        last_train = next((r for r in reversed(rows) if r.get("reward/total") is not None), {})
        last_val = next((r for r in reversed(rows) if r.get("val/reward/total") is not None), {})
        checkpoints = list_checkpoints(folder)
        table.add_row(folder.name, str(rows[-1]["step"] if rows else "-"),
                      f"{folder.name}@{checkpoints[-1][0]}" if checkpoints else "-",
                      num(last_train.get("reward/total")), num(last_val.get("val/reward/total")))
    out.print(table)


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Base model spec served, with its adapters.")] = "bundled:smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="GROOVES_API_KEY",
                                                help="Require 'Authorization: Bearer KEY' on /v1 routes.")] = None,
    adapter: Annotated[list[str] | None, typer.Option(help="Serve a checkpoint under an alias: "
                                                      "ALIAS=RUN@STEP (repeatable).")] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="Most samples decoded in one batch.")] = 32,
    max_queue: Annotated[int, typer.Option(min=1, help="Queued requests before answering 429.")] = 64,
    max_adapters: Annotated[int, typer.Option(min=1, help="Adapters kept loaded at once.")] = 8,
    runs: RunsOption = None,
) -> None:
    """Serve the base model and the runs' checkpoints over an OpenAI-compatible HTTP API."""
    import uvicorn

    from grooves.serve.adapters import UnknownModel
    from grooves.serve.app import build_server, create_app

    aliases = {}
    for item in adapter or []:
        alias, sep, checkpoint = item.partition("=")
        if not sep:
            raise _fail(f"--adapter {item!r}: use ALIAS=RUN@STEP")
        aliases[alias] = checkpoint
    try:
        server = build_server(model, runs=runs, api_key=api_key, aliases=aliases, max_batch_rows=max_batch,
                              max_queue=max_queue, max_loaded=max_adapters)
    except (*_user_errors(), UnknownModel, ValueError) as error:
        raise _fail(str(error)) from None
    err.print(f"[bold]grooves[/]: serving {model} and the checkpoints under {server.registry.runs} "
              f"on http://{host}:{port}/v1")
    uvicorn.run(create_app(server), host=host, port=port, log_level="warning")


@app.command()
def merge(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint to merge: RUN@STEP or RUN@latest.")],
    out_dir: Annotated[Path, typer.Option("--out", help="New folder for the merged model.")],
    runs: RunsOption = None,
) -> None:
    """Merge a checkpoint's adapter into its base model: a plain transformers folder."""
    from grooves.serve import ExportError, merge_checkpoint

    try:
        folder = merge_checkpoint(checkpoint, out_dir, runs=runs)
    except (*_user_errors(), ExportError) as error:
        raise _fail(str(error)) from None
    out.print(f"merged {checkpoint} into {folder} (load it with AutoModelForCausalLM.from_pretrained)")


@app.command()
def export(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint to export: RUN@STEP or RUN@latest.")],
    out_dir: Annotated[Path, typer.Option("--out", help="New folder for the PEFT adapter.")],
    with_base: Annotated[Path | None, typer.Option("--with-base", help="Also write the base model as a plain "
                                                   "transformers folder here (reused if it already holds this "
                                                   "base) and point the adapter at it.")] = None,
    runs: RunsOption = None,
) -> None:
    """Write a checkpoint's adapter as a standard PEFT folder with a model card.

    The adapter's base_model_name_or_path is a base that plain peft + transformers load: the
    --with-base folder, else the base's own folder or hub id (for the bundled model, grooves'
    cache folder on this machine). The model card names the exact base weights.
    """
    from grooves.serve.export import ExportError, export_adapter

    try:
        folder = export_adapter(checkpoint, out_dir, runs=runs, with_base=with_base)
    except (*_user_errors(), ExportError) as error:
        raise _fail(str(error)) from None
    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    out.print(f"exported {checkpoint} to {folder}; its base: {base} "
              f"(load it with peft.AutoPeftModelForCausalLM.from_pretrained)", highlight=False)


@app.command()
def demo(
    steps: Annotated[int | None, typer.Option(help="Training steps (default: the demo config's).")] = None,
    runs: RunsOption = None,
) -> None:
    """RL-train the bundled model to write titles; print held-out reward before and after."""
    from grooves.demo import print_report, run_demo

    try:
        result = run_demo(steps=steps, runs=runs, console=err)
    except _user_errors() as error:
        raise _fail(str(error)) from None
    print_report(result, out)


def _register_groups() -> None:
    from grooves.cli import base, envs, review, rewards, rm

    app.add_typer(base.app, name="base")
    app.add_typer(envs.app, name="env")
    app.add_typer(rm.app, name="rm")
    app.add_typer(rewards.rubric_app, name="rubric")
    app.add_typer(rewards.judge_app, name="judge")
    review.register(app)
    for typer_app in [app] + [group.typer_instance for group in app.registered_groups]:
        for command in typer_app.registered_commands:
            if command.help is None and command.callback is not None:
                command.help = reflow(inspect.getdoc(command.callback) or "")


def reflow(text: str) -> str:
    """A docstring as help text: the lines of a paragraph joined (Typer's rich help keeps them,
    so a wrapped docstring prints ragged); list items stay on their own lines."""
    paragraphs = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.splitlines()
        if any(line.lstrip().startswith(("- ", "* ")) or line.startswith(" ") for line in lines):
            paragraphs.append(paragraph)
        else:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


_register_groups()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
