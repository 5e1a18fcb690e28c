"""Compare two checkpoints of a run (or one and the base) on the run's held-out tasks.

Each side is evaluated exactly as the training loop validates: the run's own config gives the
held-out tasks (the first ``log.val_size`` of each task set), the reward, and the held-out
sampling settings (``val_temperature``, seeded with the run's seed). So a checkpoint's mean
here is the ``val/reward/total`` its run logged at that step.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from grooves.dashboard.runs import run_dir
from grooves.policy.checkpoints import CheckpointError, resolve_checkpoint
from grooves.tasks.sources import TaskSourceError
from grooves.training.config import ConfigError, load_config

BASE = "base"


class CompareError(ValueError):
    """A comparison that cannot be made (no config, no held-out tasks, an unknown side)."""


def side_name(run: str, side: str) -> str:
    """``base``, or a checkpoint name: a bare step (``12``, ``latest``) is this run's."""
    side = side.strip()
    if side == BASE or "@" in side:
        return side
    if side.isdigit() or side == "latest":
        return f"{run}@{side}"
    raise CompareError(f"{side!r} is not 'base', a step of {run} or a checkpoint RUN@STEP")


def compare(root: Path, run: str, a: str, b: str) -> dict[str, Any]:
    """Both sides' completions and scores on the same held-out tasks, task by task."""
    from grooves.training.build import task_sets

    folder = run_dir(root, run)
    names = [side_name(run, a), side_name(run, b)]
    for name in names:  # before any model loads: a wrong name answers at once
        if name != BASE:
            try:
                resolve_checkpoint(name, root)
            except CheckpointError as error:
                raise CompareError(str(error)) from None
    try:
        config = load_config(folder / "config.toml")
        sets = task_sets(config)
    except (ConfigError, TaskSourceError, FileNotFoundError, ModuleNotFoundError) as error:
        hint = (" (relative paths in it are read from where the dashboard was started: start it where the run was)"
                if isinstance(error, (TaskSourceError, FileNotFoundError)) else "")
        raise CompareError(f"the run's config.toml cannot be used here: {error}{hint}") from None
    heldout = [(s, s.heldout[: config.log.val_size]) for s in sets if s.heldout]
    if not heldout:
        raise CompareError(f"run {run} has no held-out tasks to compare on")
    sides = [_evaluate(root, config, heldout, name) for name in names]
    tasks = [{"task_id": str(t.get("id")), "prompt": _prompt_text(ts.render(t))} for ts, ts_tasks in heldout
             for t in ts_tasks]
    return {"run": run, "sides": sides, "tasks": tasks}


def _evaluate(root: Path, config, heldout, name: str) -> dict[str, Any]:
    from grooves.policy import Policy, Sampling
    from grooves.training.gather import evaluate

    s = config.sampling
    sampling = Sampling(temperature=s.val_temperature, top_p=s.top_p, max_new_tokens=s.max_completion_length,
                        stop=tuple(s.stop), seed=config.seed)
    if name == BASE:
        policy = Policy.load(config.model.spec, dtype=config.model.dtype, seed=config.seed)
        step = 0
    else:
        # The seed matters for the random-weight "tiny" base, which is built from it.
        policy = Policy.load(name, dtype=config.model.dtype, seed=config.seed, runs=root)
        step = int(name.rpartition("@")[2]) if name.rpartition("@")[2].isdigit() else -1
    samples = []
    for task_set, tasks in heldout:
        evaluation = evaluate(policy, tasks, [task_set.render(t) for t in tasks], task_set.reward, sampling, step,
                              task_set.env)
        for group in evaluation.groups:
            t = group.trajectories[0]
            samples.append({"completion": t.completion, "reward": _finite(t.reward),
                            "components": {k: _finite(v) for k, v in t.components.items()},
                            "turns": sum(m.get("role") == "assistant" for m in t.messages)})
    return {"name": name, "mean": _mean([s["reward"] for s in samples]),
            "components": {c: _mean([s["components"].get(c) for s in samples])
                           for c in sorted({c for s in samples for c in s["components"]})},
            "samples": samples}


def _prompt_text(messages: list[dict]) -> str:
    user = [m.get("content") or "" for m in messages if m.get("role") == "user"]
    return str(user[0]) if user else ""


def _finite(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _mean(values: list) -> float | None:
    scored = [v for v in values if v is not None]
    return statistics.fmean(scored) if scored else None
