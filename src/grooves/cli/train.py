"""``grooves train``, ``grooves probe`` and ``grooves demo``: RL runs from a config, a short probe, the demo."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _exit_for, _fail, _resume_command, _user_errors, err, num, out


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
                                            help="Sample on Ray rollout workers (the [ray] table of the "
                                            "config): alone (or 'local'), a local Ray instance (or the table's "
                                            "address); with ADDRESS (HOST:PORT of `ray start --head`, or 'auto'), "
                                            "that cluster. See docs/scale.md.")] = None,
) -> None:
    """RL-train a LoRA adapter as CONFIG describes; checkpoints go to the run folder.

    Progress goes to stdout: on a terminal a bar with the phase and the time left; to a file
    or a pipe one line per step.

    Exit codes: 0 the run finished its steps; 1 the run failed (train.max_failed_steps steps in a row
    trained nothing); 2 bad input (config, files, a run another process is training); 3 a
    reward-hacking alert paused or stopped the run (the [alerts] section); 130 Ctrl-C (after saving a
    checkpoint).
    """
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
    policy, trainer = _remote_policy(cfg, resume) if cfg.backend is not None else (None, None)
    try:
        run = run_config(cfg, runs=runs, out=out_dir, resume=resume, progress=not quiet, acknowledge=tuple(ack or ()),
                         resume_command=_resume_command("train", config, out_dir=out_dir, runs=runs)
                         + ("" if ray is None else " --ray" + ("" if ray == "local" else f" {shlex.quote(ray)}")),
                         console=out, policy=policy, trainer=trainer)
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
    """The [backend] service's policy and its trainer class (grooves.backend.client), or a clear error."""
    if resume:
        raise _fail("--resume: a run trained through [backend] cannot be resumed yet (its adapter is a saved "
                    "state on the service; see docs/backend.md)")
    try:
        from grooves.backend.client import RemoteError, RemotePolicy, RemoteTrainer, check_remote
    except ImportError:
        raise _fail("[backend] needs the tinker SDK: pip install 'grooves[backend]'") from None
    try:
        check_remote(cfg)
    except RemoteError as error:
        raise _fail(f"invalid config:\n{error}") from None
    url = cfg.backend.url
    try:
        policy = RemotePolicy(url, cfg.backend.model or cfg.model.spec, cfg.backend.rank or cfg.lora.rank, cfg.seed)
    except Exception as error:  # the SDK's connection, auth and refusal errors: say which service said what
        raise _fail(f"backend.url: the service at {url} could not start a training client: "
                    f"{type(error).__name__}: {error}") from None
    return policy, RemoteTrainer


def _ray_config(table, address: str):
    """``--ray`` alone keeps the [ray] table's address (or starts a local Ray); ``--ray ADDRESS`` sets it."""
    from grooves.training.placement import RayConfig

    table = table or RayConfig()
    return table.model_copy(update={"address": table.address if address == "local" else address})


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
