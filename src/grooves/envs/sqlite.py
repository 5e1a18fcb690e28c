"""Sealed app replicas on SQLite: a schema, seeded data, a private database per rollout.

A replica subclasses ``SQLiteApp`` and gives ``schema`` (SQL), ``seed_data(db, rng)`` and
its tools and tasks; tools reach the rollout's database as ``self.db(state)``. The seeded database is built once per env object (in memory); every
rollout gets its own copy through the SQLite backup API (memory to memory, no files), so
concurrent rollouts never see each other's writes. ``snapshot``/``restore`` carry the
database bytes (``Connection.serialize``) with the conversation and the rollout's random
generator, so a rollout can be resumed or branched at any turn.

Nothing leaves the sandbox: the database is ``:memory:``, ``ATTACH`` and extension loading
are refused by an authorizer, and tools write SQL with ``?`` parameters only (a tool
argument that looks like SQL is just a string to match).

Scoring helpers compare the final database with the seeded one: ``changed_rows`` lists
what a rollout inserted, updated or deleted, table by table, so a score can check that the
expected change happened and nothing else changed.
"""

from __future__ import annotations

import random
import sqlite3
from typing import Any, ClassVar

from grooves.envs.base import Env, State

_DENIED = {sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH}


def _authorizer(action: int, arg1, arg2, db_name, trigger) -> int:
    if action in _DENIED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and arg2 in {"load_extension", "readfile", "writefile"}:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def connect(data: bytes | None = None) -> sqlite3.Connection:
    """A private in-memory database (from ``serialize()`` bytes, if given), usable from the tool
    worker threads, sealed."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    if data is not None:
        db.deserialize(data)  # before the authorizer: SQLite treats it as an attach
    db.row_factory = sqlite3.Row
    db.execute("PRAGMA foreign_keys = ON")
    db.set_authorizer(_authorizer)
    return db


class SQLiteApp(Env):
    """An env whose world is a SQLite database: ``self.db(state)`` in tools, a fresh copy per rollout."""

    schema: ClassVar[str] = ""
    db_seed: int = 0  # seeds the generated data (the same world for every rollout of this env)

    def seed_data(self, db: sqlite3.Connection, rng: random.Random) -> None:
        """Insert the replica's data."""
        raise NotImplementedError

    @property
    def template(self) -> sqlite3.Connection:
        """The seeded database every rollout copies (built on first use)."""
        if getattr(self, "_template", None) is None:
            db = connect()
            try:
                db.executescript(self.schema)
                self.seed_data(db, random.Random(self.db_seed))
                db.commit()
            except BaseException:
                db.close()
                raise
            self._template = db
        return self._template

    def setup(self, state: State) -> None:
        db = connect()
        self.template.backup(db)
        state.resources["db"] = db

    def close(self, state: State) -> None:
        db = state.resources.pop("db", None)
        if db is not None:
            db.close()

    def interrupt(self, state: State) -> None:
        db = state.resources.get("db")
        if db is not None:
            db.interrupt()

    def save_resources(self, state: State) -> dict[str, bytes]:
        return {"db": state.resources["db"].serialize()}

    def load_resources(self, state: State, blobs: dict[str, bytes]) -> None:
        state.resources["db"] = connect(blobs["db"])

    def db(self, state: State) -> sqlite3.Connection:
        """The rollout's private database."""
        return state.resources["db"]

    # --- reading the world -------------------------------------------------------------

    @staticmethod
    def rows(db: sqlite3.Connection, sql: str, *params: Any) -> list[dict[str, Any]]:
        return [dict(row) for row in db.execute(sql, params)]

    @staticmethod
    def row(db: sqlite3.Connection, sql: str, *params: Any) -> dict[str, Any] | None:
        found = db.execute(sql, params).fetchone()
        return dict(found) if found is not None else None

    def changed_rows(self, state: State) -> dict[str, dict[str, list]]:
        """Per table, the rows a rollout ``added``, ``removed`` and ``changed`` (as (before, after)),
        compared with the seeded database by primary key (the first column)."""
        out: dict[str, dict[str, list]] = {}
        db = state.resources["db"]
        tables = [r["name"] for r in self.rows(self.template, "SELECT name FROM sqlite_master WHERE type = 'table' "
                                                             "AND name NOT LIKE 'sqlite_%'")]
        for table in tables:
            before = {tuple(r.values())[0]: r for r in self.rows(self.template, f'SELECT * FROM "{table}"')}
            after = {tuple(r.values())[0]: r for r in self.rows(db, f'SELECT * FROM "{table}"')}
            diff = {"added": [after[k] for k in after.keys() - before.keys()],
                    "removed": [before[k] for k in before.keys() - after.keys()],
                    "changed": [(before[k], after[k]) for k in before.keys() & after.keys() if before[k] != after[k]]}
            if any(diff.values()):
                out[table] = diff
        return out

    def changes(self, state: State) -> dict[str, Any]:
        """``changed_rows`` as plain JSON to compare with a task's expected change: per table, the
        changed columns of ``updated`` rows by key (as a string), the ``added`` rows without their
        key, the ``removed`` keys; tables without changes are left out."""
        out = {}
        for table, diff in self.changed_rows(state).items():
            parts = {"updated": {str(next(iter(b.values()))): {k: v for k, v in a.items() if b[k] != v}
                                 for b, a in diff["changed"]},
                     "added": [dict(list(row.items())[1:]) for row in diff["added"]],
                     "removed": [next(iter(row.values())) for row in diff["removed"]]}
            out[table] = {k: v for k, v in parts.items() if v}
        return out
