"""What the dashboard reads from a runs root: runs, their curves and alerts, samples and labels.

Everything returns plain JSON-ready data. A run is a folder under the root with a
``metrics.jsonl`` or a ``run.sqlite``; names are plain folder names (no path tricks). The
only write is a review label, through ``training.review.store_labels`` (the same rows
``grooves review --label`` writes), into an existing ``run.sqlite`` that is a file of the run
folder, not a link to one elsewhere. A run half written by a crash (no metrics yet, a cut or
corrupt line, an alert with unreadable evidence) still lists and opens: what cannot be read
is skipped and counted, never a failed page.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sqlite3
import tomllib
from pathlib import Path
from typing import Any

from grooves.policy.checkpoints import list_checkpoints
from grooves.workflows.review import LABELS, Label, ReviewError, review, store_labels, task_prompt
from grooves.runs.store import RunStore

CHARTS = ("kl", "entropy", "completion_len", "clipfrac")
"""Charts after the reward components; ``completion_len`` is overlaid with ``val/completion_len``."""
MAX_POINTS = 1000
"""Points per curve sent to the page: a longer curve is thinned evenly, its last point kept."""
BUSY_MS = 30_000
"""How long a label waits for the training process's write to finish (SQLite's busy timeout)."""


class RunNotFound(LookupError):
    """No such run under the root (or a name that is not a plain folder name)."""


def run_dir(root: Path, name: str) -> Path:
    if (not name or "/" in name or "\\" in name or "\0" in name or name.startswith(".")
            or len(name.encode()) > 255):
        raise RunNotFound(f"{name!r} is not a run name")
    folder = root / name
    if not ((folder / "metrics.jsonl").is_file() or (folder / "run.sqlite").is_file()):
        raise RunNotFound(f"no run {name!r} under {root}")
    return folder


def list_runs(root: Path) -> list[dict[str, Any]]:
    """Every run under the root, newest start first."""
    if not root.is_dir():
        return []
    runs = []
    for folder in root.iterdir():
        if folder.is_dir() and not folder.name.startswith(".") and (
                (folder / "metrics.jsonl").is_file() or (folder / "run.sqlite").is_file()):
            try:
                runs.append(run_summary(folder))
            except Exception as error:  # one unreadable run must not hide the others
                runs.append({"name": folder.name, "status": "unreadable", "error": f"{type(error).__name__}: "
                             f"{error}", "step": None, "steps": None, "reward": None, "val_reward": None,
                             "val_step": None, "alerts": 0, "started": None, "duration": None, "checkpoints": []})
    return sorted(runs, key=lambda r: (-(r["started"] or 0), r["name"]))


def metric_rows(folder: Path) -> tuple[list[dict[str, Any]], int]:
    """``metrics.jsonl``'s rows that have a step, and how many other lines were skipped
    (corrupt, not an object, no whole-number step). A last line without its newline is being
    written (or was cut by a crash): skipped, not counted."""
    try:
        text = (folder / "metrics.jsonl").read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    lines = text.split("\n")
    lines.pop()  # "" when the file ends with a newline; else a line still being written
    rows, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def run_summary(folder: Path) -> dict[str, Any]:
    """Status, step, newest rewards, alert count, start and duration of one run."""
    rows, skipped = metric_rows(folder)
    alerts = _alerts(folder)
    last = next((r for r in reversed(rows) if r.get("reward/total") is not None), {})
    last_val = next((r for r in reversed(rows) if r.get("val/reward/total") is not None), {})
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    step = rows[-1]["step"] if rows else None
    steps = _configured_steps(folder)
    return {"name": folder.name, "status": _status(folder, step, steps, alerts), "step": step, "steps": steps,
            "reward": last.get("reward/total"), "val_reward": last_val.get("val/reward/total"),
            "val_step": last_val.get("step"), "alerts": len(alerts),
            "started": min(times) if times else None, "duration": (max(times) - min(times)) if times else None,
            "checkpoints": [step for step, _ in list_checkpoints(folder)], "skipped_lines": skipped}


def _configured_steps(folder: Path) -> int | None:
    try:
        steps = tomllib.loads((folder / "config.toml").read_text()).get("steps")
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    return steps if isinstance(steps, int) else None


def _status(folder: Path, step: int | None, steps: int | None, alerts: list[dict]) -> str:
    """``running`` while a live process holds the run's lock; else why it ended."""
    if is_training(folder):
        return "running"
    halting = [a for a in alerts if a["evidence"].get("action") in ("pause", "stop") and a["step"] == step]
    if halting:
        return "paused by an alert" if halting[-1]["evidence"]["action"] == "pause" else "stopped by an alert"
    if step is not None and steps is not None and step >= steps:
        return "finished"
    return "stopped"


def is_training(folder: Path) -> bool:
    """Whether ``RUN/.lock.owner`` (written by the training process, removed when it ends) names
    a live process; a crash can leave the file behind, so the pid is checked on this host."""
    try:
        owner = json.loads((folder / ".lock.owner").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict):
        return False
    if owner.get("host") != socket.gethostname():
        return True  # another machine's process: its word is all there is
    try:
        os.kill(int(owner["pid"]), 0)
    except (ProcessLookupError, KeyError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def _alerts(folder: Path) -> list[dict[str, Any]]:
    """Alerts read without creating anything (a run being written stays untouched)."""
    db = folder / "run.sqlite"
    if not db.is_file():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
            rows = connection.execute("SELECT step, detector, severity, message, evidence, created FROM alerts "
                                      "ORDER BY id").fetchall()
    except sqlite3.DatabaseError:  # no alerts table yet, or not a database at all
        return []
    return [{"step": step, "detector": str(detector), "severity": str(severity), "message": str(message),
             "evidence": _evidence(evidence), "created": created}
            for step, detector, severity, message, evidence, created in rows]


def _evidence(text) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {"unreadable": str(text)}
    return value if isinstance(value, dict) else {"value": value}


def run_detail(root: Path, name: str) -> dict[str, Any]:
    """A run's summary, its curves as ``{metric: [[step, value], ...]}`` grouped into charts,
    its alerts and the steps that have samples to review."""
    folder = run_dir(root, name)
    rows, _ = metric_rows(folder)
    series: dict[str, list] = {}
    for row in rows:
        for key, value in row.items():
            if (key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value)):
                series.setdefault(key, []).append([row["step"], value])
    series = {key: thin(points) for key, points in series.items()}
    components = sorted({key[len("reward/"):] for key in series if key.startswith("reward/")
                         and key.count("/") == 1} | {key[len("val/reward/"):] for key in series
                                                     if key.startswith("val/reward/") and key.count("/") == 2},
                        key=lambda c: (c != "total", c))
    charts = [{"title": f"reward/{c}", "lines": _lines(series, f"reward/{c}", f"val/reward/{c}")}
              for c in components]
    charts += [{"title": metric, "lines": _lines(series, metric, f"val/{metric}")} for metric in CHARTS
               if metric in series or f"val/{metric}" in series]
    if "learn/reward_after" in series:  # a grooves learn run: the gate's view of each step
        charts.append({"title": "learn: held-out reward, served alias vs candidate", "lines": [
            {"label": "alias (before)", "metric": "learn/reward_before", "points": series["learn/reward_before"]},
            {"label": "candidate", "metric": "learn/reward_after", "points": series["learn/reward_after"]}]})
        charts.append({"title": "learn/gated_in", "lines": [
            {"label": "rolled out", "metric": "learn/gated_in", "points": series.get("learn/gated_in", [])}]})
    summary = run_summary(folder)
    return {**summary, "charts": charts, "alerts": _alerts(folder), "review_steps": _sample_steps(folder)}


def thin(points: list, limit: int = MAX_POINTS) -> list:
    """At most ``limit`` evenly spaced points, the first and the last kept."""
    if len(points) <= limit:
        return points
    stride = (len(points) - 1) / (limit - 1)
    return [points[round(i * stride)] for i in range(limit)]


def _lines(series: dict[str, list], train: str, heldout: str) -> list[dict[str, Any]]:
    return [{"label": label, "metric": metric, "points": series[metric]}
            for label, metric in (("train", train), ("held-out", heldout)) if metric in series]


def files_version(folder: Path) -> str:
    """Changes whenever the run writes a metric, a sample, an alert or a label (``live.py``)."""
    parts = []
    for name in ("metrics.jsonl", "run.sqlite", "run.sqlite-wal"):
        try:  # the WAL file comes and goes as the trainer's connection opens and closes
            stat = (folder / name).stat()
        except OSError:
            parts.append("-")
            continue
        parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
    return "/".join(parts)


def _sample_steps(folder: Path) -> dict[str, list[int]]:
    db = folder / "run.sqlite"
    if not db.is_file():
        return {}
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
            rows = connection.execute("SELECT DISTINCT split, step FROM trajectories ORDER BY step").fetchall()
    except sqlite3.DatabaseError:
        return {}
    steps: dict[str, list[int]] = {}
    for split, step in rows:
        steps.setdefault(split, []).append(step)
    return steps


# --- review and labels -------------------------------------------------------------------


def step_review(root: Path, name: str, step: int | None, split: str, k: int, seed: int) -> dict[str, Any]:
    """Top, bottom and random samples of a step, as ``grooves review`` chooses them."""
    store = _open_store(root, name)
    try:
        (chosen,) = review(store, [step] if step is not None else None, k=k, split=split, seed=seed)
        turns = _turn_counts(store, [s.id for s in chosen.shown()])
    finally:
        store.close()
    return {"step": chosen.step, "split": chosen.split, "count": chosen.count, "failed": chosen.failed,
            "lists": {kind: [_sample(s, turns.get(s.id, 0)) for s in samples]
                      for kind, samples in (("top", chosen.top), ("bottom", chosen.bottom),
                                            ("random", chosen.random))}}


def _sample(sample, turns: int) -> dict[str, Any]:
    return {"id": sample.id, "step": sample.step, "task_id": sample.task_id, "prompt": sample.prompt,
            "completion": sample.completion, "reward": _finite(sample.reward),
            "components": {k: _finite(v) for k, v in sample.components.items()}, "reasons": sample.reasons,
            "vetoes": sample.vetoes, "turns": turns,
            "label": {"label": sample.label.label, "note": sample.label.note} if sample.label else None}


def _open_store(root: Path, name: str) -> RunStore:
    """The run's store, only when its ``run.sqlite`` is a real file in the run folder: opening
    never creates a database, and a label never writes through a link to a file elsewhere."""
    folder = run_dir(root, name)
    db = folder / "run.sqlite"
    if db.is_symlink():
        raise ReviewError(f"{db} is a link, not the run's own file: the dashboard does not open it")
    if not db.is_file():
        raise ReviewError(f"run {name!r} has no run.sqlite yet: no samples are recorded")
    return RunStore(folder)


def _turn_counts(store: RunStore, ids: list[int]) -> dict[int, int]:
    """Assistant turns per trajectory id (more than one: a multi-turn rollout)."""
    if not ids:
        return {}
    rows = store.db.execute(f"SELECT id, data FROM trajectories WHERE id IN ({', '.join('?' * len(ids))})", ids)
    return {ident: sum(m.get("role") == "assistant" for m in json.loads(data)["messages"]) for ident, data in rows}


def _finite(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def label_sample(root: Path, name: str, ident: int, label: str, note: str) -> dict[str, Any]:
    """Store one label (relabelling replaces), exactly as ``grooves review --label`` does."""
    if label not in LABELS:
        raise ReviewError(f"label must be one of {', '.join(LABELS)}; got {label!r}")
    store = _open_store(root, name)
    try:
        # The training process writes this database too: wait for its write rather than fail.
        store.db.execute(f"PRAGMA busy_timeout = {BUSY_MS}")
        store_labels(store, [Label(ident, label, note.strip())])
        stored = store.read_labels()[ident]
    finally:
        store.close()
    return {"id": ident, "label": stored["label"], "note": stored["note"]}


# --- one sample's transcript -----------------------------------------------------------------


def transcript(root: Path, name: str, ident: int, tokenizer=None) -> dict[str, Any]:
    """A stored trajectory's messages (tool calls and results included) and its completion
    tokens cut into spans that were trained (the model's own tokens) or not (the env's)."""
    store = _open_store(root, name)
    try:
        rows = store.db.execute("SELECT step, split, task_id FROM trajectories WHERE id = ?", (ident,)).fetchall()
        if not rows:
            raise RunNotFound(f"run {name!r} has no sample {ident}")
        step, split, task_id = rows[0]
        (trajectory,) = [t for i, t in store.read_trajectories(step, split) if i == ident]
        label = store.read_labels().get(ident)
    finally:
        store.close()
    t = trajectory
    return {"id": ident, "step": step, "split": split, "task_id": task_id, "prompt": task_prompt(t.messages),
            "messages": t.messages, "reward": _finite(t.reward),
            "components": {k: _finite(v) for k, v in t.components.items()},
            "reasons": t.metadata.get("reasons", {}), "vetoes": t.metadata.get("vetoes", {}),
            "finish_reason": t.finish_reason, "prompt_tokens": len(t.prompt_ids),
            "spans": token_spans(t.completion_ids, t.completion_mask, tokenizer),
            "label": {"label": label["label"], "note": label["note"]} if label else None}


def token_spans(ids: list[int], mask: list[int], tokenizer=None) -> list[dict[str, Any]]:
    """Runs of equal mask: ``{"trained": bool, "tokens": n, "text": decoded or None}``."""
    spans: list[dict[str, Any]] = []
    start = 0
    for index in range(1, len(ids) + 1):
        if index == len(ids) or mask[index] != mask[start]:
            piece = ids[start:index]
            text = tokenizer.decode(piece, skip_special_tokens=False) if tokenizer is not None else None
            spans.append({"trained": bool(mask[start]), "tokens": len(piece), "text": text})
            start = index
    return spans


def run_base_spec(root: Path, name: str) -> str | None:
    """The base model a run trained on, from its resolved config.toml."""
    try:
        config = tomllib.loads((run_dir(root, name) / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    spec = config.get("model", {}).get("spec")
    return spec if isinstance(spec, str) else None


# --- grooves eval results --------------------------------------------------------------------


def list_evals(folder: Path) -> list[dict[str, Any]]:
    """Every ``<folder>/<name>/eval.json`` written by ``grooves eval``, newest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.glob("*/eval.json"):
        try:
            data = json.loads(path.read_text())
            candidates = [{key: c.get(key) for key in ("name", "model", "kind", "tasks", "reward", "reward_se",
                                                       "success", "latency_p50", "latency_p95", "tokens_per_s",
                                                       "tokens_per_1k", "cost_per_1k")} for c in data["candidates"]]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a file being written, or not grooves eval's
        found.append({"name": path.parent.name, "written": path.stat().st_mtime, "candidates": candidates,
                      "chart": (path.parent / "eval.png").is_file()})
    return sorted(found, key=lambda e: -e["written"])


def eval_chart(folder: Path, name: str) -> Path:
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise RunNotFound(f"{name!r} is not an evaluation name")
    path = folder / name / "eval.png"
    if not path.is_file():
        raise RunNotFound(f"no chart for evaluation {name!r} under {folder}")
    return path
