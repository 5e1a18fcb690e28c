"""The metering ledger: one SQLite row per request the service ran, with its tokens.

- ``prompt``: tokens read without training: sampling prompts and ``forward`` (forward-only) datums.
- ``sample``: tokens sampled.
- ``train``: tokens of ``forward_backward`` datums.

The request id is the row's key, so a request the SDK retries (the same ``seq_id`` gets the
same request back) is charged once. Prices are USD per million tokens, from a TOML file::

    prompt = 0.10
    sample = 0.30
    train = 0.50
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grooves.backend.tenants import read_toml

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY,
    time REAL NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    kind TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    sampled_tokens INTEGER NOT NULL DEFAULT 0,
    trained_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_tenant_time ON usage (tenant, time);
"""


@dataclass(frozen=True)
class Prices:
    """USD per million tokens."""

    prompt: float = 0.0
    sample: float = 0.0
    train: float = 0.0

    def cost(self, prompt: int, sampled: int, trained: int) -> float:
        return (prompt * self.prompt + sampled * self.sample + trained * self.train) / 1e6


def load_prices(path: str | Path | None) -> Prices:
    if path is None:
        return Prices()
    path = Path(path)
    data = read_toml(path, "the prices file")
    unknown = set(data) - {"prompt", "sample", "train"}
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: prompt, sample, train (USD per "
                         "million tokens)")
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{path}: {key} must be a number >= 0 (USD per million tokens)")
    return Prices(**{k: float(v) for k, v in data.items()})


class Ledger:
    """Append-only usage rows; safe to call from any thread."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def record(self, request_id: str, tenant: str, model: str, kind: str, *, prompt: int = 0, sampled: int = 0,
               trained: int = 0) -> bool:
        """Charge a request once; False when its id was already charged."""
        with self._lock:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (request_id, time.time(), tenant, model, kind, prompt, sampled, trained))
            return cursor.rowcount == 1

    def spent(self, tenant: str, prices: Prices) -> float:
        with self._lock:
            row = self._db.execute("SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(sampled_tokens), 0), "
                                   "COALESCE(SUM(trained_tokens), 0) FROM usage WHERE tenant = ?",
                                   (tenant,)).fetchone()
        return prices.cost(*row)

    def usage(self, since: float | None = None) -> list[tuple]:
        """``(tenant, model, requests, prompt, sampled, trained)`` per tenant and model."""
        with self._lock:
            return self._db.execute(
                "SELECT tenant, model, COUNT(*), SUM(prompt_tokens), SUM(sampled_tokens), SUM(trained_tokens) "
                "FROM usage WHERE time >= ? GROUP BY tenant, model ORDER BY tenant, model",
                (since or 0.0,)).fetchall()

    def close(self) -> None:
        self._db.close()
