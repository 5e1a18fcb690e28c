"""Run the reward-hacking detectors again over a finished run's records, with today's defaults.

    python scripts/replay_monitors.py RUN_DIR [--config CONFIG.toml]

Reads each training step's trajectories from RUN_DIR/run.sqlite and its metrics from
RUN_DIR/metrics.jsonl, feeds them to a fresh ``Monitors`` step by step, and prints every
alert it raises. This is how a threshold change is checked against a recorded run without
training again. The groups are rebuilt from the stored trajectories, so a detector that
reads a task column other than the prompt (``source = "text"``) sees only ``id``.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from collections import defaultdict
from pathlib import Path

from grooves.monitors import Monitors, MonitorsConfig
from grooves.training.config import load_config
from grooves.runs.store import read_metrics
from grooves.types import Group, Trajectory


def step_groups(db: sqlite3.Connection, split: str = "train") -> dict[int, list[Group]]:
    by_step: dict[int, dict[str, list[Trajectory]]] = defaultdict(lambda: defaultdict(list))
    rows = db.execute("SELECT step, task_id, group_index, data FROM trajectories WHERE split = ? ORDER BY id",
                      (split,))
    for step, task_id, group_index, data in rows:
        by_step[step][f"{group_index}:{task_id}"].append(Trajectory.from_dict(json.loads(data)))
    return {step: [Group({"id": key.split(":", 1)[1]}, ts) for key, ts in groups.items()]
            for step, groups in by_step.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--config", type=Path, help="Take [monitors] from this run config (default: defaults).")
    args = parser.parse_args()
    config = load_config(args.config).monitors if args.config else MonitorsConfig()
    monitors = Monitors(config)
    metrics = {row["step"]: row for row in read_metrics(args.run_dir / "metrics.jsonl")}
    with sqlite3.connect(args.run_dir / "run.sqlite") as db:
        groups, heldout = step_groups(db), step_groups(db, "val")
    count = 0
    for step in sorted(set(groups) | set(heldout)):
        row = {k: (float("nan") if v is None else v) for k, v in metrics.get(step, {}).items()}
        found = monitors.observe_heldout(step, heldout[step]) if step in heldout else []
        found += monitors.observe(step, groups[step], row) if step in groups else []
        for alert in found:
            count += 1
            print(f"step {step}: {alert.detector} ({alert.severity}): {alert.message}")
    print(f"replay {args.run_dir.name} steps={len(groups)} alerts={count}")


if __name__ == "__main__":
    main()
