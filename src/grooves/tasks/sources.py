"""Task sources: a built-in task set, a JSONL or CSV file, a ``datasets`` object or a list.

A task is a dict. Its prompt comes from a ``prompt`` column (a string, or a list of chat
messages) or from ``prompt_template`` formatted with the task's columns; every other
column reaches the reward functions by name. Train and held-out splits are made by a
seeded hash of each task's id, so a task stays on its side whatever the file's order.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from grooves.types import Message, Task

BUILTIN = {"titles": "grooves.tasks.titles"}


class TaskSourceError(ValueError):
    """A task source that cannot be read; the message names the source and the problem."""


def load_tasks(source: str | Path | Iterable[dict], split: str | None = None) -> list[Task]:
    """Read tasks from ``builtin:NAME``, a ``.jsonl``/``.csv`` path, a ``datasets`` object or a list.

    ``split`` selects ``train``/``heldout`` of a built-in set; files return every row.
    Each task gets an ``id`` (its own ``id`` column, else its row number).
    """
    if isinstance(source, (str, Path)) and str(source).startswith("builtin:"):
        return _builtin(str(source), split)
    if isinstance(source, (str, Path)):
        rows = _read_file(Path(source))
    else:
        rows = [dict(row) for row in source]  # a list of dicts or a datasets.Dataset
    if not rows:
        raise TaskSourceError(f"task source {source!r} has no rows")
    return [{**row, "id": str(row.get("id", i))} for i, row in enumerate(rows)]


def _builtin(source: str, split: str | None) -> list[Task]:
    import importlib

    name = source.partition(":")[2]
    if name not in BUILTIN:
        raise TaskSourceError(f"unknown built-in task set {name!r}; available: {', '.join(BUILTIN)}")
    return importlib.import_module(BUILTIN[name]).tasks(split)


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise TaskSourceError(f"task file {path} does not exist")
    if path.suffix not in (".jsonl", ".csv"):
        raise TaskSourceError(f"task file {path} must end in .jsonl or .csv")
    text = _decode(path)
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise TaskSourceError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(rows[-1], dict):
                raise TaskSourceError(f"{path}:{number}: each line must be a JSON object")
        return rows
    return list(csv.DictReader(io.StringIO(text, newline="")))


def _decode(path: Path) -> str:
    """The file as UTF-8 text (a byte-order mark is dropped); other encodings are named errors."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise TaskSourceError(f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset "
                              f"{error.start}); save the file as UTF-8") from None


def split_tasks(tasks: list[Task], heldout_fraction: float, seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Split by a seeded hash of each task's id: stable under reordering and appending."""
    train, heldout = [], []
    for task in tasks:
        digest = hashlib.sha256(f"{seed}:{task['id']}".encode()).digest()
        (heldout if int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction else train).append(task)
    return train, heldout


def render_prompt(task: Task, template: str | None = None, system: str | None = None) -> list[Message]:
    """The chat messages that ask the model to do ``task``."""
    if template is not None:
        try:
            content = template.format(**task)
        except KeyError as error:
            raise TaskSourceError(f"prompt_template names column {error} that task {task['id']!r} lacks "
                                  f"(its columns: {sorted(task)})") from None
        messages = [{"role": "user", "content": content}]
    elif isinstance(task.get("prompt"), str):
        messages = [{"role": "user", "content": task["prompt"]}]
    elif isinstance(task.get("prompt"), list):
        messages = list(task["prompt"])
    else:
        raise TaskSourceError(f"task {task['id']!r} has no 'prompt' column; add one or set prompt_template")
    if system and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages


class TaskStream:
    """Tasks in a seeded random order, epoch after epoch; its position is checkpointed."""

    def __init__(self, tasks: list[Task], seed: int | str = 0):
        if not tasks:
            raise TaskSourceError("no training tasks")
        self.tasks = tasks
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[Task]:
        out = []
        for _ in range(count):
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.tasks[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle(self.epoch)


class BalancedStream:
    """Tasks drawn in turns over the values of one column (``kind``, say): each round every value
    gives one task, in a seeded order of values, and each value's tasks come in their own seeded
    order, epoch after epoch. A rare kind is drawn as often as a common one, so every batch of at
    least as many tasks as there are values holds each. Its position is checkpointed."""

    def __init__(self, tasks: list[Task], column: str, seed: int = 0):
        if not tasks:
            raise TaskSourceError("no training tasks")
        if lacking := [t["id"] for t in tasks if column not in t]:
            raise TaskSourceError(f"{len(lacking)} of {len(tasks)} training tasks have no column {column!r} to "
                                  f"balance by (e.g. task {lacking[0]!r}, whose columns are "
                                  f"{sorted(next(t for t in tasks if t['id'] == lacking[0]))})")
        self.seed = seed
        self.values = sorted({str(t[column]) for t in tasks})
        self.streams = {v: TaskStream([t for t in tasks if str(t[column]) == v], seed=f"{seed}:{column}={v}")
                        for v in self.values}
        self.draws = 0

    def take(self, count: int) -> list[Task]:
        out = []
        for _ in range(count):
            round_, turn = divmod(self.draws, len(self.values))
            order = list(self.values)
            random.Random(f"{self.seed}:round:{round_}").shuffle(order)
            out.extend(self.streams[order[turn]].take(1))
            self.draws += 1
        return out

    def state(self) -> dict:
        return {"draws": self.draws, "values": {v: s.state() for v, s in self.streams.items()}}

    def restore(self, state: dict) -> None:
        self.draws = state["draws"]
        for value, saved in state["values"].items():
            self.streams[value].restore(saved)
