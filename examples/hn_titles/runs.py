"""Reading the two runs back: metrics, alerts and stored samples, as plain Python data.

The report needs a few things the run folder has but no grooves command prints together:
which detector fired first, which titles were shared by many tasks, and what the lexical
grounding guard would have said about run A, which trained without it. Everything here
reads ``metrics.jsonl``, ``config.toml`` and ``run.sqlite`` (opened read-only, so a report
can be written while a run is still training).
"""

from __future__ import annotations

import json
import math
import sqlite3
import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from grooves.monitors.text import normalise
from grooves.rewards import LexicalGrounding
from grooves.runs.store import read_metrics
from grooves.types import Group, Trajectory


@dataclass
class Sample:
    """One stored trajectory, reduced to what the report shows."""

    step: int
    split: str
    task_id: str
    reward: float
    components: dict[str, float]
    completion: str
    trajectory: Trajectory


@dataclass
class RunData:
    label: str
    name: str
    dir: Path
    metrics: list[dict] = field(default_factory=list)
    alerts: list[dict] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)  # task id -> the README text the title is for

    @property
    def steps(self) -> int:
        return max((row["step"] for row in self.metrics), default=0)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, skipping steps where it is missing or null."""
        points = [(row["step"], row[key]) for row in self.metrics if row.get(key) is not None]
        return [s for s, _ in points], [v for _, v in points]

    def val_steps(self) -> list[int]:
        return sorted({s.step for s in self.samples if s.split == "val"})


def _task_texts(run_dir: Path) -> dict[str, str]:
    """Task id -> text, from the tasks file the run's resolved config names."""
    config_path = run_dir / "config.toml"
    if not config_path.exists():
        return {}
    source = Path(tomllib.loads(config_path.read_text()).get("tasks", {}).get("source", ""))
    if not source.is_file() or source.suffix != ".jsonl":
        return {}
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    return {str(row["id"]): row["text"] for row in rows if "text" in row}


def load_run(label: str, run_dir: Path) -> RunData:
    """Everything the report reads from one run folder (empty when the run has not started)."""
    data = RunData(label, run_dir.name, run_dir)
    if not (run_dir / "run.sqlite").exists():
        return data
    data.metrics = read_metrics(run_dir / "metrics.jsonl")
    data.texts = _task_texts(run_dir)
    db = sqlite3.connect(f"file:{run_dir / 'run.sqlite'}?mode=ro", uri=True)
    try:
        for step, detector, severity, message, evidence in db.execute(
                "SELECT step, detector, severity, message, evidence FROM alerts ORDER BY id"):
            data.alerts.append({"step": step, "detector": detector, "severity": severity, "message": message,
                                "evidence": json.loads(evidence)})
        for step, split, task_id, reward, components, completion, raw in db.execute(
                "SELECT step, split, task_id, reward, components, completion, data FROM trajectories ORDER BY id"):
            values = {k: (math.nan if v is None else v) for k, v in json.loads(components).items()}
            data.samples.append(Sample(step, split, task_id, math.nan if reward is None else reward, values,
                                       completion or "", Trajectory.from_dict(json.loads(raw))))
    finally:
        db.close()
    return data


def source_text(run: RunData, sample: Sample) -> str:
    """The README the title was written for: the task's ``text``, else the user message."""
    if sample.task_id in run.texts:
        return run.texts[sample.task_id]
    users = [m.get("content") or "" for m in sample.trajectory.messages if m.get("role") == "user"]
    return users[-1] if users else ""


def lexical_verdicts(run: RunData, samples: list[Sample]) -> list[bool]:
    """The lexical grounding guard's pass/fail on stored samples, computed offline (run A has no guards)."""
    guard = LexicalGrounding(source="text")
    verdicts = []
    for sample in samples:
        group = Group(task={"id": sample.task_id, "text": source_text(run, sample)}, trajectories=[sample.trajectory])
        verdicts.append(guard.check(sample.trajectory, group)[0])
    return verdicts


def offline_grounding_series(run: RunData) -> tuple[list[int], list[float]]:
    """Per training step, the share of samples that pass lexical grounding (for runs without the guard)."""
    by_step: dict[int, list[Sample]] = defaultdict(list)
    for sample in run.samples:
        if sample.split == "train":
            by_step[sample.step].append(sample)
    steps = sorted(by_step)
    return steps, [sum(v) / len(v) for v in (lexical_verdicts(run, by_step[s]) for s in steps)]


def first_alerts(run: RunData) -> list[dict]:
    """Per detector: the first step it fired, its severity then, how often it fired, its first message."""
    out: dict[str, dict] = {}
    for alert in run.alerts:
        entry = out.setdefault(alert["detector"], {**alert, "count": 0, "critical_step": None})
        entry["count"] += 1
        if alert["severity"] == "critical" and entry["critical_step"] is None:
            entry["critical_step"] = alert["step"]
    return sorted(out.values(), key=lambda a: (a["step"], a["detector"]))


def repeated_outputs(run: RunData, last: int = 10, top: int = 5) -> list[dict]:
    """The normalised training outputs of the last ``last`` steps shared by the most different tasks."""
    first = run.steps - last + 1
    clusters: dict[str, dict] = {}
    for sample in run.samples:
        if sample.split != "train" or sample.step < first:
            continue
        key = normalise(sample.completion)
        entry = clusters.setdefault(key, {"text": sample.completion.strip(), "outputs": 0, "tasks": set(),
                                          "hn_points": []})
        entry["outputs"] += 1
        entry["tasks"].add(sample.task_id)
        entry["hn_points"].append(sample.components.get("hn_points", math.nan))
    ranked = sorted(clusters.values(), key=lambda c: (-len(c["tasks"]), -c["outputs"]))
    return [{**c, "tasks": len(c["tasks"]), "hn_points": _mean(c["hn_points"])} for c in ranked[:top]]


def heldout_samples(run: RunData, step: int) -> list[Sample]:
    return [s for s in run.samples if s.split == "val" and s.step == step]


def distinct_share(samples: list[Sample]) -> float:
    """Distinct normalised outputs per output: 1.0 when every title differs, 1/n when all are one."""
    if not samples:
        return math.nan
    return len({normalise(s.completion) for s in samples}) / len(samples)


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def window_mean(run: RunData, key: str, first: int, last: int) -> float:
    """Mean of a metric over training steps first..last (inclusive)."""
    steps, values = run.series(key)
    return _mean([v for s, v in zip(steps, values) if first <= s <= last and s > 0])
