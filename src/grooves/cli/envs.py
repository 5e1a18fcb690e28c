"""``grooves env list`` and ``grooves env try``: the registered agent environments, and one
rollout of one printed as a transcript (tool calls, results, the answer and the scores).

``try`` runs the same rollout code as training (``grooves.envs.rollout``) with the model's
own sampler, so what it prints is what a training step would see. See docs/envs.md.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from grooves.cli.common import RunsOption, _fail, _user_errors, out

app = typer.Typer(help="Agent environments: list them, try one rollout.", no_args_is_help=True)

ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "yellow"}


@app.command("list")
def list_envs() -> None:
    """The registered environments (built-in and from installed packages), with their tools."""
    from grooves.envs import available, env_class

    table = Table("env", "description", "tools", "scores (weight)", "source")
    for name, where in sorted(available().items()):
        try:
            cls = env_class(name)
        except Exception as error:  # a broken third-party env is shown, not fatal
            table.add_row(name, f"[red]cannot load: {escape(str(error))}[/]", "", "", where)
            continue
        tools = ", ".join(t.name for t in cls().tool_list)
        scores = ", ".join(f"{k} ({v:g})" for k, v in cls.weights.items())
        table.add_row(name, cls.description, tools, scores, where)
    out.print(table)


@app.command("try")
def try_env(
    name: Annotated[str, typer.Argument(help="Env name (see grooves env list).")],
    model: Annotated[str, typer.Option(help="Model spec or checkpoint RUN@STEP.")] = "bundled:smollm2-135m-instruct",
    seed: Annotated[int, typer.Option(help="Picks the task (and seeds the env's own randomness).")] = 0,
    split: Annotated[str, typer.Option(help="Task split: train or heldout.")] = "heldout",
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    turn_tokens: Annotated[int, typer.Option(min=1, help="New tokens per model turn.")] = 256,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Env setting KEY=VALUE (JSON "
                                                     "values), e.g. -o max_turns=4; repeatable.")] = None,
    show_system: Annotated[bool, typer.Option(help="Also print the system prompt (with the tools).")] = False,
    runs: RunsOption = None,
) -> None:
    """Run one rollout of NAME and print the transcript: every turn, tool call and result, the
    answer, and the env's score components with the weighted total."""
    import torch

    from grooves.envs import load_env
    from grooves.envs.rollout import env_groups, sampler_generate
    from grooves.policy.policy import Policy

    if split not in ("train", "heldout"):
        raise _fail(f"--split {split!r}: allowed: train, heldout")
    try:
        env = load_env(name, **_options(option or []))
    except (KeyError, ValueError, TypeError) as error:
        raise _fail(str(error.args[0] if error.args else error)) from None
    tasks = env.tasks(split, seed + 1, seed=0)
    task = tasks[seed % len(tasks)]
    try:
        policy = Policy.load(model, runs=runs)
    except _user_errors() as error:
        raise _fail(str(error)) from None
    generator = torch.Generator().manual_seed(seed)
    with out.status(f"rolling out {name} task {task.get('id')} ..."):
        [group] = env_groups(policy, env, [task], 1, sampler_generate(policy, temperature, 1.0, generator),
                             turn_tokens, seed=seed)
    trajectory = group.trajectories[0]
    show_transcript(trajectory.messages, show_system)
    state = trajectory.metadata["state"]
    scores = trajectory.metadata["env_scores"]
    total = sum(env.weights.get(k, 0.0) * v for k, v in scores.items())
    out.print(f"[bold]{name}[/] · task {escape(str(task.get('id')))} · ended by {state['finish']} after "
              f"{state['turns']} turns · {sum(trajectory.completion_mask)} model tokens", highlight=False)
    table = Table("score", "value", "weight")
    for key, value in scores.items():
        table.add_row(key, f"{value:.3f}", f"{env.weights.get(key, 0.0):g}")
    table.add_row("[bold]total[/]", f"[bold]{total:.3f}[/]", "")
    out.print(table)
    counters = {k: v for k, v in state["counters"].items() if k.startswith("tool_errors") or k == "tool_calls"}
    out.print(f"counters: {json.dumps(counters)}", highlight=False)


def show_transcript(messages: list[dict], show_system: bool = False) -> None:
    for message in messages:
        role = message.get("role", "?")
        if role == "system" and not show_system:
            continue
        text = message.get("raw", message.get("content") or "")
        title = role if role != "tool" else f"tool · {message.get('name', '')}"
        out.print(Panel(escape(text) or "[dim](empty)[/]", title=title, title_align="left",
                        border_style=ROLE_STYLES.get(role, "white")))


def _options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise _fail(f"--option {pair!r}: write KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options
