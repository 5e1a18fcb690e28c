"""``grooves drift A B``: how far training moved the weights and the outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _user_errors, out


def register(app: typer.Typer) -> None:
    app.command("drift")(drift)


def drift(
    a: Annotated[str, typer.Argument(help="From: 'base', a checkpoint RUN@STEP (or RUN@latest) or a PEFT folder.")],
    b: Annotated[str, typer.Argument(help="To: 'base', a checkpoint RUN@STEP or a PEFT folder.")],
    prompts: Annotated[Path | None, typer.Option(help="Held-out prompts, JSONL {\"prompt\": text or messages} "
                                                 "(default: the run's recorded held-out prompts).")] = None,
    untrained: Annotated[Path | None, typer.Option(help="A task the run did not train on, JSONL {\"prompt\", "
                                                   "\"reference\"} (default: bundled general questions).")] = None,
    n: Annotated[int, typer.Option("--n", min=1, help="Most held-out prompts used for the KL.")] = 16,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Length of the greedy completions the KL is "
                                                "measured on.")] = 48,
    top: Annotated[int, typer.Option(min=0, help="Modules listed, largest relative change first (0: all).")] = 10,
    weights_only: Annotated[bool, typer.Option("--weights-only", help="Only the weight change (no model "
                                               "outputs: fast).")] = False,
    base: Annotated[str | None, typer.Option(help="Base model spec, needed only when both sides are the base.")]
    = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the whole report as JSON here.")]
    = None,
    runs: RunsOption = None,
) -> None:
    """Per-module relative weight change ‖W_B − W_A‖/‖W_A‖ of the effective LoRA update, KL to the
    base on held-out prompts, and the change on a task the run did not train on (forgetting)."""
    from rich.table import Table

    from grooves.workflows.drift import DriftError, measure

    try:
        report = measure(a, b, runs=runs, base=base, prompts_file=prompts, untrained_file=untrained,
                         n_prompts=n, max_new_tokens=max_new_tokens, outputs=not weights_only)
    except (*_user_errors(), DriftError) as error:
        raise _fail(str(error)) from None
    rows = sorted(report.modules, key=lambda m: -m.relative)
    table = Table("module", "‖ΔW‖", "‖W‖", "‖ΔW‖/‖W‖", title=f"weight change {report.a} → {report.b}")
    for row in rows[:top] if top else rows:
        table.add_row(row.module, f"{row.delta_norm:.4g}", f"{row.weight_norm:.4g}", f"{row.relative:.3e}")
    out.print(table)
    kinds = ", ".join(f"{kind} {value:.2e}" for kind, value in report.by_kind.items())
    out.print(f"all {len(rows)} adapted modules: {report.total:.3e}" + (f" (by kind: {kinds})" if kinds else ""),
              highlight=False, soft_wrap=True)
    if report.kl:
        kl = ", ".join(f"{name} {value:.4f}" for name, value in report.kl.items())
        out.print(f"KL to the base, per token, on {report.prompts} held-out prompts: {kl}", highlight=False)
    if report.forgetting:
        nll = ", ".join(f"{name} {value:.3f}" for name, value in report.forgetting.items())
        change = report.forgetting.get(report.b, report.forgetting["base"]) - \
            report.forgetting.get(report.a, report.forgetting["base"])
        out.print(f"untrained task ({report.untrained_tasks} questions), NLL per token: {nll}; "
                  f"change {report.a} → {report.b}: {change:+.3f}", highlight=False, soft_wrap=True)
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_dict(), indent=1))
        out.print(f"report written to {json_out}", highlight=False, soft_wrap=True)
