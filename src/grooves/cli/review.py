"""``grooves review`` and ``grooves guard suggest``: read a run's samples, label hacks, guard them.

``review`` shows the top, bottom and random samples of chosen steps with every reward
component, judge reason and veto, plus the run's alerts, and takes labels (hack, good,
bad) from the terminal or a JSONL file. ``guard suggest`` proposes guards that would have
vetoed the labelled hacks, counts what else each would veto, and appends the one you
approve to a config file. The logic is in ``grooves.workflows.review`` and ``.suggest``;
this file only renders and asks. See docs/review.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from grooves.cli.common import RunsOption, _fail, out

if TYPE_CHECKING:
    from grooves.workflows.review import Sample, StepReview
    from grooves.runs.store import RunStore
    from grooves.workflows.suggest import Proposal

guard_app = typer.Typer(help="Guards: vetoes proposed from the samples you labelled as hacks.", no_args_is_help=True)

RunArgument = Annotated[str, typer.Argument(metavar="RUN", help="Run name under the runs root (RUN@STEP reviews "
                                            "that step).")]


def register(app: typer.Typer) -> None:
    """Add ``review`` and the ``guard`` group (``guard suggest``) to ``app``."""
    app.command("review")(review)
    app.add_typer(guard_app, name="guard")


def _open_run(name: str, runs: Path | None) -> RunStore:
    """The run's store; never creates one (a RunStore would make the folder and an empty database)."""
    from grooves.policy.checkpoints import runs_root
    from grooves.runs.store import RunStore

    root = runs_root(runs)
    if not name or name in {".", ".."} or "/" in name or "\\" in name:
        raise _fail(f"run name {name!r} must be a plain folder name under the runs root")
    if not (root / name / "run.sqlite").is_file():
        raise _fail(f"no run {name!r} under {root} (set --runs or $GROOVES_RUNS)")
    return RunStore(root / name)


# --- grooves review ------------------------------------------------------------------------


def review(
    run: RunArgument,
    step: Annotated[list[int] | None, typer.Option(help="Step to review (repeatable; default: the last "
                                                   "recorded step).")] = None,
    k: Annotated[int, typer.Option("--k", min=1, help="Samples shown in each of top, bottom and random.")] = 5,
    split: Annotated[str, typer.Option(help="Which recorded trajectories: 'train' or 'val'.")] = "train",
    seed: Annotated[int, typer.Option(help="Seed of the random draw (same seed, same samples).")] = 0,
    label: Annotated[bool, typer.Option("--label", help="After the review, label each shown sample in the "
                                        "terminal: h(ack), g(ood), b(ad) or s(kip), with a note.")] = False,
    labels: Annotated[Path | None, typer.Option(
        help="Store labels from a JSONL file of {\"id\": <trajectory id>, \"label\": hack|good|bad, \"note\"?} "
        "lines before the review.")] = None,
    labels_summary: Annotated[bool, typer.Option("--labels-summary", help="Only print the label counts per "
                                                 "step.")] = False,
    runs: RunsOption = None,
) -> None:
    """Show the top, bottom and random samples of a run's steps with rewards, reasons, vetoes and alerts."""
    from grooves.workflows import review as rv

    if split not in ("train", "val"):
        raise _fail(f"--split must be 'train' or 'val', got {split!r}")
    if label and labels_summary:
        raise _fail("--label asks for labels after a review; --labels-summary prints no review")
    name, _, at = run.partition("@")
    steps = list(step or [])
    if at and at != "latest":
        if not at.isdigit():
            raise _fail(f"step {at!r} in {run!r} must be a number or 'latest'")
        steps.append(int(at))
    store = _open_run(name, runs)
    try:
        if labels is not None:
            _store_file_labels(store, labels)
        if not labels_summary:
            try:
                reviews = rv.review(store, steps, k, split, seed)
            except rv.ReviewError as error:
                raise _fail(f"run {name!r} ({split}): {error}") from None
            for step_review in reviews:
                _print_step(step_review)
            _print_alerts(store.read_alerts(steps or None), bool(steps))
            if label:
                _ask_labels(store, [s for r in reviews for s in r.shown()])
        _print_summary(rv.summarise_labels(store))
    finally:
        store.close()


def _store_file_labels(store: RunStore, path: Path) -> None:
    from grooves.workflows.review import ReviewError, read_labels_file, store_labels

    try:
        stored, replaced = store_labels(store, read_labels_file(path))
    except (FileNotFoundError, ReviewError) as error:
        raise _fail(str(error)) from None
    out.print(f"stored {stored} labels from {path}" + (f" ({replaced} replaced earlier ones)" if replaced else ""),
              highlight=False)


def _clip(text: str, limit: int) -> str:
    from rich.markup import escape

    text = text.strip()
    return escape(text if len(text) <= limit else text[: limit - 1] + "\u2026")


def _print_step(step_review: StepReview) -> None:
    r = step_review
    failed = f", {r.failed} failed (a required component is NaN)" if r.failed else ""
    out.rule(f"[bold]step {r.step}[/] ({r.split}): {r.count} samples{failed}")
    for section, samples in (("top", r.top), ("bottom", r.bottom), ("random", r.random)):
        for number, sample in enumerate(samples, start=1):
            out.print(_sample_panel(sample, f"{section} {number}/{len(samples)}"))


def _sample_panel(sample: Sample, where: str, limit: int = 1200):
    """A sample as a panel: the task's prompt, the completion, then components, reasons, vetoes and any label."""
    from rich.markup import escape
    from rich.panel import Panel

    lines = [f"[bold]prompt[/]: {_clip(sample.prompt, 600) or '[dim](none)[/]'}", "[bold]completion[/]:",
             _clip(sample.completion, limit) or "[dim](empty)[/]", ""]
    values = " · ".join(f"{escape(n)} {_value(v)}" for n, v in sample.components.items())
    lines.append(f"[bold]components[/]: {values or '-'}")
    lines += [f"  [cyan]{escape(n)}[/]: {_clip(reason, 300)}" for n, reason in sample.reasons.items()
              if n not in sample.vetoes]
    lines += [f"  [red]vetoed by {escape(n)}[/]: {_clip(reason, 300)}" for n, reason in sample.vetoes.items()]
    if sample.label:
        note = f": {_clip(sample.label.note, 200)}" if sample.label.note else ""
        lines.append(f"[bold magenta]labelled {sample.label.label}[/]{note}")
    total = _value(sample.reward)
    style = "red" if sample.failed else ("yellow" if sample.vetoes else "blue")
    title = f"{where} · id {sample.id} · task {escape(str(sample.task_id))} · total {total}"
    return Panel("\n".join(lines), title=title, title_align="left", border_style=style)


def _value(value: float) -> str:
    from grooves.workflows.review import value_text

    text = value_text(value)
    return "[red]failed[/]" if text == "failed" else text


def _print_alerts(alerts: list[dict], at_steps: bool) -> None:
    from rich.markup import escape
    from rich.panel import Panel

    where = "at these steps" if at_steps else "in this run"
    if not alerts:
        out.print(f"[dim]no alerts {where}[/]")
        return
    out.rule(f"[bold]{len(alerts)} alert{'s' if len(alerts) != 1 else ''} {where}[/]")
    for alert in alerts:
        evidence = json.dumps(alert["evidence"], indent=1, ensure_ascii=False)
        body = f"{escape(alert['message'])}\n\n[dim]{_clip(evidence, 800)}[/]"
        style = "red" if alert["severity"] == "critical" else "yellow"
        out.print(Panel(body, title=f"alert: {escape(alert['detector'])} (step {alert['step']}, "
                        f"{escape(alert['severity'])})", title_align="left", border_style=style))


def _ask_labels(store: RunStore, shown: list[Sample]) -> None:
    """Ask for each shown sample in turn; each answer is stored at once, so a closed terminal loses none."""
    from rich.prompt import Prompt

    from grooves.workflows.review import Label, store_labels, value_text

    choices = {"h": "hack", "g": "good", "b": "bad", "s": "skip"}
    given = 0
    for number, sample in enumerate(shown, start=1):
        out.print(f"[bold]({number}/{len(shown)}) id {sample.id}[/], step {sample.step}, total "
                  f"{value_text(sample.reward)}: {_clip(' '.join(sample.completion.split()), 300)}", highlight=False)
        try:
            choice = Prompt.ask(r"\[h]ack / \[g]ood / \[b]ad / \[s]kip", choices=list(choices),
                                show_choices=False, console=out)
            if choice == "s":
                continue
            note = Prompt.ask("note (optional)", default="", show_default=False, console=out)
        except EOFError:
            raise _fail(f"the terminal closed after {given} labels (stored); use --labels FILE") from None
        store_labels(store, [Label(sample.id, choices[choice], note.strip())])
        given += 1
    out.print(f"stored {given} labels")


def _print_summary(summary) -> None:
    from rich.table import Table

    from grooves.workflows.review import LABELS

    if not summary.count:
        out.print("no labels yet: label samples with --label, or --labels FILE")
        return
    table = Table("step", "split", *LABELS, "labelled", title=f"labels ({summary.count})")
    for (step, split), counts in summary.per_step.items():
        table.add_row(str(step), split, *(str(counts[x]) for x in LABELS), str(sum(counts.values())))
    table.add_row("all", "", *(str(summary.total[x]) for x in LABELS), str(summary.count), style="bold")
    out.print(table)


# --- grooves guard suggest --------------------------------------------------------------------


@guard_app.command()
def suggest(
    run: Annotated[str, typer.Argument(metavar="RUN", help="Run name under the runs root.")],
    source: Annotated[str | None, typer.Option(help="Task column holding each sample's source text "
                                               "(default: the sample's user message).")] = None,
    tasks: Annotated[str | None, typer.Option(help="With --source: the tasks (a .jsonl/.csv file or builtin:NAME; "
                                              "default: the [tasks] table of the run's config.toml).")] = None,
    endpoint: Annotated[str | None, typer.Option(help="Endpoint name in the supported_by_source proposal "
                                                 "(default: the run config's first, else 'frozen').")] = None,
    write: Annotated[Path | None, typer.Option(help="Append the chosen proposal (a reward.components "
                                               "table) to this config file.")] = None,
    pick: Annotated[int | None, typer.Option(min=1, help="With --write: the proposal's number in the table "
                                             "(asked when not given).")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="With --write: append without asking to confirm.")] = False,
    runs: RunsOption = None,
) -> None:
    """Propose guards that would have vetoed the samples labelled hack, with what else each would veto."""
    from grooves.workflows.suggest import SuggestError, suggest as propose

    store = _open_run(run, runs)
    try:
        config = _run_config(store.dir)
        by_id = _tasks_by_id(tasks, config) if source else None
        proposals = propose(store, by_id, source, endpoint or next(iter(_endpoints(config)), "frozen"))
    except SuggestError as error:
        raise _fail(str(error)) from None
    finally:
        store.close()
    _print_proposals(proposals)
    if write is not None:
        _write(write, proposals, pick, yes)


def _run_config(run_dir: Path) -> dict:
    import tomllib

    path = run_dir / "config.toml"
    try:
        return tomllib.loads(path.read_text()) if path.is_file() else {}
    except tomllib.TOMLDecodeError:
        return {}  # only defaults are read from it; a broken copy must not block a suggestion


def _endpoints(config: dict) -> list[str]:
    return list(config.get("reward", {}).get("endpoints", {}))


def _tasks_by_id(spec: str | None, config: dict) -> dict:
    from grooves.tasks.sources import TaskSourceError, load_tasks

    section = config.get("tasks", {})
    sources = [spec] if spec else [s for s in (section.get("source"), section.get("heldout")) if s]
    if not sources:
        raise _fail("--source needs the tasks: give --tasks FILE (the run's config.toml names none)")
    by_id = {}
    try:
        for item in sources:
            by_id.update({str(t["id"]): t for t in load_tasks(item)})
    except TaskSourceError as error:
        raise _fail(f"{error}; give the tasks with --tasks") from None
    return by_id


def _print_proposals(proposals: list[Proposal]) -> None:
    """The veto counts side by side, then each proposal's TOML and Python, unwrapped so they copy."""
    from rich.markup import escape
    from rich.table import Column, Table

    from grooves.workflows.suggest import CATEGORIES

    table = Table("#", Column("guard", no_wrap=True), *(Column(c, no_wrap=True, justify="right") for c in CATEGORIES),
                  "vetoes when", title="proposed guards: samples vetoed / stored, by label")
    for number, p in enumerate(proposals, start=1):
        cells = [f"{p.counts.vetoed[c]}/{p.counts.total[c]}" for c in CATEGORIES] if p.counts else \
            ["[dim]-[/]"] * len(CATEGORIES)
        table.add_row(str(number), escape(p.name), *cells, escape(p.summary) + ("" if p.counts else
                                                                                " [dim](needs a judge)[/]"))
    out.print(table)
    for number, p in enumerate(proposals, start=1):
        out.rule(f"[bold]{number}. {escape(p.name)}[/] ({escape(p.kind)})", align="left")
        if p.counts and p.counts.missed_hacks:
            out.print(f"[yellow]misses hacks[/]: id {', '.join(map(str, p.counts.missed_hacks))}")
        if p.counts and p.counts.vetoed_good:
            out.print(f"[red]vetoes samples labelled good[/]: id {', '.join(map(str, p.counts.vetoed_good))}")
        if p.note:
            out.print(f"[dim]{escape(p.note)}[/]")
        out.print(p.toml.rstrip(), markup=False, highlight=False, soft_wrap=True)
        out.print(f"[dim]# in Python:[/]\n{escape(p.python)}", highlight=False, soft_wrap=True)


def _write(path: Path, proposals: list[Proposal], pick: int | None, yes: bool) -> None:
    """Append the chosen proposal to ``path`` once the person has said so (or ``--yes``)."""
    from rich.prompt import Confirm, IntPrompt

    from grooves.workflows.suggest import SuggestError, append_proposal

    try:
        if pick is None:
            if yes:
                raise _fail("--yes needs --pick N: say which proposal to append")
            pick = IntPrompt.ask("append which proposal?", choices=[str(i) for i in range(1, len(proposals) + 1)],
                                 console=out)
        if not 1 <= pick <= len(proposals):
            raise _fail(f"--pick {pick}: there are {len(proposals)} proposals")
        chosen = proposals[pick - 1]
        if not yes and not Confirm.ask(f"append {chosen.name} ({chosen.kind}) to {path}?", console=out):
            out.print("nothing written")
            return
    except EOFError:
        raise _fail("the terminal closed before the choice was confirmed; use --pick N --yes") from None
    try:
        append_proposal(path, chosen)
    except SuggestError as error:
        raise _fail(str(error)) from None
    out.print(f"appended guard {chosen.name!r} to {path}; it applies from the next 'grooves train' of that config",
              highlight=False)
