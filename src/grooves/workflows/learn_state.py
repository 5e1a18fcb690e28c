"""What ``grooves learn`` remembers between restarts, and how it moves the served alias.

``Ledger`` is ``RUN/learn.sqlite``:
- ``prompts``: each captured request the loop has taken, and the step that took it. Its largest
  id is the cursor into the capture store, so a prompt is taken once, whatever restarts.
- ``pending``: a step's scored groups, written in the same transaction as its prompts, *before*
  the update. A process killed after scoring trains on these on restart instead of scoring the
  prompts again.
- ``gates``: each candidate's decision (in / out), with the rewards and the reason.
- ``alias``: where the served alias has pointed, newest last, with the held-out rewards the gate
  measured for that checkpoint (the "before" of the next gate). ``--rollback`` appends a row.

``Publisher`` makes a checkpoint sampleable and points the alias at it, over one of two routes:
``alias`` (``grooves serve`` reading the same runs root: checkpoints are served as ``RUN@STEP``,
``POST /v1/adapters`` points the alias) or ``lora`` (vLLM's ``POST /v1/load_lora_adapter``: the
checkpoint is loaded as ``RUN@STEP`` and the alias is the same folder loaded in place under the
alias's name). Neither restarts the server.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from grooves.policy.checkpoints import step_dirname
from grooves.types import Group

_SCHEMA = """
CREATE TABLE IF NOT EXISTS prompts (capture_id INTEGER PRIMARY KEY, step INTEGER NOT NULL, used INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pending (step INTEGER PRIMARY KEY, groups TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS gates (step INTEGER PRIMARY KEY, decision TEXT NOT NULL, reason TEXT NOT NULL,
    before REAL, after REAL, stderr REAL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS alias (id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL,
    heldout TEXT NOT NULL, reason TEXT NOT NULL, created REAL NOT NULL);
"""


class PublishError(RuntimeError):
    """The server refused to load a checkpoint or to move the alias."""


@dataclass
class AliasRow:
    step: int
    heldout: list[float]  # the gate's held-out rewards of this checkpoint, one per held-out task
    reason: str


class Ledger:
    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(run_dir / "learn.sqlite", timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)

    def cursor(self) -> int:
        """The newest capture id taken (0: none)."""
        return self.db.execute("SELECT COALESCE(MAX(capture_id), 0) FROM prompts").fetchone()[0]

    def take(self, step: int, used: list[int], skipped: list[int], groups: list[Group]) -> None:
        """Record a step's prompts (``used`` trained on, ``skipped`` not) and its scored groups, atomically."""
        with self.db:
            self.db.executemany("INSERT INTO prompts (capture_id, step, used) VALUES (?, ?, ?)",
                                [(i, step, 1) for i in used] + [(i, step, 0) for i in skipped])
            if groups:
                self.db.execute("INSERT INTO pending (step, groups) VALUES (?, ?)",
                                (step, json.dumps([g.to_dict() for g in groups])))

    def pending(self, step: int) -> list[Group] | None:
        row = self.db.execute("SELECT groups FROM pending WHERE step = ?", (step,)).fetchone()
        return None if row is None else [Group.from_dict(g) for g in json.loads(row[0])]

    def pending_steps(self) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT step FROM pending ORDER BY step")]

    def record_gate(self, step: int, decision: str, reason: str, before: float, after: float,
                    stderr: float) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO gates VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (step, decision, reason, before, after, stderr, time.time()))
            self.db.execute("DELETE FROM pending WHERE step = ?", (step,))

    def gates(self) -> list[dict]:
        rows = self.db.execute("SELECT step, decision, reason, before, after, stderr FROM gates ORDER BY step")
        return [dict(zip(("step", "decision", "reason", "before", "after", "stderr"), r)) for r in rows]

    def point(self, step: int, heldout: list[float], reason: str) -> None:
        with self.db:
            self.db.execute("INSERT INTO alias (step, heldout, reason, created) VALUES (?, ?, ?, ?)",
                            (step, json.dumps(heldout), reason, time.time()))

    def history(self) -> list[AliasRow]:
        rows = self.db.execute("SELECT step, heldout, reason FROM alias ORDER BY id")
        return [AliasRow(s, json.loads(h), r) for s, h, r in rows]

    def close(self) -> None:
        self.db.close()


class Publisher:
    """Checkpoints of run ``run_dir`` made sampleable on the server, and the alias moved."""

    def __init__(self, url: str, route: str, run_dir: Path, api_key: str = "", timeout: float = 300.0):
        self.route, self.run_dir, self.run = route, run_dir, run_dir.name
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def folder(self, step: int) -> Path:
        return (self.run_dir / "checkpoints" / step_dirname(step)).resolve()

    def servable(self, step: int) -> str:
        """The server's name for checkpoint ``step`` (``RUN@STEP``), loaded first on the ``lora`` route."""
        name = f"{self.run}@{step}"
        if self.route == "lora":
            self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(self.folder(step) / "adapter"),
                                              "load_inplace": True})
        return name

    def point(self, alias: str, step: int) -> None:
        """Serve checkpoint ``step`` as ``alias`` from the next request on."""
        if self.route == "lora":
            self._post("/load_lora_adapter", {"lora_name": alias, "lora_path": str(self.folder(step) / "adapter"),
                                              "load_inplace": True})
        else:
            self._post("/adapters", {"name": alias, "checkpoint": f"{self.run}@{step}"})

    def _post(self, path: str, body: dict) -> None:
        try:
            response = self.http.post(path, json=body)
        except httpx.TransportError as error:
            raise PublishError(f"the server did not answer {path}: {type(error).__name__}: {error}") from None
        if response.status_code != 200:
            raise PublishError(f"the server refused {path} ({response.status_code}): {response.text[:300]}")

    def close(self) -> None:
        self.http.close()
