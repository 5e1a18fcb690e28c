"""The run folder: ``config.toml``, ``metrics.jsonl``, ``run.sqlite`` and ``checkpoints/``.

``metrics.jsonl`` gets one JSON line per step, flushed as it is written. ``run.sqlite``
(WAL mode) holds every trajectory with its reward components, and alerts. Resuming from a
checkpoint at step k first drops whatever was recorded after k, so the resumed run's
records read as if it had never stopped.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from grooves.types import Group

SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    id INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    split TEXT NOT NULL,            -- 'train' or 'val'
    task_id TEXT,
    group_index INTEGER,
    reward REAL,                    -- NULL when a required component failed
    components TEXT NOT NULL,       -- JSON {name: value or null}
    completion TEXT,
    finish_reason TEXT,
    completion_tokens INTEGER,
    data TEXT NOT NULL              -- the whole Trajectory as JSON
);
CREATE INDEX IF NOT EXISTS trajectories_step ON trajectories(step);
CREATE TABLE IF NOT EXISTS alerts (
    id INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    detector TEXT NOT NULL,
    severity TEXT NOT NULL,
    message TEXT NOT NULL,
    evidence TEXT NOT NULL,         -- JSON
    created REAL NOT NULL
);
"""


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class RunStore:
    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "checkpoints").mkdir(exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.db = sqlite3.connect(self.dir / "run.sqlite")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.db.commit()

    @property
    def name(self) -> str:
        return self.dir.name

    def close(self) -> None:
        self.db.close()

    def write_config(self, text: str) -> None:
        write_atomic(self.dir / "config.toml", text)

    # --- metrics -------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **metrics}
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(_finite(row)) + "\n")
            handle.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics_path)

    # --- trajectories and alerts ---------------------------------------------------

    def record_groups(self, step: int, groups: list[Group], split: str = "train") -> None:
        rows = []
        for index, group in enumerate(groups):
            for t in group.trajectories:
                data = t.to_dict()
                rows.append((step, split, str(group.task.get("id")), index, data["reward"],
                             json.dumps(data["components"]), t.completion, t.finish_reason,
                             len(t.completion_ids), json.dumps(data)))
        with self.db:
            self.db.executemany(
                "INSERT INTO trajectories (step, split, task_id, group_index, reward, components, completion, "
                "finish_reason, completion_tokens, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def record_alert(self, step: int, detector: str, severity: str, message: str, evidence: dict) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO alerts (step, detector, severity, message, evidence, created) VALUES (?, ?, ?, ?, ?, ?)",
                (step, detector, severity, message, json.dumps(evidence), time.time()))

    # --- resume ----------------------------------------------------------------------

    def truncate_after(self, step: int) -> None:
        """Forget everything recorded after ``step`` (a resume from that step's checkpoint)."""
        kept = [row for row in self.read_metrics() if row["step"] <= step]
        write_atomic(self.metrics_path, "".join(json.dumps(row) + "\n" for row in kept))
        with self.db:
            self.db.execute("DELETE FROM trajectories WHERE step > ?", (step,))
            self.db.execute("DELETE FROM alerts WHERE step > ?", (step,))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a last line cut short by a crash is ignored."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: write it as null."""
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
