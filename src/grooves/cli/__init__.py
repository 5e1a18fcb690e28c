"""The ``grooves`` command: thin wrappers over the library.

Bad input (an invalid config, a missing file, an unknown model or checkpoint) prints one
clear message and exits with code 2. Heavy imports happen inside the commands so that
``grooves --help`` answers at once.
"""

from __future__ import annotations

import inspect
import json
import shlex
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


def _passive_openmp_for_a_sampler_process(config: Path) -> None:
    """A run whose async sampler is a child process (``train.async_sampler = "process"``): let the
    trainer's idle OpenMP threads sleep instead of spinning on the CPU cores the sampler needs
    (docs/scale.md). OpenMP reads the setting when torch loads it, so it is taken from the TOML
    here, before anything imports torch. A value already in the environment wins."""
    import os
    import tomllib

    try:
        table = tomllib.loads(config.read_text()).get("train")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return  # load_config says what is wrong with the file
    if isinstance(table, dict) and table.get("async_sampler") == "process" and table.get("max_off_policy_steps"):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="Run configuration (TOML); see docs/config.md.")],
    steps: Annotated[int | None, typer.Option(min=1, help="Override the number of training steps.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's newest complete "
                                         "checkpoint (an error when there is no run to continue).")] = False,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Run folder (default: RUNS/<name>).")] = None,
    runs: RunsOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress (bar or lines).")] = False,
    ack: Annotated[list[str] | None, typer.Option("--ack", help="With --resume: accept the alerts of this "
                                                  "detector (e.g. collapse); they only warn from now on. "
                                                  "Repeatable.")] = None,
    backend: Annotated[str | None, typer.Option("--backend", help="Sample and train on this Tinker-compatible "
                                                "service (its URL; the API key from $TINKER_API_KEY), as "
                                                "[backend] url does; rewards and monitors stay here.")] = None,
    ray: Annotated[str | None, typer.Option("--ray", metavar="[ADDRESS]",
                                            help="Sample on Ray rollout workers (the ray table of the config): "
                                            "alone (or 'local'), a local Ray instance (or the table's address); with ADDRESS (HOST:PORT of "
                                            "`ray start --head`, or 'auto'), that cluster. See docs/scale.md.")] = None,
) -> None:
    """RL-train a LoRA adapter as CONFIG describes; checkpoints go to the run folder.

    Progress goes to stdout: on a terminal a bar with the phase and the time left; to a file
    or a pipe one line per step.

    Exit codes: 0 the run finished its steps; 1 the run failed (train.max_failed_steps steps in a row
    trained nothing); 2 bad input (config, files, a run another process is training); 3 a
    reward-hacking alert paused or stopped the run (the [alerts] section); 130 Ctrl-C (after saving a
    checkpoint).
    """
    _passive_openmp_for_a_sampler_process(config)
    from grooves.training.config import ConfigError, load_config

    if not config.is_file():
        raise _fail(f"config file {config} does not exist")
    try:
        cfg = load_config(config)
        if steps is not None:
            cfg.steps = steps
        if backend is not None:
            cfg.backend = {**(cfg.backend.model_dump() if cfg.backend else {}), "url": backend}
        if ray is not None:
            cfg.ray = _ray_config(cfg.ray, ray)
    except (ConfigError, ValueError) as error:
        raise _fail(f"invalid config {config}:\n{error}") from None
    from grooves.training.api import run_config

    from grooves.monitors import DETECTORS

    if ack and not resume:
        raise _fail("--ack acknowledges an alert of a paused run: use it with --resume")
    unknown = sorted(set(ack or ()) - {d.name for d in DETECTORS})
    if unknown:
        raise _fail(f"--ack {', '.join(unknown)}: not a detector; allowed: {', '.join(d.name for d in DETECTORS)}")
    policy = _remote_policy(cfg, resume) if cfg.backend is not None else None
    try:
        run = run_config(cfg, runs=runs, out=out_dir, resume=resume, progress=not quiet, acknowledge=tuple(ack or ()),
                         resume_command=_resume_command("train", config, out_dir=out_dir, runs=runs)
                         + ("" if ray is None else " --ray" + ("" if ray == "local" else f" {shlex.quote(ray)}")),
                         console=out, policy=policy)
    except _user_errors() as error:
        raise _fail(str(error)) from None
    except KeyboardInterrupt:  # before the loop took over Ctrl-C, or a second Ctrl-C: nothing more saved
        err.print("aborted; the newest checkpoint is intact")
        raise typer.Exit(130) from None
    finally:
        if policy is not None:
            policy.close()
    last = next((row for row in reversed(run.metrics) if row.get("reward/total") is not None), {})
    out.print(f"[bold]{run.name}[/]: step {run.step}, reward {num(last.get('reward/total'))}; "
              f"checkpoint {run.name}@latest in {run.dir}", highlight=False, soft_wrap=True)
    _exit_for(run)


def _remote_policy(cfg, resume: bool):
    """The [backend] service's policy (grooves.backend.client), or a clear error."""
    if resume:
        raise _fail("--resume: a run trained through [backend] cannot be resumed yet (its adapter is a saved "
                    "state on the service; see docs/backend.md)")
    try:
        from grooves.backend.client import RemoteError, RemotePolicy, check_remote
    except ImportError:
        raise _fail("[backend] needs the tinker SDK: pip install 'grooves[backend]'") from None
    try:
        check_remote(cfg)
    except RemoteError as error:
        raise _fail(f"invalid config:\n{error}") from None
    url = cfg.backend.url
    try:
        return RemotePolicy(url, cfg.backend.model or cfg.model.spec, cfg.backend.rank or cfg.lora.rank, cfg.seed)
    except Exception as error:  # the SDK's connection, auth and refusal errors: say which service said what
        raise _fail(f"backend.url: the service at {url} could not start a training client: "
                    f"{type(error).__name__}: {error}") from None


def _ray_config(table, address: str):
    """``--ray`` alone keeps the [ray] table's address (or starts a local Ray); ``--ray ADDRESS`` sets it."""
    from grooves.training.config import RayConfig

    table = table or RayConfig()
    return table.model_copy(update={"address": table.address if address == "local" else address})


def _resume_command(command: str, config: Path, *, out_dir: Path | None = None, runs: Path | None = None) -> str:
    """The command that continues this run, with the folders given: what a paused or interrupted run prints."""
    import shlex

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
    from grooves.workflows.probe import heldout_rose, probe_config

    if not config.is_file():
        raise _fail(f"config file {config} does not exist")
    try:
        cfg = probe_config(load_config(config), steps)
    except ConfigError as error:
        raise _fail(f"invalid config {config}:\n{error}") from None
    try:
        run = run_config(cfg, runs=runs, resume=resume, acknowledge=tuple(ack or ()), stop_rule=heldout_rose(),
                         resume_command=_resume_command("probe", config, runs=runs), console=out)
    except _user_errors() as error:
        raise _fail(str(error)) from None
    except KeyboardInterrupt:
        err.print("aborted; the newest checkpoint is intact")
        raise typer.Exit(130) from None
    why = run.halt_reason or f"the budget of {cfg.steps} steps is spent"
    out.print(f"[bold]{run.name}[/]: probed {run.step} steps; stopped because {why}", highlight=False)
    review(run.name, step=[run.step], k=k, runs=runs_root(runs))
    out.print(f"Next: label what you see (grooves review {run.name} --label), add a guard for a hack "
              f"(grooves guard suggest {run.name}), or train long (grooves train {config}).", highlight=False)
    if run.halted_by in ("failed", "interrupt"):
        _exit_for(run)
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
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress lines on stderr.")] = False,
) -> None:
    """Generate completions of PROMPT with a base model or a checkpoint.

    The completions go to stdout; what it is doing (loading, generating) goes to stderr.
    """
    from grooves.policy import Policy, Sampling
    from grooves.progress import Reporter

    progress = Reporter(err, enabled=not quiet)
    try:
        progress.phase("loading", f"model {model}")
        policy = Policy.load(model, runs=runs)
        sampling = Sampling(temperature=temperature, top_p=top_p or 1.0, max_new_tokens=max_tokens, seed=seed)
    except (*_user_errors(), ValueError) as error:
        raise _fail(str(error)) from None
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    progress.phase("generating", f"{n} completion{'s' if n > 1 else ''} of at most {max_tokens} new tokens")
    for i, completion in enumerate(policy.sampler().generate([messages], n=n, sampling=sampling)[0]):
        if n > 1:
            out.print(f"[dim]--- {i + 1} ({completion.finish_reason}, {len(completion.token_ids)} tokens)[/]")
        out.print(completion.text, highlight=False, markup=False)


@app.command("runs")
def list_runs(runs: RunsOption = None) -> None:
    """List runs with their last step, newest checkpoint and rewards.

    "val reward" is the newest held-out evaluation, with the step it was measured at. A
    checkpoint that fails verification (a damaged or truncated file) is marked corrupt, with
    the newest complete one beside it.
    """
    from rich.table import Table

    from grooves.policy.checkpoints import runs_root
    from grooves.runs.store import read_metrics

    root = runs_root(runs)
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    folders = [p for p in folders if (p / "metrics.jsonl").exists()]
    if not folders:
        out.print(f"no runs under {root}")
        return
    table = Table("run", "last step", "checkpoint", "reward", "val reward (at step)", title=f"runs in {root}")
    for folder in folders:
        rows = read_metrics(folder / "metrics.jsonl")
        last_train = next((r for r in reversed(rows) if r.get("reward/total") is not None), {})
        last_val = next((r for r in reversed(rows) if r.get("val/reward/total") is not None), None)
        val = f"{num(last_val['val/reward/total'])} (step {last_val['step']})" if last_val else "-"
        table.add_row(folder.name, str(rows[-1]["step"] if rows else "-"), _checkpoint_cell(folder),
                      num(last_train.get("reward/total")), val)
    out.print(table)


def _checkpoint_cell(folder: Path) -> str:
    """The newest checkpoint, or which newer ones are corrupt and the newest complete one."""
    from grooves.policy.checkpoints import list_checkpoints, newest_complete

    if not list_checkpoints(folder):
        return "-"
    newest, corrupt = newest_complete(folder)
    complete = f"{folder.name}@{newest[0]}" if newest else "none complete"
    if not corrupt:
        return complete
    steps = ", ".join(str(step) for step, _ in corrupt)
    return f"{complete} (step {steps} corrupt)"


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Base model spec served, with its adapters.")] = "bundled:smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port).")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="GROOVES_API_KEY",
                                                help="Require 'Authorization: Bearer KEY' on every route but "
                                                     "/health. Prefer $GROOVES_API_KEY: an option shows in ps.")] = None,
    adapter: Annotated[list[str] | None, typer.Option(help="Serve a checkpoint under an alias: "
                                                      "ALIAS=RUN@STEP (repeatable).")] = None,
    max_batch: Annotated[int, typer.Option(min=1, help="Most samples decoded in one batch.")] = 32,
    max_queue: Annotated[int, typer.Option(min=1, help="Queued requests before answering 429.")] = 64,
    max_adapters: Annotated[int, typer.Option(min=1, help="Adapters kept loaded at once.")] = 8,
    max_body_bytes: Annotated[int, typer.Option(min=1024, help="Largest request body accepted (413 beyond).")]
    = 1 << 20,
    runs: RunsOption = None,
) -> None:
    """Serve the base model and the runs' checkpoints over an OpenAI-compatible HTTP API."""
    import logging

    from grooves.serve.adapters import UnknownModel
    from grooves.serve.app import bind, build_server, serve_forever

    aliases = {}
    for item in adapter or []:
        alias, sep, checkpoint = item.partition("=")
        if not sep:
            raise _fail(f"--adapter {item!r}: use ALIAS=RUN@STEP")
        aliases[alias] = checkpoint
    try:  # the port first: a busy one fails in a second, not after the model has loaded
        sock = bind(host, port)
    except OSError as error:
        raise _fail(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    try:
        server = build_server(model, runs=runs, api_key=api_key, aliases=aliases, max_batch_rows=max_batch,
                              max_queue=max_queue, max_loaded=max_adapters, max_body_bytes=max_body_bytes)
    except (*_user_errors(), UnknownModel, ValueError) as error:
        sock.close()
        raise _fail(str(error)) from None
    handler = logging.StreamHandler()  # stderr: one line per request
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    requests_log = logging.getLogger("grooves.serve")
    requests_log.addHandler(handler)
    requests_log.setLevel(logging.INFO)
    bound_host, bound_port = sock.getsockname()[:2]
    err.print(f"[bold]grooves[/]: serving {model} and the checkpoints under {server.registry.runs} "
              f"on http://{bound_host}:{bound_port}/v1", highlight=False)
    serve_forever(server, sock)


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
    """RL-train the bundled model to write titles; print held-out reward before and after.

    Progress goes to stdout with the report, so `grooves demo > log` logs one line per step.
    """
    from grooves.demo import print_report, run_demo

    try:
        result = run_demo(steps=steps, runs=runs, console=out)
    except _user_errors() as error:
        raise _fail(str(error)) from None
    print_report(result, out)


def _register_groups() -> None:
    from grooves.cli import backend, base, dashboard, drift, envs, evals, review, rewards, rm, sft

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
