"""The demo task: write a one-line title for a short technical text.

Texts are standard-library docstrings frozen in ``data/titles.jsonl`` (the first line is
the reference title, the rest is the text). The reward is a transparent verifier of four
equally weighted parts, each in [0, 1]:

- ``format``: one non-empty line, no "Title:" label, no quotes or markdown around it;
- ``length``: 3-10 words scores 1, then 0.15 less per word outside that range;
  both count only for a title that uses at least one content word of its text: otherwise a
  short line that says nothing ("A worthy answer") earned half the reward for any text, and
  the demo's policy learned to write them (docs/demo.md);
- ``grounded``: the share of the title's content words that occur in the text (a title
  that invents facts scores low);
- ``reference``: content-word F1 against the reference title.

Words are compared by their first five letters, a crude stemmer that is enough to match
"sorting" with "sorted".
"""

from __future__ import annotations

import json
import re
from importlib import resources

from grooves.rewards.compose import Component, Reward
from grooves.tasks.sources import split_tasks
from grooves.types import Task

SYSTEM = "You write short, accurate titles for technical texts."
PROMPT = "Write a title of at most ten words for this text. Reply with the title only.\n\nText: {text}"
HELDOUT_FRACTION = 0.3
SPLIT_SEED = 0

_STOPWORDS = set(
    "a an the and or but of to in on for with by from as at is are be been was were it its this that "
    "these those into onto over under not no can may will should would could than then there their "
    "which who whom whose what when where how why all any each every some such only also more most "
    "other another if else do does did done your you our we they them he she his her".split()
)
_LABEL = re.compile(r"^\s*(\*\*)?\s*title\s*[:\-]", re.IGNORECASE)


def tasks(split: str | None = None) -> list[Task]:
    """The built-in title tasks; ``split`` is ``train``, ``heldout`` or None (all)."""
    text = resources.files("grooves.tasks").joinpath("data/titles.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rows.sort(key=lambda row: row["id"])
    for row in rows:
        row["prompt"] = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": PROMPT.format(text=row["text"])}]
    if split is None:
        return rows
    train, heldout = split_tasks(rows, HELDOUT_FRACTION, SPLIT_SEED)
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return train if split == "train" else heldout


def content_stems(text: str) -> list[str]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return [w[:5] for w in words if len(w) >= 3 and w not in _STOPWORDS]


def format_ok(completion: str) -> float:
    stripped = completion.strip()
    if not stripped or "\n" in stripped or _LABEL.match(stripped):
        return 0.0
    if stripped[0] in "\"'*#`" or stripped[-1] in "\"'*`":
        return 0.0
    return 1.0


def length_ok(completion: str) -> float:
    words = len(completion.split())
    distance = max(3 - words, words - 10, 0)
    return max(0.0, 1.0 - 0.15 * distance)


def grounded(completion: str, text: str) -> float:
    title = content_stems(completion)
    if not title:
        return 0.0
    source = set(content_stems(text))
    return sum(stem in source for stem in title) / len(title)


def reference_f1(completion: str, reference: str) -> float:
    title, ref = set(content_stems(completion)), set(content_stems(reference))
    common = len(title & ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(title), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def format_score(completion: str, text: str) -> float:
    """``format_ok``, for a title that uses a word of its text (else 0)."""
    return format_ok(completion) if grounded(completion, text) > 0 else 0.0


def length_score(completion: str, text: str) -> float:
    """``length_ok``, for a title that uses a word of its text (else 0)."""
    return length_ok(completion) if grounded(completion, text) > 0 else 0.0


def reward() -> Reward:
    return Reward([
        Component("format", format_score, weight=0.25),
        Component("length", length_score, weight=0.25),
        Component("grounded", grounded, weight=0.25),
        Component("reference", reference_f1, weight=0.25),
    ])
