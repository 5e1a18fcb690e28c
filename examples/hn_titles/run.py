"""Reproduce the Hacker News title hack, and its fix, with the grooves CLI.

A title model (the bundled SmolLM2-135M-Instruct with a LoRA adapter) is RL-trained to
write Hacker News titles for READMEs of installed Python packages, against a reward model
that predicts HN points from a title. Run A has only that reward; run B adds two guards
that veto a title the text does not support (an LLM judge, the frozen base model, and a
lexical check). The monitors watch both runs and warn; the report says when each fired.

Steps, one after another, each skipped when its output is already there:

1. the reward model: ``grooves rm train DATA --text-col title --target-col num_points
   --transform log1p --out RUNS/hn_rm`` (about 7 minutes on 2 CPU cores for 20,000 rows);
2. the tasks: ``RUNS/tasks.jsonl`` (tasks.py);
3. run A, then run B: ``grooves train RUNS/configs/hn-X.toml --runs RUNS --steps N``,
   with ``--resume`` when the run folder exists, so a later call with a larger ``--steps``
   continues where the last one stopped;
4. the report: ``docs/hn_reproduction.md`` and its plot (report.py).

Every command and its wall time are appended to ``RUNS/timings.jsonl`` for the report.
Run from the repository root. Never part of ``make test``: a step takes 15-60 s on a CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import tomli_w

HERE = Path(__file__).resolve().parent
RUNS = {"A": ("run_a.toml", "hn-a"), "B": ("run_b.toml", "hn-b")}
EXIT_ALERT = 3  # grooves train: an alert paused or stopped the run


def grooves_command() -> str:
    """The grooves next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).parent / "grooves"
    found = str(local) if local.exists() else shutil.which("grooves")
    if not found:
        sys.exit("grooves is not installed in this environment (pip install -e .)")
    return found


def timed(command: list[str], runs: Path, what: str, **record) -> int:
    """Run ``command`` in the foreground; append its wall time and exit code to timings.jsonl."""
    print("$", " ".join(command), flush=True)
    start = time.time()
    code = subprocess.call(command)
    entry = {"what": what, "command": " ".join(command), "started": datetime.fromtimestamp(start, UTC)
             .isoformat(timespec="seconds"), "seconds": round(time.time() - start, 1), "exit_code": code, **record}
    with (runs / "timings.jsonl").open("a") as handle:
        handle.write(json.dumps(entry) + "\n")
    return code


def ensure_reward_model(args, runs: Path) -> Path:
    """Train the upvote predictor once; a finished model folder is reused (training takes minutes)."""
    out = runs / "hn_rm"
    if (out / "reward_model.json").exists():
        return out
    if not args.data.exists():
        sys.exit(f"no data at {args.data}: pass --data CSV (columns title and num_points)")
    command = [grooves_command(), "rm", "train", str(args.data), "--text-col", "title",
               "--target-col", "num_points", "--transform", "log1p", "--out", str(out)]
    if args.rm_limit:
        command += ["--limit", str(args.rm_limit)]
    if timed(command, runs, "reward model", limit=args.rm_limit) != 0:
        sys.exit("grooves rm train failed")
    return out


def ensure_tasks(runs: Path) -> Path:
    """Build the tasks file once: reusing it keeps the task set fixed while runs are resumed."""
    path = runs / "tasks.jsonl"
    if not path.exists():
        sys.path.insert(0, str(HERE))
        from tasks import write_tasks

        print(f"{write_tasks(path)} tasks -> {path}")
    return path


def write_config(template: str, runs: Path, tasks: Path, rm: Path) -> Path:
    """The run config with this machine's paths (absolute, so it works from any folder)."""
    config = tomllib.loads((HERE / template).read_text())
    config["tasks"]["source"] = str(tasks.resolve())
    for component in config["reward"]["components"]:
        if component.get("kind") == "reward_model":
            component["path"] = str(rm.resolve())
    out = runs / "configs" / f"{config['name']}.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Written by examples/hn_titles/run.py from {template}; edit that file instead.\n"
                   + tomli_w.dumps(config))
    return out


def last_step(run_dir: Path) -> int:
    """The last training step recorded in the run's metrics.jsonl (0 when none)."""
    path = run_dir / "metrics.jsonl"
    steps = [0]
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except (json.JSONDecodeError, KeyError):
                continue
    return max(steps)


def train(label: str, args, runs: Path, tasks: Path, rm: Path) -> None:
    """Train one run up to ``--steps`` steps, resuming its folder when it exists."""
    template, name = RUNS[label]
    config = write_config(template, runs, tasks, rm)
    run_dir = runs / name
    done = last_step(run_dir)
    if done >= args.steps:
        print(f"run {label} ({name}) already has {done} steps; skipping (pass a larger --steps to continue)")
        return
    command = [grooves_command(), "train", str(config), "--runs", str(runs), "--steps", str(args.steps)]
    if run_dir.exists():
        command.append("--resume")
    if args.quiet:
        command.append("--quiet")
    code = timed(command, runs, f"run {label}", run=name, steps_before=done, steps_target=args.steps)
    after = last_step(run_dir)
    if code == EXIT_ALERT:
        print(f"run {label}: an alert paused or stopped it after step {after} (the configs use policy 'warn', "
              f"so check [alerts] in {template})")
    elif code != 0:
        sys.exit(f"run {label} failed with exit code {code} after step {after}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Reproduce the Hacker News title hack (run A: reward model only) and its fix (run B: "
                    "reward model + supported_by_source and lexical grounding guards), then write the report.",
        epilog="Resume to more steps later with the same command and a larger --steps, e.g. --steps 60.")
    parser.add_argument("--data", type=Path, default=Path("../shared/data/hn/hacker_news.csv"),
                        help="CSV of HN posts with columns title and num_points, for the reward model "
                             "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=60,
                        help="train each run up to this many steps in total (default: %(default)s)")
    parser.add_argument("--runs", type=Path, default=Path("runs/hn"),
                        help="folder for the reward model, the tasks, the configs and both runs "
                             "(default: %(default)s)")
    parser.add_argument("--only", choices=sorted(RUNS), help="train only run A or only run B")
    parser.add_argument("--rm-limit", type=int, default=None,
                        help="train the reward model on the first N rows only (default: all)")
    parser.add_argument("--report-only", action="store_true", help="train nothing; only write the report")
    parser.add_argument("--doc", type=Path, default=Path("docs/hn_reproduction.md"),
                        help="report to write (default: %(default)s); its plot goes to img/ next to it")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        rm = ensure_reward_model(args, args.runs)
        tasks = ensure_tasks(args.runs)
        for label in [args.only] if args.only else sorted(RUNS):
            train(label, args, args.runs, tasks, rm)
    sys.path.insert(0, str(HERE))
    from report import write_report

    print(f"report -> {write_report(args.runs, args.doc)}")


if __name__ == "__main__":
    main()
