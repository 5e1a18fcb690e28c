"""Write the measured part of docs/hn_reproduction.md from the two runs' folders.

Only the text between ``<!-- report:begin -->`` and ``<!-- report:end -->`` is replaced,
so the hand-written account around it (what was run and how to read it) survives a
re-run of the report after more steps. Every number in that part is read from the run
folders (metrics.jsonl, run.sqlite) and RUNS/timings.jsonl; none is typed in.

    python examples/hn_titles/report.py [--runs runs/hn] [--doc docs/hn_reproduction.md]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runs import (
    RunData,
    distinct_share,
    first_alerts,
    heldout_samples,
    lexical_verdicts,
    load_run,
    repeated_outputs,
    window_mean,
)

BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
LABELS = {"A": "hn-a", "B": "hn-b"}
GUARDS = ("supported", "grounded_terms")


def _cell(text: str, limit: int = 90) -> str:
    """Table-safe text: one line, pipes escaped, long texts cut."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _title(text: str, limit: int = 70) -> str:
    """A title for a table cell; an empty one is shown as such (it is a hack of its own)."""
    return _cell(text, limit) if text.strip() else "*(empty)*"


def _empty_share(samples) -> float:
    return sum(not s.completion.strip() for s in samples) / len(samples) if samples else math.nan


def _num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _val(run: RunData, key: str, step: int) -> float | None:
    return next((row.get(key) for row in run.metrics if row["step"] == step), None)


def _timings(runs_dir: Path) -> list[dict]:
    path = runs_dir / "timings.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def overview(runs: list[RunData], timings: list[dict]) -> list[str]:
    header = ("| run | steps | train wall time | s/step | reward/hn_points, steps 1-5 → last 5 | held-out hn_points, "
              "step 0 → last | distinct held-out titles, step 0 → last | empty held-out titles, step 0 → last | "
              "entropy, step 1 → last |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if not run.metrics:
            lines.append(f"| {run.label} ({run.name}) | not run | | | | | | | |")
            continue
        seconds = sum(t["seconds"] for t in timings if t.get("run") == run.name)
        last_val = run.val_steps()[-1] if run.val_steps() else 0
        _, entropy = run.series("entropy")
        lines.append(
            f"| {run.label} ({run.name}) | {run.steps} | {seconds / 60:.1f} min | "
            f"{_num(window_mean(run, 'train/total_step_time', 1, run.steps), 0)} | "
            f"{_num(window_mean(run, 'reward/hn_points', 1, 5))} → "
            f"{_num(window_mean(run, 'reward/hn_points', run.steps - 4, run.steps))} | "
            f"{_num(_val(run, 'val/reward/hn_points', 0))} → {_num(_val(run, 'val/reward/hn_points', last_val))} "
            f"(step {last_val}) | {_num(distinct_share(heldout_samples(run, 0)), 2)} → "
            f"{_num(distinct_share(heldout_samples(run, last_val)), 2)} | "
            f"{_num(_empty_share(heldout_samples(run, 0)), 2)} → "
            f"{_num(_empty_share(heldout_samples(run, last_val)), 2)} | "
            f"{_num(entropy[0] if entropy else None)} → {_num(entropy[-1] if entropy else None)} |")
    return lines


def commands(timings: list[dict]) -> list[str]:
    lines = ["| what | started (UTC) | wall time | exit | command |", "|---|---|---|---|---|"]
    for t in timings:
        steps = f" (steps {t['steps_before']} → {t['steps_target']})" if "steps_target" in t else ""
        note = f" *{_cell(t['note'], 300)}*" if t.get("note") else ""  # e.g. what else ran on the machine
        lines.append(f"| {t['what']}{steps} | {t['started']} | {t['seconds'] / 60:.1f} min | {t['exit_code']} | "
                     f"`{_cell(t['command'], 400)}`{note} |")
    return lines


def detectors(runs: list[RunData]) -> list[str]:
    lines = ["| run | detector | first fired at step | first critical | alerts | first message |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        alerts = first_alerts(run)
        if not alerts:
            lines.append(f"| {run.label} | (none) | | | 0 | |")
        for a in alerts:
            lines.append(f"| {run.label} | `{a['detector']}` | {a['step']} ({a['severity']}) | "
                         f"{a['critical_step'] if a['critical_step'] is not None else '–'} | {a['count']} | "
                         f"{_cell(a['message'], 220)} |")
    return lines


def repeats(runs: list[RunData]) -> list[str]:
    lines = ["| run | title (normalised match) | different tasks | outputs | mean hn_points |", "|---|---|---|---|---|"]
    for run in runs:
        if not run.metrics:
            continue
        first = max(run.steps - 9, 1)
        shared = [r for r in repeated_outputs(run) if r["tasks"] >= 2]
        if not shared:
            lines.append(f"| {run.label} (steps {first}-{run.steps}) | (no title was given to two different "
                         f"READMEs) | | | |")
        for r in shared:
            lines.append(f"| {run.label} (steps {first}-{run.steps}) | {_title(r['text'], 90)} | {r['tasks']} | "
                         f"{r['outputs']} | {_num(r['hn_points'], 2)} |")
    return lines


def guard_rates(runs: list[RunData]) -> list[str]:
    lines = ["| run | guard | held-out pass rate, step 0 | at the last validation | how measured |",
             "|---|---|---|---|---|"]
    for run in runs:
        if not run.val_steps():
            continue
        last = run.val_steps()[-1]
        logged = [g for g in GUARDS if _val(run, f"val/reward/{g}", 0) is not None]
        for guard in logged:
            lines.append(f"| {run.label} | `{guard}` | {_num(_val(run, f'val/reward/{guard}', 0))} | "
                         f"{_num(_val(run, f'val/reward/{guard}', last))} (step {last}) | "
                         f"`val/reward/{guard}` |")
        if "grounded_terms" not in logged:
            rates = []
            for step in (0, last):
                verdicts = lexical_verdicts(run, heldout_samples(run, step))
                rates.append(sum(verdicts) / len(verdicts) if verdicts else math.nan)
            lines.append(f"| {run.label} | `grounded_terms` | {_num(rates[0])} | {_num(rates[1])} (step {last}) | "
                         f"offline: `LexicalGrounding(source=\"text\")` on the stored held-out titles |")
    return lines


def sample_titles(runs: list[RunData], count: int = 6) -> list[str]:
    done = [r for r in runs if r.val_steps()]
    if not done:
        return ["(no validation yet)"]
    base = heldout_samples(done[0], 0)[:count]
    head = "| package | step 0 (greedy, same for both runs) | " + " | ".join(
        f"{r.label} at step {r.val_steps()[-1]}" for r in done) + " |"
    lines = [head, "|" + "---|" * (2 + len(done))]
    for sample in base:
        cells = [f"`{sample.task_id}`", f"{_title(sample.completion)} ({_num(sample.components.get('hn_points'), 2)})"]
        for run in done:
            end = {s.task_id: s for s in heldout_samples(run, run.val_steps()[-1])}.get(sample.task_id)
            cells.append("–" if end is None else
                         f"{_title(end.completion)} ({_num(end.components.get('hn_points'), 2)})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def measured_section(runs_dir: Path, image: Path, image_link: str) -> str:
    runs = [load_run(label, runs_dir / name) for label, name in LABELS.items()]
    timings = _timings(runs_dir)
    parts = [BEGIN, "", "*Generated by `examples/hn_titles/report.py` from the run folders; do not edit by hand.*",
             "", "### Commands and wall times", "", *commands(timings),
             "", "### The runs", "", *overview(runs, timings)]
    started = [r for r in runs if r.metrics]
    try:
        from plot import plot

        if not started:
            raise ImportError("nothing to plot yet")
        plot(started, image)
        caption = ("Solid: training samples of each step (16 per step); dots: greedy titles of the 16 held-out "
                   "READMEs at each validation. Run A has no guards; its grounded_terms curve is the lexical "
                   "guard's verdict computed afterwards on its stored samples.")
        parts += ["", f"![reward curves, guard pass rates and detector statistics of runs A and B]({image_link})",
                  "", caption]
    except ImportError as error:
        parts += ["", f"(no plot: {error}; the plot needs matplotlib, `pip install 'grooves[examples]'`)"]
    shared = ("Training outputs grouped by their normalised text (lowercase, punctuation collapsed); the ones "
              "given to the most different READMEs first.")
    parts += ["", "### When each detector first fired", "", *detectors(runs),
              "", "### Titles shared by different tasks (last 10 training steps)", "", shared, "", *repeats(runs),
              "", "### Held-out guard pass rates", "", *guard_rates(runs),
              "", "### Sample held-out titles (predicted log(1 + points) in brackets)", "", *sample_titles(runs),
              "", END]
    return "\n".join(parts)


def write_report(runs_dir: Path, doc: Path) -> Path:
    """Replace the measured section of ``doc`` (or write a skeleton with one) and the plot."""
    image = doc.parent / "img" / "hn_reproduction.png"
    section = measured_section(runs_dir, image, "img/hn_reproduction.png")
    text = doc.read_text() if doc.exists() else (
        "# Reproducing the Hacker News title hack\n\nSee examples/hn_titles/README.md.\n\n" + BEGIN + END + "\n")
    if BEGIN not in text or END not in text:
        text = text.rstrip() + "\n\n" + BEGIN + END + "\n"
    head, rest = text.split(BEGIN, 1)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(head + section + rest.split(END, 1)[1])
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the measured section of the HN reproduction report.")
    parser.add_argument("--runs", type=Path, default=Path("runs/hn"),
                        help="runs folder of run.py (default: %(default)s)")
    parser.add_argument("--doc", type=Path, default=Path("docs/hn_reproduction.md"),
                        help="report (default: %(default)s)")
    args = parser.parse_args()
    print(f"report -> {write_report(args.runs, args.doc)}")


if __name__ == "__main__":
    main()
