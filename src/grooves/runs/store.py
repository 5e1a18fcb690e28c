"""The run folder: ``config.toml``, ``metrics.jsonl``, ``run.sqlite`` and ``checkpoints/``.

``metrics.jsonl`` gets one JSON line per step, flushed as it is written. ``run.sqlite``
(WAL mode) holds every trajectory with its reward components, alerts, the human's review
labels (``grooves review``); judge calibrations (``grooves judge calibrate``,
``grooves.rewards.calibration_store``) share the file. Resuming
from a checkpoint at step k first drops whatever was recorded after k (labels of dropped
trajectories included), so the resumed run's records read as if it had never stopped.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, NamedTuple

from grooves.types import Group, Trajectory

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
CREATE TABLE IF NOT EXISTS labels (     -- a person's verdict on a sample (grooves review)
    trajectory_id INTEGER PRIMARY KEY,  -- trajectories.id; relabelling replaces
    step INTEGER NOT NULL,
    label TEXT NOT NULL CHECK (label IN ('hack', 'good', 'bad')),
    note TEXT NOT NULL,
    created REAL NOT NULL
);
"""


class StoredTrajectory(NamedTuple):
    """One row of ``trajectories``: its id (what labels point at), where it was recorded, the sample."""

    id: int
    step: int
    split: str
    task_id: str | None
    trajectory: Trajectory


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
            # Row ids of deleted trajectories are handed out again to the resumed run's samples.
            self.db.execute("DELETE FROM labels WHERE trajectory_id NOT IN (SELECT id FROM trajectories)")

    # --- reading trajectories and calibration ----------------------------------------

    def trajectory_steps(self, split: str = "train") -> list[int]:
        """Steps that have recorded trajectories of ``split``, oldest first."""
        rows = self.db.execute("SELECT DISTINCT step FROM trajectories WHERE split = ? ORDER BY step", (split,))
        return [row[0] for row in rows]

    def read_trajectories(self, step: int, split: str = "train") -> list[tuple[int, Trajectory]]:
        """(row id, trajectory) of every trajectory recorded at ``step``, in recording order."""
        rows = self.db.execute("SELECT id, data FROM trajectories WHERE step = ? AND split = ? ORDER BY id",
                               (step, split))
        return [(ident, Trajectory.from_dict(json.loads(data))) for ident, data in rows]

    def trajectory_records(self, split: str | None = None, steps: list[int] | None = None) -> list[StoredTrajectory]:
        """Stored trajectories with their row ids, oldest first; ``None`` means every split or step."""
        query, params = "SELECT id, step, split, task_id, data FROM trajectories WHERE 1", []
        if split is not None:
            query, params = query + " AND split = ?", [split]
        if steps is not None:
            query += f" AND step IN ({', '.join('?' * len(steps))})"
            params += list(steps)
        rows = self.db.execute(query + " ORDER BY id", params)
        return [StoredTrajectory(ident, step, split_, task_id, Trajectory.from_dict(json.loads(data)))
                for ident, step, split_, task_id, data in rows]

    def read_alerts(self, steps: list[int] | None = None) -> list[dict[str, Any]]:
        """Alerts in the order they fired (all, or those at ``steps``), with evidence decoded."""
        query, params = "SELECT step, detector, severity, message, evidence, created FROM alerts", []
        if steps is not None:
            query, params = query + f" WHERE step IN ({', '.join('?' * len(steps))})", list(steps)
        return [{"step": step, "detector": detector, "severity": severity, "message": message,
                 "evidence": json.loads(evidence), "created": created}
                for step, detector, severity, message, evidence, created in
                self.db.execute(query + " ORDER BY id", params)]

    # --- labels (grooves review) ------------------------------------------------------

    def record_labels(self, labels: list[tuple[int, str, str]]) -> tuple[int, int]:
        """Store (trajectory id, label, note) triples in one transaction; return (stored, replaced).

        Every id must be a stored trajectory (ValueError naming the unknown ones): a label
        without its sample would be a verdict on nothing.
        """
        ids = sorted({ident for ident, _, _ in labels})
        steps = dict(self.db.execute(f"SELECT id, step FROM trajectories WHERE id IN ({', '.join('?' * len(ids))})",
                                     ids)) if ids else {}
        unknown = [ident for ident in ids if ident not in steps]
        if unknown:
            raise ValueError(f"no trajectory with id {', '.join(map(str, unknown))} in {self.dir / 'run.sqlite'}")
        replaced = self.db.execute(f"SELECT COUNT(*) FROM labels WHERE trajectory_id IN "
                                   f"({', '.join('?' * len(ids))})", ids).fetchone()[0] if ids else 0
        now = time.time()
        with self.db:
            self.db.executemany("INSERT OR REPLACE INTO labels (trajectory_id, step, label, note, created) "
                                "VALUES (?, ?, ?, ?, ?)",
                                [(ident, steps[ident], label, note, now) for ident, label, note in labels])
        return len(labels), replaced

    def read_labels(self) -> dict[int, dict[str, Any]]:
        """Labels by trajectory id, with the sample's step and split; only those whose sample is stored."""
        rows = self.db.execute("SELECT l.trajectory_id, t.step, t.split, l.label, l.note, l.created FROM labels l "
                               "JOIN trajectories t ON t.id = l.trajectory_id ORDER BY l.trajectory_id")
        return {ident: {"step": step, "split": split, "label": label, "note": note, "created": created}
                for ident, step, split, label, note, created in rows}


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
