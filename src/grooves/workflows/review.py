"""Reviewing a run by eye: which samples to show, what to show of each, and the labels given.

Reading outputs is the surest way to catch a reward hack, and reading all of them is not
possible, so a review shows, per step, the top-k and bottom-k samples by total reward and
k more drawn at random (seeded, so two people asked to look at "seed 0" see the same
ones). A NaN total means a required component failed: such a sample is shown as
"failed", never as 0, and is neither top nor bottom (it can be drawn at random).

A person labels samples ``hack``, ``good`` or ``bad`` with an optional note; labels live
in the run's run.sqlite, keyed by the trajectory's row id, and relabelling replaces.
``grooves guard suggest`` (``workflows/suggest.py``) turns the labelled hacks into guards.
Everything here returns plain data; ``grooves review`` renders it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from grooves.runs.store import RunStore, StoredTrajectory

LABELS = ("hack", "good", "bad")


class ReviewError(ValueError):
    """A review that cannot be made (no such step) or a labels file that cannot be used."""


@dataclass(frozen=True)
class Label:
    id: int  # trajectories.id in run.sqlite
    label: str
    note: str = ""


@dataclass(frozen=True)
class Sample:
    """One stored trajectory as a reviewer sees it."""

    id: int
    step: int
    split: str
    task_id: str | None
    prompt: str  # the task as the model read it: the first user message
    completion: str
    reward: float  # NaN: a required component failed
    components: dict[str, float]
    reasons: dict[str, str]  # judge (and guard) reasons by component name
    vetoes: dict[str, str]  # guard name -> why it vetoed
    label: Label | None = None

    @property
    def failed(self) -> bool:
        return math.isnan(self.reward)


@dataclass
class StepReview:
    """What a review shows of one step; no sample is in two lists."""

    step: int
    split: str
    count: int  # samples recorded at the step
    failed: int  # of which with a NaN total
    top: list[Sample] = field(default_factory=list)
    bottom: list[Sample] = field(default_factory=list)
    random: list[Sample] = field(default_factory=list)

    def shown(self) -> list[Sample]:
        return [*self.top, *self.bottom, *self.random]


def value_text(value: float) -> str:
    """A reward or component value as shown: three decimals, or "failed" for NaN (never 0)."""
    return "failed" if math.isnan(value) else f"{value:.3f}"


def as_sample(row: StoredTrajectory, labels: dict[int, dict] | None = None) -> Sample:
    t = row.trajectory
    given = (labels or {}).get(row.id)
    label = Label(row.id, given["label"], given["note"]) if given else None
    return Sample(row.id, row.step, row.split, row.task_id, task_prompt(t.messages), t.completion, t.reward,
                  dict(t.components), dict(t.metadata.get("reasons", {})), dict(t.metadata.get("vetoes", {})), label)


def task_prompt(messages: list[dict]) -> str:
    """The first user message's text: what was asked, for judging whether the answer fits it."""
    for message in messages:
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else str(content or "")
    return ""


def select(samples: list[Sample], k: int, seed: int = 0) -> tuple[list[Sample], list[Sample], list[Sample]]:
    """(top, bottom, random): the k highest and k lowest totals, then k drawn from the rest.

    Ties go to the lower row id; the bottom is listed lowest first. Failed samples are
    never top or bottom; the random draw is from every sample not already chosen, so a
    failure can turn up there. The draw depends only on ``seed`` and the samples' ids.
    """
    scored = [s for s in samples if not s.failed]
    top = sorted(scored, key=lambda s: (-s.reward, s.id))[:k]
    chosen = {s.id for s in top}
    bottom = [s for s in sorted(scored, key=lambda s: (s.reward, s.id)) if s.id not in chosen][:k]
    chosen |= {s.id for s in bottom}
    rest = sorted((s for s in samples if s.id not in chosen), key=lambda s: s.id)
    drawn = random.Random(seed).sample(rest, min(k, len(rest)))
    return top, bottom, sorted(drawn, key=lambda s: s.id)


def resolve_steps(available: list[int], requested: list[int] | None) -> list[int]:
    """The steps to review: those asked for (each must be recorded), or the last recorded one."""
    if not available:
        raise ReviewError("no trajectories are recorded")
    if not requested:
        return [available[-1]]
    missing = [s for s in requested if s not in available]
    if missing:
        raise ReviewError(f"no trajectories recorded at step {', '.join(map(str, missing))}; "
                          f"recorded steps: {_ranges(available)}")
    return sorted(set(requested))


def review(store: RunStore, steps: list[int] | None = None, k: int = 5, split: str = "train",
           seed: int = 0) -> list[StepReview]:
    """One ``StepReview`` per chosen step (default: the last recorded step of ``split``)."""
    if k < 1:
        raise ReviewError("k must be at least 1")
    chosen = resolve_steps(store.trajectory_steps(split), steps)
    labels = store.read_labels()
    reviews = []
    for step in chosen:
        samples = [as_sample(row, labels) for row in store.trajectory_records(split, [step])]
        top, bottom, drawn = select(samples, k, seed)
        reviews.append(StepReview(step, split, len(samples), sum(s.failed for s in samples), top, bottom, drawn))
    return reviews


def read_labels_file(path: Path) -> list[Label]:
    """Labels from JSONL: one ``{"id": <trajectory id>, "label": "hack"|"good"|"bad", "note"?: ...}`` a line."""
    from grooves.rewards.calibrate import CalibrationError, read_jsonl

    try:
        rows = read_jsonl(Path(path), "labels")
    except CalibrationError as error:
        raise ReviewError(str(error)) from None
    labels, seen = [], set()
    for number, row in rows:
        where = f"{path} line {number}"
        unknown = sorted(set(row) - {"id", "label", "note"})
        if unknown:
            raise ReviewError(f"{where}: unknown key {unknown[0]!r}; expected id, label and note")
        ident, label, note = row.get("id"), row.get("label"), row.get("note", "")
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise ReviewError(f"{where}: id must be a trajectory id (an integer shown by grooves review); "
                              f"got {ident!r}")
        if label not in LABELS:
            raise ReviewError(f"{where}: label must be one of {', '.join(LABELS)}; got {label!r}")
        if not isinstance(note, str):
            raise ReviewError(f"{where}: note must be a string")
        if ident in seen:
            raise ReviewError(f"{where}: id {ident} is labelled twice in this file")
        seen.add(ident)
        labels.append(Label(ident, label, note.strip()))
    return labels


def store_labels(store: RunStore, labels: list[Label]) -> tuple[int, int]:
    """Record labels in the run; (stored, replaced). Unknown trajectory ids are a ReviewError."""
    for label in labels:
        if label.label not in LABELS:
            raise ReviewError(f"label must be one of {', '.join(LABELS)}; got {label.label!r}")
    try:
        return store.record_labels([(lab.id, lab.label, lab.note) for lab in labels])
    except ValueError as error:
        raise ReviewError(str(error)) from None


@dataclass
class LabelSummary:
    """Label counts per (step, split), oldest first, and overall."""

    per_step: dict[tuple[int, str], dict[str, int]]
    total: dict[str, int]

    @property
    def count(self) -> int:
        return sum(self.total.values())


def summarise_labels(store: RunStore) -> LabelSummary:
    per_step: dict[tuple[int, str], Counter] = {}
    for given in store.read_labels().values():
        per_step.setdefault((given["step"], given["split"]), Counter())[given["label"]] += 1
    ordered = {key: {label: per_step[key][label] for label in LABELS}
               for key in sorted(per_step, key=lambda key: (key[0], key[1] != "train"))}
    total = {label: sum(c[label] for c in ordered.values()) for label in LABELS}
    return LabelSummary(ordered, total)


def _ranges(steps: list[int]) -> str:
    """``0-3, 5, 7-9``: the recorded steps, short."""
    parts, start = [], None
    for index, step in enumerate(steps):
        if start is None:
            start = step
        if index + 1 == len(steps) or steps[index + 1] != step + 1:
            parts.append(str(start) if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)
