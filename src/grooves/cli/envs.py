"""``grooves env list`` and ``grooves env try``: the registered agent environments, and one
rollout of one printed as a transcript (tool calls, results, the answer and the scores).

``try`` runs the same rollout code as training (``grooves.envs.rollout``) with the model's
own sampler, so what it prints is what a training step would see. NAME may also be a class
in a file (``my_env.py:Shop``). See docs/envs.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from grooves.cli.common import RunsOption, _fail, _user_errors, err, out

app = typer.Typer(help="Agent environments: list them, try one rollout, replay a script, write demonstrations.",
                  no_args_is_help=True)

ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "yellow"}
UserOption = Annotated[str | None, typer.Option(help="Who answers text turns, as a config's [env] user: 'scripted' "
                                                "(the task's user_turns) or a JSON table, e.g. '{\"kind\": "
                                                "\"llm\", \"base_url\": \"...\", \"model\": \"...\"}'.")]


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
    name: Annotated[str, typer.Argument(help="Env name (see grooves env list), or a class in a file: "
                                        "my_env.py:Shop.")],
    model: Annotated[str, typer.Option(help="Model spec or checkpoint RUN@STEP.")] = "bundled:smollm2-135m-instruct",
    seed: Annotated[int, typer.Option(help="Picks the task (and seeds the env's own randomness).")] = 0,
    split: Annotated[str, typer.Option(help="Task split: train or heldout.")] = "heldout",
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    turn_tokens: Annotated[int, typer.Option(min=1, help="New tokens per model turn.")] = 256,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Env setting KEY=VALUE (JSON "
                                                     "values), e.g. -o max_turns=4; repeatable.")] = None,
    show_system: Annotated[bool, typer.Option(help="Also print the system prompt (with the tools).")] = False,
    user: UserOption = None,
    max_prompt_length: Annotated[int, typer.Option(min=1, help="The limit a run would have (sampling."
                                                   "max_prompt_length): a longer first prompt is flagged.")] = 1024,
    runs: RunsOption = None,
) -> None:
    """Run one rollout of NAME and print the transcript: every turn, tool call and result, the
    answer, and the env's score components with the weighted total.

    Progress (loading the model, each turn, scoring) goes to stderr, a line per phase."""
    import torch

    from grooves.policy.policy import Policy

    if split not in ("train", "heldout"):
        raise _fail(f"--split {split!r}: allowed: train, heldout")
    env = _load(name, option, user)
    tasks = env.tasks(split, seed + 1, seed=0)
    task = tasks[seed % len(tasks)]
    from grooves.progress import Reporter

    progress = Reporter(err)
    progress.phase("loading", f"model {model}")
    try:
        policy = Policy.load(model, runs=runs)
    except _user_errors() as error:
        raise _fail(str(error)) from None
    generator = torch.Generator().manual_seed(seed)
    trajectory = roll_out(policy, env, task, seed, temperature, generator, turn_tokens, progress, max_prompt_length)
    show_transcript(trajectory.messages, show_system)
    state = trajectory.metadata["state"]
    scores = trajectory.metadata["env_scores"]
    # A turn cut by its token budget is closed by an inserted end-of-turn token (mask 0).
    answer_cut = state["finish"] == "answer" and trajectory.completion_mask[-1] == 0
    how = ending(env, state, turn_tokens if answer_cut else None)
    out.print(f"[bold]{escape(name)}[/] · task {escape(str(task.get('id')))} · {how} · "
              f"{sum(trajectory.completion_mask)} model tokens", highlight=False, soft_wrap=True)
    show_scores(env, scores, state["counters"], state["data"])


def show_scores(env, scores: dict[str, float], counters: dict, data: dict) -> None:
    """The score table with the weighted total, the tool counters, and any bug in the env's own code."""
    table = Table("score", "value", "weight")
    for key, value in scores.items():
        table.add_row(key, f"{value:.3f}", f"{env.weights.get(key, 0.0):g}")
    total = sum(env.weights.get(k, 0.0) * v for k, v in scores.items())
    table.add_row("[bold]total[/]", f"[bold]{total:.3f}[/]", "")
    out.print(table)
    shown = {k: v for k, v in counters.items()
             if k.startswith(("tool_errors", "user")) or k in ("tool_calls", "user_turns")}
    out.print(f"counters: {json.dumps(shown)}", highlight=False)
    if data.get("env_bugs"):  # the env author's mistake, not the model's: said loudly
        out.print(Panel(escape("\n".join(data["env_bugs"])), title="bug in the env's own code (tool_errors/env_bug)",
                        border_style="bold red"))


@app.command("replay")
def replay_env(
    name: Annotated[str, typer.Argument(help="Env name, or a class in a file: my_env.py:Shop.")],
    task_id: Annotated[str, typer.Option("--task", help="The task's id (train or held-out).")],
    turns: Annotated[Path, typer.Option("--turns", help="A JSON list of assistant turns (strings; tool calls "
                                        "written <tool_call>{...}</tool_call>).")],
    seed: Annotated[int, typer.Option(help="Seeds the env's own randomness.")] = 0,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Env setting KEY=VALUE.")] = None,
    show_system: Annotated[bool, typer.Option(help="Also print the system prompt (with the tools).")] = False,
    user: UserOption = None,
) -> None:
    """Play scripted assistant turns through NAME, no model involved, and print the transcript and
    the env's scores: check an env's oracle, or a transcript, against its own scoring."""
    from grooves.envs.replay import replay

    env = _load(name, option, user)
    try:
        script = json.loads(turns.read_text())
    except (OSError, ValueError) as error:
        raise _fail(f"--turns {turns}: {error}") from None
    if not isinstance(script, list) or not all(isinstance(t, str) for t in script):
        raise _fail(f"--turns {turns}: must be a JSON list of strings, one per assistant turn")
    task = next((t for split in ("train", "heldout") for t in env.tasks(split) if str(t.get("id")) == task_id), None)
    if task is None:
        raise _fail(f"env {name} has no task {task_id!r}")
    result = replay(env, task, script, seed)
    show_transcript(result.messages, show_system)
    how = {"script_ended": "the script ended before an answer"}.get(result.finish) or ending(
        env, {"finish": result.finish, "turns": result.turns})
    out.print(f"[bold]{escape(name)}[/] · task {escape(task_id)} · {how}", highlight=False, soft_wrap=True)
    show_scores(env, result.scores, result.counters, result.data)


@app.command("demos")
def demos(
    name: Annotated[str, typer.Argument(help="Env name, or a class in a file: my_env.py:Shop.")],
    out_file: Annotated[Path, typer.Option("--out", help="JSONL file to write (one chat per line).")],
    split: Annotated[str, typer.Option(help="Task split: train (what SFT should use) or heldout.")] = "train",
    n: Annotated[int | None, typer.Option("--n", min=1, help="Tasks to demonstrate (default: all).")] = None,
    seed: Annotated[int, typer.Option(help="Picks and orders the tasks.")] = 0,
    base_url: Annotated[str | None, typer.Option(help="Collect from a model on this OpenAI-compatible endpoint "
                                                 "instead of the env's own demonstrations.")] = None,
    model: Annotated[str | None, typer.Option(help="With --base-url: the model name.")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="OPENAI_API_KEY", help="With --base-url: the key "
                                                "($OPENAI_API_KEY).")] = None,
    min_score: Annotated[float, typer.Option(help="With --base-url: keep rollouts whose weighted score (a share "
                                             "of the weights' sum) is at least this.")] = 1.0,
    temperature: Annotated[float, typer.Option(min=0.0, help="With --base-url: sampling temperature.")] = 0.0,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="Env setting KEY=VALUE.")] = None,
    user: UserOption = None,
) -> None:
    """Write demonstrations of NAME's tasks as chat JSONL for grooves sft: the env's expert
    transcripts replayed and kept only at full score, or a model's rollouts that score well enough."""
    from grooves.envs.replay import collect, demonstrations, endpoint_chat

    if split not in ("train", "heldout"):
        raise _fail(f"--split {split!r}: allowed: train, heldout")
    if base_url is not None and model is None:
        raise _fail("--base-url needs --model")
    env = _load(name, option, user)
    tasks = env.tasks(split, n, seed=seed)
    try:
        if base_url is None:
            kept, counts = demonstrations(env, tasks, seed)
        else:
            kept, counts = collect(env, tasks, endpoint_chat(base_url, model, api_key, temperature), min_score, seed)
    except NotImplementedError as error:
        raise _fail(f"{error}; collect from a model instead: --base-url URL --model NAME") from None
    except OSError as error:  # the endpoint could not be reached
        raise _fail(f"{base_url}: {error}") from None
    from grooves.runs.store import write_atomic

    out_file.parent.mkdir(parents=True, exist_ok=True)
    tools = env.tool_schemas() or None
    write_atomic(out_file, "".join(json.dumps({**r.record(), "tools": tools}) + "\n" for r in kept))
    details = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if k != "kept")
    out.print(f"{len(kept)} of {len(tasks)} {split} tasks written to {out_file} ({details})", highlight=False)
    if split == "heldout":
        err.print("[yellow]warning[/]: these are held-out tasks: train on them and the held-out score means nothing")


def _load(name: str, option: list[str] | None, user: str | None = None):
    from grooves.envs import load_env

    spec = None
    if user is not None:
        try:
            spec = json.loads(user) if user.lstrip().startswith("{") else user
        except json.JSONDecodeError as error:
            raise _fail(f"--user: not a JSON table: {error}") from None
    try:
        return load_env(name, user=spec, **_options(option or []))
    except (KeyError, ValueError, TypeError) as error:
        raise _fail(str(error.args[0] if error.args else error)) from None


def prompt_warnings(tokens: int, limit: int, budget: int | None) -> list[str]:
    """What is wrong with a first prompt of ``tokens`` tokens: over a run's ``max_prompt_length``
    (a run would skip the task), over the env's ``prompt_budget``."""
    said = []
    if tokens > limit:
        said.append(f"the prompt is {tokens} tokens, over sampling.max_prompt_length = {limit} "
                    f"(--max-prompt-length): a training run would skip this task")
    if budget is not None and tokens > budget:
        said.append(f"the prompt is {tokens} tokens, over the env's prompt_budget of {budget}")
    return said


def roll_out(policy, env, task, seed, temperature, generator, turn_tokens, progress, max_prompt_length=None):
    """One rollout by the training code (``grooves.envs.rollout``), turn by turn so that
    ``progress`` can say which turn is decoding; a first prompt too long to train on is said first."""
    from grooves.envs.rollout import advance, sampler_generate, start, trajectory
    from grooves.policy.context import model_context, over_context

    generate = sampler_generate(policy, temperature, 1.0, generator)
    state = start(policy, env, task, seed)
    tokens = len(state.tokens.prompt_ids)
    context = model_context(policy)
    said = over_context(f"task {task.get('id')}: the prompt (system, tools, task)", tokens, context)
    if said:  # said before minutes of decoding that could not mean anything
        env.close(state)
        raise _fail(said)
    for warning in prompt_warnings(tokens, max_prompt_length or context, getattr(env, "prompt_budget", None)):
        err.print(f"[yellow]warning[/]: {escape(warning)}", highlight=False, soft_wrap=True)
    try:
        while not env.is_done(state):
            progress.phase("rolling out", f"task {task.get('id')}, turn {state.turns + 1} of at most {env.max_turns}")
            advance(policy, env, [state], generate, turn_tokens)
        progress.phase("scoring")
        return trajectory(env, state)
    finally:
        env.close(state)


def ending(env, state: dict, answer_cut_at: int | None = None) -> str:
    """How the rollout ended, in words: an answer (``answer_cut_at``: the answer turn ran out
    of its ``--turn-tokens``), or cut at which budget."""
    turns = f"after {state['turns']} turn{'s' if state['turns'] != 1 else ''}"
    if state["finish"] == "max_turns":
        return f"cut at the turn budget (max_turns = {env.max_turns}) {turns}"
    if state["finish"] == "max_tokens":
        return f"cut at the token budget (max_tokens = {env.max_tokens}) {turns}"
    if answer_cut_at is not None:
        return f"ended by its answer {turns}, that turn cut at --turn-tokens {answer_cut_at}"
    return f"ended by its answer {turns}"


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
