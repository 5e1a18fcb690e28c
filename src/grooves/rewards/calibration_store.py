"""Judge calibrations (``grooves judge calibrate``) in SQLite: a run's run.sqlite, or a file beside the rubric."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

CALIBRATION_SCHEMA = """
CREATE TABLE IF NOT EXISTS calibrations (
    id INTEGER PRIMARY KEY,
    created REAL NOT NULL,
    rubric_version TEXT NOT NULL,   -- Rubric.version: content hash of the text the judge reads
    rubric_path TEXT NOT NULL,
    samples TEXT NOT NULL,          -- where the batch came from: a file, or RUN@STEP
    judge TEXT NOT NULL,            -- model @ endpoint URL
    scored INTEGER NOT NULL,        -- samples the judge scored
    failed INTEGER NOT NULL,        -- samples the judge could not score (NaN, never 0)
    agree INTEGER NOT NULL,
    disagree INTEGER NOT NULL,
    skipped INTEGER NOT NULL,
    on_failed INTEGER NOT NULL,     -- verdicts on failed samples: kept, not in the rate
    agreement REAL                  -- agree / (agree + disagree); NULL without such verdicts
);
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY,
    calibration_id INTEGER NOT NULL REFERENCES calibrations(id),
    sample_id TEXT NOT NULL,
    score REAL,                     -- the judge's score in [0, 1]; NULL when it failed
    reason TEXT NOT NULL,           -- the judge's reason, or its error when it failed
    verdict TEXT NOT NULL,          -- 'agree', 'disagree' or 'skip'
    note TEXT NOT NULL,
    input TEXT NOT NULL,            -- the texts judged, kept: sample files and runs change
    output TEXT NOT NULL
);
"""

_CALIBRATION_FIELDS = ("rubric_version", "rubric_path", "samples", "judge", "scored", "failed", "agree",
                       "disagree", "skipped", "on_failed", "agreement")
_VERDICT_FIELDS = ("sample_id", "score", "reason", "verdict", "note", "input", "output")


class CalibrationStore:
    """Judge calibrations in a SQLite file: a run's run.sqlite, or a file next to the rubric.

    The tables are the same in both, so a calibration on a sample file reads like one on a run.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(CALIBRATION_SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def record(self, calibration: dict[str, Any], verdicts: list[dict[str, Any]]) -> int:
        """Store one calibration (keys of ``_CALIBRATION_FIELDS``) and its verdicts in one transaction."""
        with self.db:
            cursor = self.db.execute(
                f"INSERT INTO calibrations (created, {', '.join(_CALIBRATION_FIELDS)}) "
                f"VALUES (?, {', '.join('?' * len(_CALIBRATION_FIELDS))})",
                (time.time(), *(calibration[k] for k in _CALIBRATION_FIELDS)))
            ident = cursor.lastrowid
            self.db.executemany(
                f"INSERT INTO verdicts (calibration_id, {', '.join(_VERDICT_FIELDS)}) "
                f"VALUES (?, {', '.join('?' * len(_VERDICT_FIELDS))})",
                [(ident, *(v[k] for k in _VERDICT_FIELDS)) for v in verdicts])
        return ident

    def history(self) -> list[dict[str, Any]]:
        """Every calibration, oldest first, as dicts with ``id``, ``created`` and the recorded fields."""
        cursor = self.db.execute(f"SELECT id, created, {', '.join(_CALIBRATION_FIELDS)} FROM calibrations "
                                 "ORDER BY id")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor]

    def verdicts(self, calibration_id: int) -> list[dict[str, Any]]:
        """The verdicts of one calibration, in the order given."""
        cursor = self.db.execute(f"SELECT {', '.join(_VERDICT_FIELDS)} FROM verdicts WHERE calibration_id = ? "
                                 "ORDER BY id", (calibration_id,))
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor]
