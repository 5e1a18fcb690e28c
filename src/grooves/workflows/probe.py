"""Probe runs: train a short budget, stop as soon as there is something to read, then review.

Practitioners' advice for RL fine-tuning: run 30-40 steps, stop, read the top, bottom and
random samples. Hacks are loud (a model that finds a trick reuses it everywhere), and so is
a reward that works. A probe is the run's own config with:

- ``steps`` capped at the budget (default 40) and the run named ``<name>-probe``;
- validation at least every 10 steps, checkpoints at least every 10 steps;
- every alert pausing the run (``[alerts] policy = "pause"``, acting on warnings too), so a
  probe that found a hack stops with a checkpoint ``--resume`` continues from;
- the stop rule ``heldout_rose``: at a validation step of at least ``min_step``, the mean
  per-task gain of the held-out reward over step 0 is positive and more than ``z`` standard
  errors of the paired differences (at least 5 tasks scored at both steps).
"""

from __future__ import annotations

import math
import statistics

from grooves.training.config import RunConfig
from grooves.training.loop import StopRule
from grooves.training.gather import Evaluation

PROBE_STEPS = 40


def probe_config(config: RunConfig, steps: int = PROBE_STEPS) -> RunConfig:
    """The probe's config: the same run, short, validating and checkpointing often, pausing on alerts."""
    probe = config.model_copy(deep=True)
    probe.name = f"{config.name}-probe"
    probe.steps = min(steps, config.steps) if steps > 0 else config.steps
    probe.log.val_every = min(config.log.val_every, 10)
    probe.log.save_every = min(config.log.save_every, 10)
    probe.alerts = probe.alerts.model_copy(update={"policy": "pause", "act_on": "warn", "detectors": {}})
    return probe


def heldout_rose(min_step: int = 10, z: float = 2.0, min_tasks: int = 5) -> StopRule:
    """Stop when the held-out reward has clearly risen over step 0 (see the module docstring)."""

    def rule(step: int, metrics: dict[str, float], evaluations: dict[int, Evaluation]) -> str | None:
        if step < min_step or step not in evaluations or 0 not in evaluations:
            return None
        gain = paired_gain(evaluations[0], evaluations[step])
        if gain is None or gain[2] < min_tasks:
            return None
        mean, stderr, n = gain
        if mean > 0 and mean > z * stderr:
            return (f"held-out reward rose by {mean:+.3f} per task over step 0 ({n} tasks, "
                    f"{mean / stderr if stderr else math.inf:.1f} standard errors)")
        return None

    return rule


def paired_gain(before: Evaluation, after: Evaluation) -> tuple[float, float, int] | None:
    """Mean, standard error and count of per-task reward differences (tasks scored at both)."""
    def by_task(evaluation: Evaluation) -> dict[tuple, float]:
        return {(g.metadata.get("task_set"), g.task["id"]): g.trajectories[0].reward for g in evaluation.groups}

    first, second = by_task(before), by_task(after)
    diffs = [second[k] - first[k] for k in first if k in second and math.isfinite(first[k] + second[k])]
    if len(diffs) < 2:
        return None
    return statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)
