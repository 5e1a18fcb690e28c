"""The capture store: production chat completions that ``grooves serve --capture DIR`` served.

One SQLite file, ``DIR/capture.sqlite`` (WAL mode, so ``grooves learn`` reads while the server
writes). Each row is one non-streamed chat completion: when it arrived, the model it named and
the weights that answered, the request's messages and tools, the exact prompt token ids, and
each choice's text, token ids and finish reason. Ids only grow (``AUTOINCREMENT``), so a reader
keeps a cursor, the last id it has read, and never sees a row twice.

Bounded: rows older than ``retention_s`` go, and when the live pages pass ``max_bytes`` the oldest
rows go until they fit; SQLite reuses freed pages, so the file stays near ``max_bytes``.

Prompts are user data: they are written here and nowhere else (the request log carries counts
only), and the folder is created readable by its owner alone.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE = "capture.sqlite"
PRUNE_EVERY = 16  # inserts between size checks: a check costs two PRAGMAs

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    served TEXT NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT,
    prompt_ids TEXT NOT NULL,
    choices TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_created ON requests (created);
"""


@dataclass
class Captured:
    """One captured chat completion."""

    id: int
    created: float
    model: str
    served: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    choices: list[dict[str, Any]]  # {"text", "token_ids", "finish_reason"}


class CaptureStore:
    def __init__(self, folder: str | Path, max_bytes: int = 256 << 20, retention_s: float = 30 * 86400.0,
                 readonly: bool = False):
        if max_bytes < 64 << 10:
            raise ValueError(f"capture max_bytes must be at least 65536, got {max_bytes}")
        if retention_s <= 0:
            raise ValueError(f"capture retention must be positive, got {retention_s} s")
        self.folder = Path(folder)
        self.path = self.folder / FILE
        self.max_bytes, self.retention_s = max_bytes, retention_s
        if readonly:
            if not self.path.is_file():
                raise FileNotFoundError(f"no capture store at {self.path} (start grooves serve --capture "
                                        f"{self.folder})")
        else:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        if not readonly:
            self._db.executescript(_SCHEMA)
            self.path.chmod(0o600)
        self._inserts = 0

    def record(self, model: str, served: str, messages: list[dict[str, Any]], tools: list[dict] | None,
               prompt_ids: list[int], choices: list[dict[str, Any]], now: float | None = None) -> int:
        """Store one completion; returns its id."""
        row = (now if now is not None else time.time(), model, served, json.dumps(messages),
               json.dumps(tools) if tools else None, json.dumps(prompt_ids), json.dumps(choices))
        with self._lock, self._db:
            cursor = self._db.execute("INSERT INTO requests (created, model, served, messages, tools, prompt_ids, "
                                      "choices) VALUES (?, ?, ?, ?, ?, ?, ?)", row)
            self._inserts += 1
            if self._inserts % PRUNE_EVERY == 1:
                self._prune(row[0])
            return int(cursor.lastrowid)

    def prune(self, now: float | None = None) -> int:
        """Apply the retention and the size bound now; returns the rows removed."""
        with self._lock, self._db:
            return self._prune(now if now is not None else time.time())

    def _prune(self, now: float) -> int:
        removed = self._db.execute("DELETE FROM requests WHERE created < ?", (now - self.retention_s,)).rowcount
        while self.used_bytes() > self.max_bytes:
            count = self._db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
            if count <= 1:
                break
            # the oldest tenth at a time: the size is known only in whole pages
            removed += self._db.execute("DELETE FROM requests WHERE id IN (SELECT id FROM requests ORDER BY id "
                                        "LIMIT ?)", (max(1, count // 10),)).rowcount
        return removed

    def used_bytes(self) -> int:
        """Bytes in the pages that hold rows (freed pages are reused before the file grows)."""
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * self._db.execute("PRAGMA page_size").fetchone()[0]

    def after(self, cursor: int, limit: int = 1000) -> list[Captured]:
        """Rows with an id above ``cursor``, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT id, created, model, served, messages, tools, prompt_ids, choices FROM "
                                    "requests WHERE id > ? ORDER BY id LIMIT ?", (cursor, limit)).fetchall()
        return [Captured(r[0], r[1], r[2], r[3], json.loads(r[4]), json.loads(r[5]) if r[5] else None,
                         json.loads(r[6]), json.loads(r[7])) for r in rows]

    def count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
