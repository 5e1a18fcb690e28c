"""The demo job: RL-train the bundled model on the built-in title task, report before/after.

The held-out tasks are scored greedily at step 0 and after the last step; the gain is
judged against the standard error of the per-task paired difference.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from grooves.training.api import run_config
from grooves.training.config import load_config
from grooves.training.runfolder import Run
from grooves.training.gather import Evaluation


@dataclass
class DemoResult:
    run: Run
    before: Evaluation
    after: Evaluation
    seconds: float

    @property
    def differences(self) -> list[float]:
        return [a - b for a, b in zip(self.after.rewards, self.before.rewards)]

    @property
    def stderr(self) -> float:
        diffs = self.differences
        return statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan

    def mean(self, evaluation: Evaluation) -> float:
        return statistics.fmean(evaluation.rewards)


def demo_config_path() -> Path:
    return Path(str(resources.files("grooves.configs").joinpath("demo.toml")))


def run_demo(steps: int | None = None, runs: str | Path | None = None, console: Console | None = None) -> DemoResult:
    """Train the demo; ``console`` shows the progress (a bar on a terminal, a line per step in a log)."""
    start = time.time()
    config = load_config(demo_config_path())
    if steps is not None:
        config.steps = steps
    config.name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    run = run_config(config, runs=runs, console=console)
    return DemoResult(run, run.evaluations[0], run.evaluations[run.step], time.time() - start)


def print_report(result: DemoResult, console: Console, samples: int = 4) -> None:
    table = Table("held-out reward", "before (step 0)", f"after (step {result.run.step})",
                  title=f"{len(result.before.rewards)} held-out tasks, greedy decoding")
    keys = [k for k in result.before.metrics if k.startswith("val/reward/") and k.count("/") == 2]
    for key in keys:
        table.add_row(key.removeprefix("val/reward/"), f"{result.before.metrics[key]:.3f}",
                      f"{result.after.metrics[key]:.3f}")
    table.add_row("completion tokens", f"{result.before.metrics['val/completion_len']:.1f}",
                  f"{result.after.metrics['val/completion_len']:.1f}")
    console.print(table)
    for before, after in list(zip(result.before.groups, result.after.groups))[:samples]:
        console.print(f"[bold]{before.task['id']}[/] (reference: {before.task['reference']!r})", highlight=False)
        console.print(f"  before {before.trajectories[0].reward:.2f}: {before.trajectories[0].completion!r}",
                      highlight=False, markup=False)
        console.print(f"  after  {after.trajectories[0].reward:.2f}: {after.trajectories[0].completion!r}",
                      highlight=False, markup=False)
    console.print(f"run folder: {result.run.dir}; try: grooves sample {result.run.name}@latest \"...\"")
    print(f"demo heldout_reward before={result.mean(result.before):.4f} after={result.mean(result.after):.4f} "
          f"stderr={result.stderr:.4f} steps={result.run.step} seconds={result.seconds:.0f}", flush=True)
