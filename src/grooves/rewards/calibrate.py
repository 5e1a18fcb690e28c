"""Judge calibration: score a batch with a rubric's judge, compare with a person's verdicts.

A ``PointwiseJudge`` built from the rubric scores every sample; the person sees the
top-k and bottom-k outputs with their scores and reasons and says, for each, whether
the judge got it right (``agree``), wrong (``disagree``) or cannot tell (``skip``), with
an optional note. The agreement rate is ``agree / (agree + disagree)``.

Judge failures are NaN, shown as failed and never as 0: they are left out of the top
and bottom, and a verdict on one is counted apart (``on_failed``), not in the rate.
Results are stored against ``Rubric.version`` so that edits can be compared.

Sample files are JSONL, one ``{"input": ..., "output": ..., "id": ...}`` per line (``id``
optional: the line number); verdict files are JSONL, one ``{"id": ..., "verdict":
"agree" | "disagree" | "skip", "note": ...}`` per line (``note`` optional), for any
samples of the batch, shown or not.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grooves.rewards.client import Endpoint
from grooves.rewards.compose import Failed, RewardComponent, Score
from grooves.rewards.runner import run_coroutine
from grooves.rewards.judges import PointwiseJudge, judge_input
from grooves.types import Group, Trajectory

VERDICTS = ("agree", "disagree", "skip")


class CalibrationError(ValueError):
    """A samples or verdicts file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Sample:
    """One output to judge and the input it answers."""

    id: str
    input: str
    output: str


@dataclass(frozen=True)
class Scored:
    """A sample with the judge's score in [0, 1] and reason; NaN and the error when it failed."""

    sample: Sample
    score: float
    reason: str

    @property
    def failed(self) -> bool:
        return math.isnan(self.score)


@dataclass(frozen=True)
class Verdict:
    sample_id: str
    verdict: str
    note: str = ""


@dataclass(frozen=True)
class Agreement:
    """Verdict counts; ``rate`` is None when there is no agree/disagree verdict on a scored sample."""

    agree: int
    disagree: int
    skipped: int
    on_failed: int

    @property
    def rate(self) -> float | None:
        judged = self.agree + self.disagree
        return self.agree / judged if judged else None


def read_jsonl(path: Path, what: str) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a bad line is an error naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} does not exist")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise CalibrationError(f"{path} line {number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise CalibrationError(f"{path} line {number}: expected a JSON object")
        rows.append((number, row))
    return rows


def load_samples(path: str | Path) -> list[Sample]:
    """Samples from a JSONL file of ``{"input", "output", "id"?}`` objects."""
    path = Path(path)
    samples = []
    for number, row in read_jsonl(path, "samples"):
        for key in ("input", "output"):
            if not isinstance(row.get(key), str):
                raise CalibrationError(f"{path} line {number}: {key!r} must be a string")
        samples.append(Sample(str(row.get("id", number)), row["input"], row["output"]))
    if not samples:
        raise CalibrationError(f"samples file {path} has no samples")
    _unique([s.id for s in samples], f"samples file {path}")
    return samples


def load_verdicts(path: str | Path, samples: list[Sample]) -> list[Verdict]:
    """Verdicts from a JSONL file; every id must be one of ``samples``."""
    path = Path(path)
    known = {s.id for s in samples}
    verdicts = []
    for number, row in read_jsonl(path, "verdicts"):
        ident, verdict, note = row.get("id"), row.get("verdict"), row.get("note", "")
        if ident is None or str(ident) not in known:
            raise CalibrationError(f"{path} line {number}: id {ident!r} is not a sample of this batch")
        if verdict not in VERDICTS:
            raise CalibrationError(f"{path} line {number}: verdict must be one of {', '.join(VERDICTS)}; "
                                   f"got {verdict!r}")
        if not isinstance(note, str):
            raise CalibrationError(f"{path} line {number}: note must be a string")
        verdicts.append(Verdict(str(ident), verdict, note))
    _unique([v.sample_id for v in verdicts], f"verdicts file {path}")
    return verdicts


def _unique(ids: list[str], where: str) -> None:
    seen: set[str] = set()
    for ident in ids:
        if ident in seen:
            raise CalibrationError(f"{where}: id {ident!r} appears twice")
        seen.add(ident)


def samples_from_trajectories(rows: list[tuple[Any, Trajectory]]) -> list[Sample]:
    """Samples from stored trajectories: (id, trajectory) pairs; the input is what a judge is shown."""
    return [Sample(str(ident), judge_input(t, Group(task={}, trajectories=[t]), None), t.completion)
            for ident, t in rows]


def rubric_judge(rubric: Any, endpoint: Endpoint) -> PointwiseJudge:
    """The judge calibration checks: pointwise, 0-10, normalised to [0, 1], as in training."""
    return PointwiseJudge("rubric", rubric, endpoint)


def score_samples(judge: RewardComponent, samples: list[Sample], concurrency: int = 8) -> list[Scored]:
    """Score each sample on its own (a one-trajectory group); failures become NaN with the error."""
    limit = asyncio.Semaphore(concurrency)

    async def one(sample: Sample) -> Scored:
        trajectory = Trajectory(messages=[{"role": "user", "content": sample.input},
                                          {"role": "assistant", "content": sample.output}],
                                prompt_ids=[], completion_ids=[], completion_mask=[], logprobs=[])
        async with limit:
            try:
                values = await judge.score_group(Group(task={"id": sample.id}, trajectories=[trajectory]))
            except Exception as error:  # one broken sample must not hide the others' scores
                values = [Failed(f"{type(error).__name__}: {error}")]
        return _scored(sample, values[0] if values else Failed("the judge returned nothing"))

    async def every() -> list[Scored]:
        return list(await asyncio.gather(*(one(s) for s in samples)))

    return run_coroutine(every())


def _scored(sample: Sample, value: Any) -> Scored:
    if isinstance(value, Failed):
        return Scored(sample, math.nan, value.error)
    reason = ""
    if isinstance(value, Score):
        value, reason = value.value, value.reason or ""
    number = math.nan if value is None else float(value)
    if not math.isfinite(number):
        return Scored(sample, math.nan, reason or f"returned {value!r}")
    return Scored(sample, number, reason)


def pick(scored: list[Scored], top: int, bottom: int) -> tuple[list[Scored], list[Scored]]:
    """The ``top`` highest and ``bottom`` lowest scored samples; no sample is in both; failures in neither."""
    ranked = sorted((s for s in scored if not s.failed), key=lambda s: s.score, reverse=True)
    best = ranked[:top]
    rest = ranked[len(best):]
    worst = rest[::-1][:bottom] if bottom else []
    return best, worst


def agreement(scored: list[Scored], verdicts: list[Verdict]) -> Agreement:
    """Count verdicts; those on failed samples are counted apart and left out of the rate."""
    failed = {s.sample.id for s in scored if s.failed}
    counts = dict.fromkeys(VERDICTS, 0)
    on_failed = 0
    for v in verdicts:
        if v.sample_id in failed:
            on_failed += 1
        else:
            counts[v.verdict] += 1
    return Agreement(counts["agree"], counts["disagree"], counts["skip"], on_failed)


def verdict_rows(scored: list[Scored], verdicts: list[Verdict]) -> list[dict[str, Any]]:
    """What the store keeps per verdict: the judge's score and reason and the texts judged."""
    by_id = {s.sample.id: s for s in scored}
    rows = []
    for v in verdicts:
        s = by_id[v.sample_id]
        rows.append({"sample_id": v.sample_id, "score": None if s.failed else s.score, "reason": s.reason,
                     "verdict": v.verdict, "note": v.note, "input": s.sample.input, "output": s.sample.output})
    return rows
