"""Live pages without polling from the page: server-sent event streams over the run folders,
and what a run halted by an alert needs to continue.

A stream looks at the files (sizes and times of ``metrics.jsonl`` and ``run.sqlite``, and
whether a training process holds the run) every ``POLL_S`` seconds and sends the new data only
when something changed, so an open page costs a few ``stat`` calls, not a JSON answer every
two seconds. A run's stream ends (``event: end``) once nothing trains it any more; the runs
list's stream stays open while the page is.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

import grooves.dashboard.runs as reading

POLL_S = 0.5
"""How often a stream looks at the run's files."""
LIST_POLL_S = 1.0
"""How often the runs list's stream looks at every run."""
KEEPALIVE_S = 15.0
"""A comment line this often, so a closed page is noticed and proxies keep the stream open."""


def run_version(folder: Path) -> str:
    """Changes whenever the run writes a metric, a sample, an alert or a label, or its training
    process starts or ends."""
    return f"{reading.files_version(folder)}/{'training' if reading.is_training(folder) else 'idle'}"


def detail(root: Path, name: str) -> dict[str, Any]:
    """``runs.run_detail`` with ``version`` (read before the data, so a write during the read
    shows up as one more change) and ``halt`` (the alert that paused or stopped the run)."""
    folder = reading.run_dir(root, name)
    version = run_version(folder)
    run = reading.run_detail(root, name)
    return {**run, "version": version, "halt": halt(folder, run)}


def halt(folder: Path, run: dict[str, Any]) -> dict[str, Any] | None:
    """For a run paused or stopped by an alert: the alerts of its last step that halted it and
    the command that continues it, accepting those detectors (what the trainer printed)."""
    if run["status"] not in ("paused by an alert", "stopped by an alert"):
        return None
    halting = [a for a in run["alerts"]
               if a["step"] == run["step"] and a["evidence"].get("action") in ("pause", "stop")]
    detectors = list(dict.fromkeys(a["detector"] for a in halting))
    words = ["grooves", "train", str(folder / "config.toml"), "--resume", "--out", str(folder)]
    for detector in detectors:
        words += ["--ack", detector]
    return {"action": halting[-1]["evidence"]["action"], "step": run["step"], "alerts": halting,
            "resume": shlex.join(words)}


def event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def run_events(root: Path, name: str, since: str | None,
                     gone: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
    """``event: run`` with the run's detail whenever it changes (not at once when ``since`` is
    the version the page already shows), then ``event: end`` when nothing trains it."""
    folder = reading.run_dir(root, name)
    seen, quiet = since, 0.0
    yield "retry: 2000\n\n"
    while not await gone():
        version = await run_in_threadpool(run_version, folder)
        if version != seen:
            run = await run_in_threadpool(detail, root, name)
            seen, quiet = run["version"], 0.0
            yield event("run", run)
            if run["status"] != "running":
                yield event("end", {"status": run["status"]})
                return
        elif version.endswith("/idle"):  # nothing changed and nothing trains it: the page is current
            yield event("end", {"status": "not training"})
            return
        elif quiet >= KEEPALIVE_S:
            quiet = 0.0
            yield ": still training\n\n"
        await asyncio.sleep(POLL_S)
        quiet += POLL_S


def _root_version(root: Path) -> tuple:
    if not root.is_dir():
        return ()
    return tuple(sorted((folder.name, run_version(folder)) for folder in root.iterdir()
                        if folder.is_dir() and not folder.name.startswith(".")))


async def runs_events(root: Path, gone: Callable[[], Awaitable[bool]]) -> AsyncIterator[str]:
    """``event: runs`` with the runs list whenever a run starts, writes or ends."""
    seen, quiet = await run_in_threadpool(_root_version, root), 0.0
    yield "retry: 2000\n\n"
    while not await gone():
        await asyncio.sleep(LIST_POLL_S)
        quiet += LIST_POLL_S
        version = await run_in_threadpool(_root_version, root)
        if version != seen:
            seen, quiet = version, 0.0
            yield event("runs", {"root": str(root), "runs": await run_in_threadpool(reading.list_runs, root)})
        elif quiet >= KEEPALIVE_S:
            quiet = 0.0
            yield ": nothing new\n\n"
