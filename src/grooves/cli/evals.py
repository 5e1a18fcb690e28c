"""``grooves eval CONFIG``: the fine-tune-or-not table: quality, latency and cost per candidate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _user_errors, err, out


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)


def eval_command(
    config: Annotated[Path, typer.Argument(help="Evaluation config (TOML): run or config, and [[candidates]]; "
                                           "see docs/eval.md.")],
    out_dir: Annotated[Path | None, typer.Option("--out", help="Folder for eval.json and eval.png "
                                                 "(default: evals/<name>).")] = None,
    runs: RunsOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress (bar or lines).")] = False,
) -> None:
    """Compare candidates (the base, RUN@STEP adapters, merged folders, OpenAI-compatible endpoints
    with prices) on the same held-out tasks: reward per component with standard errors, success
    rate for envs, latency p50/p95, tokens/s, tokens and cost per 1,000 tasks.

    Progress goes to stderr: on a terminal a bar with the candidate, its phase and the time left;
    to a file or a pipe a line per phase and about one every 2 seconds while answers come in. The
    table goes to stdout, whole: to a file or a pipe it is as wide as its numbers need."""
    from rich.table import Table

    from grooves.progress import Reporter
    from grooves.training.config import ConfigError, load_config
    from grooves.workflows.eval_chart import write_chart
    from grooves.workflows.evals import EvalConfig, EvalError, evaluate_candidates

    if not config.is_file():
        raise _fail(f"config file {config} does not exist")
    try:
        cfg = load_config(config, EvalConfig)
    except ConfigError as error:
        raise _fail(f"invalid config {config}:\n{error}") from None
    try:
        results = evaluate_candidates(cfg, config.parent, runs, progress=Reporter(err, enabled=not quiet))
    except (*_user_errors(), EvalError, ValueError) as error:
        raise _fail(str(error)) from None
    components = sorted({name for r in results for name in r.components})
    table = Table("candidate", "reward ± s.e.", *components, "success", "p50 s", "p95 s", "tok/s",
                  "tokens / 1k tasks", "$ / 1k tasks", title=f"{cfg.name}: {results[0].tasks} held-out tasks")
    for r in results:
        table.add_row(r.name, _pm(r.reward, r.reward_se),
                      *(_pm(*r.components.get(c, (None, None))) for c in components),
                      _num(r.success, "{:.0%}"), _num(r.latency_p50, "{:.2f}"), _num(r.latency_p95, "{:.2f}"),
                      _num(r.tokens_per_s, "{:.1f}"), f"{r.tokens_per_1k:,.0f}", _num(r.cost_per_1k, "{:.4f}"))
    out.print(table)
    folder = out_dir or Path("evals") / cfg.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "eval.json").write_text(json.dumps({"name": cfg.name, "candidates": [r.to_dict() for r in results]},
                                                 indent=1))
    chart = write_chart(results, folder / "eval.png")
    out.print(f"wrote {folder / 'eval.json'}" + (f" and {folder / 'eval.png'}" if chart else
                                                   " (pip install matplotlib for the chart)"),
              highlight=False, soft_wrap=True)


def _pm(mean, se) -> str:
    return "failed" if mean is None else f"{mean:.3f} ± {se:.3f}"


def _num(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
