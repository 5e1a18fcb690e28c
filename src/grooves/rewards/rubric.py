"""A rubric: what a judge is told good and bad look like, as a small TOML file.

The file holds the task, what a good output does, what a bad output does, scored
criteria with weights, and examples (good or bad, each with a short note). Judges get
``Rubric.as_prompt()``; ``PointwiseJudge(name, rubric, endpoint)`` takes a ``Rubric`` as is.

The version is a content hash, not a number in the file: the first 12 hex digits of the
SHA-256 of the validated content and of ``as_prompt()``. Calibration results are stored
against it, so every edit gives a new version, hand edits included (an integer the user
must remember to bump would silently keep old agreement numbers on new content), and so
does a change in how the prompt is rendered; comments, key order and surrounding
whitespace do not.

Validation is strict (unknown keys rejected) and every error names the field's path:
``criteria.1.weight: Input should be greater than 0``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from grooves.scoring import quoted


class RubricError(ValueError):
    """A rubric file that cannot be used; the message names the file and each bad field's path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, validate_assignment=True)


class Criterion(_Strict):
    """One thing the score depends on; the weight says how much, relative to the others."""

    name: str = Field(min_length=1, max_length=80, description="Short name, e.g. 'specific'.")
    description: str = Field("", description="What meeting this criterion looks like, in a sentence.")
    weight: float = Field(1.0, gt=0, description="How much it counts, relative to the other criteria.")


class Example(_Strict):
    """An output the user has judged, so the judge sees the standard and not just its wording."""

    kind: Literal["good", "bad"] = Field(description="'good' or 'bad'.")
    output: str = Field(min_length=1, description="The example output.")
    input: str = Field("", description="The input it answers (optional).")
    note: str = Field("", description="Why it is good or bad, in a line.")


class Rubric(_Strict):
    """The task, what good and bad look like, weighted criteria and examples."""

    task: str = Field(min_length=1, description="What the model is asked to do.")
    good: str = Field("", description="What a good output does.")
    bad: str = Field("", description="What a bad output does.")
    criteria: list[Criterion] = Field(default_factory=list, description="Scored criteria with weights.")
    examples: list[Example] = Field(default_factory=list, description="Judged example outputs.")

    @field_validator("criteria")
    @classmethod
    def _unique_names(cls, criteria: list[Criterion]) -> list[Criterion]:
        seen: set[str] = set()
        for criterion in criteria:
            key = criterion_key(criterion.name)
            if key in seen:
                raise ValueError(f"criterion {criterion.name!r} appears twice")
            seen.add(key)
        return criteria

    @property
    def version(self) -> str:
        """Hash of the content and of the text the judge reads (see the module docstring)."""
        content = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(f"{content}\n{self.as_prompt()}".encode()).hexdigest()[:12]

    def as_prompt(self) -> str:
        """The rubric as the judge reads it."""
        parts = [f"Task: {self.task}"]
        if self.good:
            parts.append(f"A good output: {self.good}")
        if self.bad:
            parts.append(f"A bad output: {self.bad}")
        if self.criteria:
            total = sum(c.weight for c in self.criteria)
            lines = ["Criteria (the share says how much each counts in the score):"]
            for c in self.criteria:
                detail = f": {c.description}" if c.description else ""
                lines.append(f"- {c.name} ({c.weight / total:.0%}){detail}")
            parts.append("\n".join(lines))
        if self.examples:
            lines = ["Examples:"]
            for e in self.examples:
                # examples are often outputs copied from a run: quoted like every output a judge reads
                given = f" (input: {quoted(e.input)})" if e.input else ""
                note = f" Why: {e.note}" if e.note else ""
                lines.append(f"- A {e.kind} output{given}: {quoted(e.output)}{note}")
            parts.append("\n".join(lines))
        return "\n\n".join(parts)

    @classmethod
    def parse(cls, data: dict, source: str = "rubric") -> Rubric:
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise RubricError(f"invalid rubric {source}:\n{format_errors(error)}") from None

    @classmethod
    def load(cls, path: str | Path) -> Rubric:
        path = Path(path)
        if not path.is_file():
            raise RubricError(f"rubric file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise RubricError(f"rubric {path}: not valid TOML ({error})") from None
        return cls.parse(data, str(path))

    def to_toml(self) -> str:
        """The rubric as TOML, criteria and examples as ``[[criteria]]`` / ``[[examples]]`` tables."""
        import tomli_w

        def table(values: dict) -> str:  # empty optional fields are left out, as a person would write it
            return tomli_w.dumps({k: v for k, v in values.items() if v != ""}, multiline_strings=True)

        data = self.model_dump(mode="json")
        parts = [table({k: data[k] for k in ("task", "good", "bad")})]
        for key in ("criteria", "examples"):
            parts += [f"[[{key}]]\n" + table(item) for item in data[key]]
        return "\n".join(parts)

    def save(self, path: str | Path) -> Path:
        """Write the rubric as TOML atomically (temp file + rename): a crash never leaves half a rubric."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with tmp.open("w") as handle:
            handle.write(self.to_toml())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return path


def criterion_key(name: str) -> str:
    """What makes two criterion names the same: case, spaces and punctuation do not count."""
    return re.sub(r"[^0-9a-z]+", "", name.lower())


def format_errors(error: ValidationError) -> str:
    """One line per problem, each starting with the field's dotted path."""
    lines = []
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"{path}: {item['msg']}")
    return "\n".join(lines)
