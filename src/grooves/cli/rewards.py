"""``grooves rubric`` and ``grooves judge``: write down what good means, then check the judge.

``rubric interview`` asks a few questions and writes a rubric file; ``rubric show`` renders
one; ``judge calibrate`` scores a batch with the rubric's judge, takes the user's verdicts
on the top and bottom outputs and keeps the agreement per rubric version; ``judge calibrate
--attacks`` runs the built-in attack set against the judge and guards instead
(``grooves.cli.attack_check``). See docs/rubrics.md for the file formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _user_errors, err, out

if TYPE_CHECKING:
    from grooves.rewards.calibrate import Sample, Scored, Verdict
    from grooves.rewards.client import Endpoint
    from grooves.rewards.rubric import Rubric
    from grooves.rewards.calibration_store import CalibrationStore

rubric_app = typer.Typer(help="Rubrics: what good and bad outputs look like, as a small TOML file.",
                         no_args_is_help=True)
judge_app = typer.Typer(help="LLM judges: calibrate a judge against your own verdicts.", no_args_is_help=True)

UrlOption = Annotated[str | None, typer.Option(
    "--endpoint-url", envvar="GROOVES_JUDGE_URL",
    help="OpenAI-compatible endpoint of the model, e.g. http://127.0.0.1:8000/v1 ($GROOVES_JUDGE_URL); "
    "'local': a grooves server over --model started here, as base_url = \"local\" in a config.")]
ModelOption = Annotated[str | None, typer.Option(
    "--model", envvar="GROOVES_JUDGE_MODEL", help="Model name sent to the endpoint ($GROOVES_JUDGE_MODEL).")]
KeyOption = Annotated[str, typer.Option(
    "--api-key-env", help="Environment variable holding the endpoint's API key (local servers need none).")]


def _endpoint(url: str | None, model: str | None, api_key_env: str, **options) -> Endpoint | None:
    from grooves.rewards.client import Endpoint

    if url is None:
        return None
    if not model:
        raise _fail("--model is needed with --endpoint-url (the model name sent with each request)")
    if url == "local":
        url = _local_url(model)
    return Endpoint(base_url=url, model=model, api_key_env=api_key_env or None, **options)


def _local_url(model: str) -> str:
    """``local`` means here what it means in a config: a grooves server over MODEL in this process."""
    from grooves.serve.adapters import UnknownModel
    from grooves.serve.local import local_url

    try:
        return local_url(model)
    except (*_user_errors(), UnknownModel, ValueError) as error:
        raise _fail(f"--endpoint-url local: cannot serve --model {model!r}: {error}") from None


def _load_rubric(path: Path) -> Rubric:
    from grooves.rewards.rubric import Rubric, RubricError

    try:
        return Rubric.load(path)
    except RubricError as error:
        raise _fail(str(error)) from None


# --- grooves rubric ------------------------------------------------------------------------


@rubric_app.command()
def interview(
    task: Annotated[str, typer.Option(help="The task in a sentence, e.g. 'Write a headline for a news story'.")],
    out_path: Annotated[Path, typer.Option("--out", help="Rubric file to write (TOML).")],
    answers: Annotated[Path | None, typer.Option(
        help="Take the answers from this file instead of the terminal: a JSON list, a TOML "
        "'answers = [...]', or text with a blank line between answers (see docs/rubrics.md).")] = None,
    endpoint_url: UrlOption = None,
    model: ModelOption = None,
    api_key_env: KeyOption = "OPENAI_API_KEY",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Ask about the task and what good and bad outputs look like; write the rubric file."""
    from rich.markup import escape

    from grooves.rewards.interview import SKELETON, interview as run_interview, read_answers

    if not task.strip():
        raise _fail("--task must say what the task is")
    if out_path.exists() and not overwrite:
        raise _fail(f"{out_path} exists; pass --overwrite to replace it")
    scripted = None
    if answers is not None:
        try:
            scripted = iter(read_answers(answers))
        except (FileNotFoundError, ValueError) as error:
            raise _fail(str(error)) from None
    endpoint = _endpoint(endpoint_url, model, api_key_env, timeout=60.0, max_retries=1, backoff=0.2,
                         max_tokens=300)

    def answer(topic, question: str) -> str:
        index = [t.key for t in SKELETON].index(topic.key) + 1
        out.print(f"[bold cyan]({index}/{len(SKELETON)})[/] {escape(question)}", highlight=False)
        if scripted is not None:
            reply = next(scripted)
            out.print(f"[dim]> {escape(reply)}[/]", highlight=False)
            return reply
        from rich.prompt import Prompt

        try:
            return Prompt.ask(">", console=out, default="", show_default=False)
        except EOFError:
            raise _fail("the terminal closed before every question was answered; use --answers FILE") from None

    def warn(message: str) -> None:
        err.print(f"[yellow]warning[/]: {escape(message)}", highlight=False)

    rubric = run_interview(task, answer, endpoint, warn)
    rubric.save(out_path)
    names = ", ".join(c.name for c in rubric.criteria) or "none"
    out.print(f"wrote {out_path} (version {rubric.version}; criteria: {escape(names)}); "
              f"edit it freely, then check the judge with 'grooves judge calibrate'", highlight=False)


@rubric_app.command()
def show(
    rubric_path: Annotated[Path, typer.Argument(metavar="RUBRIC", help="Rubric file (TOML).")],
    prompt: Annotated[bool, typer.Option("--prompt", help="Print the exact text the judge reads instead.")] = False,
) -> None:
    """Render a rubric: task, good and bad, weighted criteria, examples and its version."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    rubric = _load_rubric(rubric_path)
    if prompt:
        out.print(rubric.as_prompt(), markup=False, highlight=False)
        return
    lines = [f"[bold]Task[/]: {escape(rubric.task)}"]
    if rubric.good:
        lines.append(f"[bold green]Good[/]: {escape(rubric.good)}")
    if rubric.bad:
        lines.append(f"[bold red]Bad[/]: {escape(rubric.bad)}")
    out.print(Panel("\n\n".join(lines), title=f"{escape(rubric_path.name)}  version {rubric.version}"))
    if rubric.criteria:
        total = sum(c.weight for c in rubric.criteria)
        table = Table("criterion", "weight", "share", "what it means", title="criteria")
        for c in rubric.criteria:
            table.add_row(escape(c.name), f"{c.weight:g}", f"{c.weight / total:.0%}", escape(c.description))
        out.print(table)
    if rubric.examples:
        table = Table("kind", "output", "note", title="examples")
        for e in rubric.examples:
            colour = "green" if e.kind == "good" else "red"
            table.add_row(f"[{colour}]{e.kind}[/]", escape(e.output), escape(e.note))
        out.print(table)


# --- grooves judge calibrate ------------------------------------------------------------------


@judge_app.command()
def calibrate(
    rubric_path: Annotated[Path, typer.Option("--rubric", help="Rubric file (TOML) the judge scores with.")],
    samples: Annotated[str, typer.Option(
        help="A JSONL file of {\"input\", \"output\", \"id\"?} lines, or a run: RUN (its last step), "
        "RUN@latest or RUN@STEP, whose recorded trajectories are judged.")],
    endpoint_url: UrlOption = None,
    model: ModelOption = None,
    api_key_env: KeyOption = "OPENAI_API_KEY",
    top: Annotated[int, typer.Option(min=0, help="Highest-scored outputs to show.")] = 5,
    bottom: Annotated[int, typer.Option(min=0, help="Lowest-scored outputs to show.")] = 5,
    verdicts: Annotated[Path | None, typer.Option(
        help="Verdicts from a JSONL file of {\"id\", \"verdict\": agree|disagree|skip, \"note\"?} lines "
        "instead of asking in the terminal.")] = None,
    history: Annotated[bool, typer.Option("--history", help="Only print past agreement per rubric version.")] = False,
    split: Annotated[str, typer.Option(help="Which recorded trajectories of a run: 'train' or 'val'.")] = "train",
    runs: RunsOption = None,
    attacks: Annotated[bool, typer.Option(
        "--attacks", help="Instead of asking for verdicts, run the built-in attack set (docs/reward_hacking.md) "
        "against the judge and the guards; print which attacks raised the score or passed the guards.")] = False,
    attack_samples: Annotated[int, typer.Option(min=1, help="With --attacks: how many samples to attack.")] = 2,
    guards_config: Annotated[Path | None, typer.Option(
        "--guards-config", help="With --attacks: a run config whose [reward] guards are checked "
        "(default: the injection guard).")] = None,
) -> None:
    """Score a batch with the rubric's judge, record your verdicts on the top and bottom, report agreement.

    With --attacks: check how the judge and guards hold against the built-in attacks instead."""
    from grooves.rewards import calibrate as cal

    rubric = _load_rubric(rubric_path)
    batch, source, store = _batch(samples, rubric_path, runs, split)
    try:
        if history:
            _print_history(store, rubric.version)
            return
        endpoint = _endpoint(endpoint_url, model, api_key_env)
        if endpoint is None:
            raise _fail("the judge needs an endpoint: --endpoint-url URL --model NAME (or $GROOVES_JUDGE_URL)")
        if attacks:
            from grooves.cli.attack_check import config_guards, run_attack_check

            run_attack_check(cal.rubric_judge(rubric, endpoint), config_guards(guards_config), batch, attack_samples)
            return
        given = None
        if verdicts is not None:
            try:
                given = cal.load_verdicts(verdicts, batch)
            except (FileNotFoundError, cal.CalibrationError) as error:
                raise _fail(str(error)) from None
        scored = cal.score_samples(cal.rubric_judge(rubric, endpoint), batch)
        best, worst = cal.pick(scored, top, bottom)
        _print_scores(best, worst, [s for s in scored if s.failed])
        if scored and all(s.failed for s in scored):  # nothing to agree with: not a calibration to keep
            raise _fail(f"the judge ({endpoint.model} @ {endpoint.base_url}) failed on all {len(scored)} samples; "
                        f"nothing recorded. First error: {scored[0].reason}")
        given = given if given is not None else _ask_verdicts(best + worst)
        counts = cal.agreement(scored, given)
        failed = sum(s.failed for s in scored)
        store.record({"rubric_version": rubric.version, "rubric_path": str(rubric_path), "samples": source,
                      "judge": f"{endpoint.model} @ {endpoint.base_url}", "scored": len(scored) - failed,
                      "failed": failed, "agree": counts.agree, "disagree": counts.disagree,
                      "skipped": counts.skipped, "on_failed": counts.on_failed, "agreement": counts.rate},
                     cal.verdict_rows(scored, given))
        _print_agreement(counts, failed, rubric.version, store)
    finally:
        store.close()


Batch = tuple[list["Sample"], str, "CalibrationStore"]


def _batch(spec: str, rubric_path: Path, runs: Path | None, split: str) -> Batch:
    """The samples, a label for where they came from, and the store their verdicts go to."""
    from grooves.rewards.calibrate import CalibrationError, load_samples
    from grooves.rewards.calibration_store import CalibrationStore

    path = Path(spec)
    if path.is_file() or spec.endswith((".jsonl", ".json")) or "/" in spec or "\\" in spec:
        try:
            batch = load_samples(path)
        except (FileNotFoundError, CalibrationError) as error:
            raise _fail(str(error)) from None
        return batch, str(path), CalibrationStore(rubric_path.with_suffix(".calibration.sqlite"))
    return _run_batch(spec, runs, split)


def _run_batch(spec: str, runs: Path | None, split: str) -> Batch:
    from grooves.policy.checkpoints import runs_root
    from grooves.rewards.calibrate import samples_from_trajectories
    from grooves.rewards.calibration_store import CalibrationStore
    from grooves.runs.store import RunStore

    name, _, step_text = spec.partition("@")
    root = runs_root(runs)
    if not name or name in {".", ".."} or not (root / name / "run.sqlite").is_file():
        raise _fail(f"--samples {spec!r}: no such samples file, and no run {name!r} under {root} "
                    "(set --runs or $GROOVES_RUNS)")
    store = RunStore(root / name)
    try:
        steps = store.trajectory_steps(split)
        if not steps:
            raise _fail(f"run {name!r} has no recorded {split} trajectories")
        if step_text in ("", "latest"):
            step = steps[-1]
        elif step_text.isdigit() and int(step_text) in steps:
            step = int(step_text)
        else:
            raise _fail(f"run {name!r} has no {split} trajectories at step {step_text!r}; "
                        f"recorded steps: {steps[0]} to {steps[-1]}")
        batch = samples_from_trajectories(store.read_trajectories(step, split))
        return batch, f"{name}@{step}", CalibrationStore(store.dir / "run.sqlite")
    finally:
        store.close()


def _clip(text: str, limit: int = 240) -> str:
    from rich.markup import escape

    text = " ".join(text.split())
    return escape(text if len(text) <= limit else text[: limit - 1] + "\u2026")


def _print_scores(best: list[Scored], worst: list[Scored], failed: list[Scored]) -> None:
    """Top and bottom with scores and reasons; failures as 'failed' with the error, never as a number."""
    from rich.table import Table

    for title, rows in (("top", best), ("bottom", worst)):
        if rows:
            table = Table("id", "score", "output", "judge's reason", title=f"{title} {len(rows)}")
            for s in rows:
                table.add_row(_clip(s.sample.id, 40), f"{s.score:.2f}", _clip(s.sample.output), _clip(s.reason))
            out.print(table)
    if failed:
        table = Table("id", "score", "error", title=f"judge failed on {len(failed)}")
        for s in failed:
            table.add_row(_clip(s.sample.id, 40), "[red]failed[/]", _clip(s.reason))
        out.print(table)


def _ask_verdicts(shown: list[Scored]) -> list[Verdict]:
    """Ask in the terminal, for each shown output, whether the judge's score is right."""
    from rich.panel import Panel
    from rich.prompt import Prompt

    from grooves.rewards.calibrate import Verdict

    choices = {"a": "agree", "d": "disagree", "s": "skip"}
    given = []
    try:
        for number, s in enumerate(shown, start=1):
            body = f"[bold]input[/]: {_clip(s.sample.input, 400)}\n[bold]output[/]: {_clip(s.sample.output, 800)}"
            out.print(Panel(body, title=f"{number}/{len(shown)}  id {_clip(s.sample.id, 40)}  "
                            f"score {s.score:.2f}", subtitle=f"judge: {_clip(s.reason or '(no reason)', 120)}"))
            choice = Prompt.ask(r"is the score right? \[a]gree / \[d]isagree / \[s]kip", choices=list(choices),
                                show_choices=False, console=out)
            note = Prompt.ask("note (optional)", default="", show_default=False, console=out)
            given.append(Verdict(s.sample.id, choices[choice], note.strip()))
    except EOFError:
        raise _fail("the terminal closed before every verdict was given; use --verdicts FILE") from None
    return given


def _print_agreement(counts, failed: int, version: str, store: CalibrationStore) -> None:
    rate = counts.rate
    judged = counts.agree + counts.disagree
    extra = [f"{counts.skipped} skipped"] if counts.skipped else []
    if failed:
        extra.append(f"{failed} judge failures not counted")
    if counts.on_failed:
        extra.append(f"{counts.on_failed} verdicts on failed samples not counted")
    summary = (f"agreement {counts.agree}/{judged} = {rate:.0%}" if rate is not None
               else "agreement: no agree/disagree verdicts on scored samples")
    out.print(f"[bold]{summary}[/] on rubric version {version}" + (f" ({'; '.join(extra)})" if extra else ""),
              highlight=False)
    out.print(f"[dim]recorded in {store.path}[/]", highlight=False)
    _print_history(store, version)


def _print_history(store: CalibrationStore, version: str) -> None:
    """Past calibrations, newest last; rows of the current rubric version in bold."""
    import time

    from rich.table import Column, Table

    rows = store.history()
    if not rows:
        out.print(f"no calibrations recorded in {store.path} yet")
        return
    table = Table("#", Column("when", no_wrap=True), Column("rubric version", no_wrap=True), "samples", "scored",
                  "failed", "agree", "disagree", "rate", title=f"calibration history ({len(rows)})")
    for row in rows[-20:]:
        rate = "-" if row["agreement"] is None else f"{row['agreement']:.0%}"
        style = "bold" if row["rubric_version"] == version else None
        samples = Path(row["samples"]).name if "/" in row["samples"] else row["samples"]
        table.add_row(str(row["id"]), time.strftime("%m-%d %H:%M", time.localtime(row["created"])),
                      row["rubric_version"], _clip(samples, 24), str(row["scored"]), str(row["failed"]),
                      str(row["agree"]), str(row["disagree"]), rate, style=style)
    out.print(table)
