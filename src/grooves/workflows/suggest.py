"""Guards from labelled hacks: what would have vetoed them, and what else it would veto.

From the samples a person labelled ``hack`` (``grooves review --label``) this proposes:

- ``exact_output``: at least two hacks give one output word for word; veto exactly that output.
- ``shared_phrase``: the longest word n-gram (3 to 30 words) found in the most hacks; veto
  any output containing it, whatever the case and punctuation between the words.
- ``lexical_grounding``: the hacks name numbers, names or rare words their source does
  not contain (proposed only when that check catches at least one hack).
- ``supported_by_source``: an LLM yes/no check against the source; it needs a judge, so it
  is proposed but not evaluated here.

The TOML guard config has no pattern list for ``injection`` (its ``pattern`` key belongs
to ``format``, and an injection guard ignores it), so a pattern proposal is written as a
``format`` guard whose whole-output regex is a negative lookahead, ``(?is)(?!.*?P).*``:
it passes exactly the outputs in which ``P`` does not occur. The Python form is given
too, as an ``InjectionGuard(patterns=...)``. Each evaluated proposal is built from its
own TOML by the config loader, then run over every stored trajectory, so the veto counts
are those of the guard the config would get. A guard that vetoes samples labelled good
is too broad.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from grooves.runs.store import RunStore, StoredTrajectory, write_atomic
from grooves.types import Group, Task

CATEGORIES = ("hack", "good", "bad", "unlabelled")
_WORDS = re.compile(r"\w+")
MIN_WORDS, MAX_WORDS = 3, 30


class SuggestError(ValueError):
    """No labelled hacks, a source that cannot be found, or a config that cannot take the guard."""


@dataclass
class VetoCounts:
    """How many stored trajectories of each category (hack, good, bad, unlabelled) the guard vetoes."""

    vetoed: dict[str, int]
    total: dict[str, int]
    missed_hacks: list[int] = field(default_factory=list)  # trajectory ids
    vetoed_good: list[int] = field(default_factory=list)


@dataclass
class Proposal:
    kind: str  # exact_output, shared_phrase, lexical_grounding, supported_by_source
    name: str  # the guard's component name (reward/<name>)
    summary: str
    toml: str  # one [[reward.components]] table
    python: str
    note: str = ""
    counts: VetoCounts | None = None  # None: needs a judge, not evaluated offline


def suggest(store: RunStore, tasks: dict[str, Task] | None = None, source: str | None = None,
            endpoint: str = "frozen") -> list[Proposal]:
    """Proposals from the run's labelled hacks, each evaluated on every stored trajectory it can be.

    ``source`` is the task column holding the source text (``tasks`` maps task ids to tasks);
    without it the source is the sample's user message, as the guards' own default.
    """
    labels = {ident: given["label"] for ident, given in store.read_labels().items()}
    rows = store.trajectory_records()
    hacks = [row for row in rows if labels.get(row.id) == "hack"]
    if not hacks:
        raise SuggestError("no samples are labelled 'hack' in this run; label some with "
                           "'grooves review RUN --label' or '--labels FILE' first")
    groups = _groups(rows, tasks or {}, source)
    proposals = [p for p in (exact_output(hacks), shared_phrase(hacks), lexical_grounding(source)) if p]
    for proposal in proposals:
        proposal.counts = evaluate(proposal, rows, groups, labels)
    # Grounding is a generic check: worth proposing only when the hacks do invent terms.
    proposals = [p for p in proposals if p.kind != "lexical_grounding" or p.counts.vetoed["hack"]]
    return [*proposals, supported(source, endpoint, hacks)]


def exact_output(hacks: list[StoredTrajectory]) -> Proposal | None:
    """Veto the output the hacks repeat most; only when one repeats (in at least two hacks): a guard
    from a single example is a guess about what the hack is."""
    counts = Counter(" ".join(row.trajectory.completion.split()).casefold() for row in hacks)
    counts.pop("", None)
    if not counts:
        return None
    text, count = min(counts.items(), key=lambda item: (-item[1], item[0]))
    if count < 2:
        return None
    original = next(row.trajectory.completion for row in hacks
                    if " ".join(row.trajectory.completion.split()).casefold() == text)
    pattern = r"\A\s*" + r"\s+".join(re.escape(part) for part in original.split()) + r"\s*\Z"
    summary = f"the whole output is {_clip(' '.join(original.split()))!r} ({count} of {len(hacks)} hacks)"
    return _pattern_proposal("exact_output", "no_repeated_output", pattern, summary)


def shared_phrase(hacks: list[StoredTrajectory]) -> Proposal | None:
    """Veto outputs containing the longest word n-gram found in the most hacks (at least two)."""
    seen_in: Counter = Counter()
    first: dict[tuple[str, ...], int] = {}
    for row in hacks:
        words = _WORDS.findall(row.trajectory.completion.lower())
        mine: set[tuple[str, ...]] = set()
        for i in range(len(words)):  # in reading order, so ties go to the phrase met first
            for gram in (tuple(words[i:i + n]) for n in range(MIN_WORDS, min(MAX_WORDS, len(words) - i) + 1)):
                if gram not in mine:
                    mine.add(gram)
                    seen_in[gram] += 1
                    first.setdefault(gram, len(first))
    shared = [gram for gram, count in seen_in.items() if count >= 2]
    if not shared:
        return None
    best = min(shared, key=lambda gram: (-seen_in[gram], -len(gram), first[gram]))
    pattern = r"\b" + r"\W+".join(re.escape(word) for word in best) + r"\b"
    summary = f"the output contains {' '.join(best)!r} (in {seen_in[best]} of {len(hacks)} hacks)"
    return _pattern_proposal("shared_phrase", "no_shared_phrase", pattern, summary)


def _pattern_proposal(kind: str, name: str, pattern: str, summary: str) -> Proposal:
    lookahead = f"(?is)(?!.*?{pattern}).*"
    toml = _table(f"vetoes when {summary}", {"kind": "guard", "guard": "format", "name": name, "pattern": lookahead})
    python = (f"from grooves.rewards import InjectionGuard\n"
              f"InjectionGuard({name!r}, patterns=({_python_string(pattern)},))  # case-insensitive; these "
              f"patterns replace INJECTION_PATTERNS")
    note = "its regex passes only outputs without the pattern, so its veto reason reads 'does not match ...'"
    return Proposal(kind, name, summary, toml, python, note)


def lexical_grounding(source: str | None) -> Proposal:
    where = f"the task column {source!r}" if source else "the user message"
    fields = {"kind": "guard", "guard": "lexical_grounding", "name": "grounded_terms"}
    if source:
        fields["source"] = source
    summary = f"a number, name or rare word of the output is not in {where}"
    return Proposal("lexical_grounding", "grounded_terms", summary, _table(f"vetoes when {summary}", fields),
                    f"from grooves.rewards import LexicalGrounding\nLexicalGrounding({_source_argument(source)})")


def supported(source: str | None, endpoint: str, hacks: list[StoredTrajectory]) -> Proposal:
    fields = {"kind": "guard", "guard": "supported_by_source", "name": "supported", "endpoint": endpoint}
    if source:
        fields["source"] = source
    example = _clip(" ".join(hacks[0].trajectory.completion.split()))
    summary = "an LLM finds a claim the source does not support"
    arguments = ", ".join(["endpoint", _source_argument(source)] if source else ["endpoint"])
    return Proposal(
        "supported_by_source", "supported", summary, _table(f"vetoes when {summary}", fields),
        f"from grooves.rewards import supported_by_source\nsupported_by_source({arguments})",
        f"needs a judge, so not evaluated here; point [reward.endpoints.{endpoint}] at a frozen model. "
        f"A hack it should catch: {example!r}")


def evaluate(proposal: Proposal, rows: list[StoredTrajectory], groups: list[Group],
             labels: dict[int, str]) -> VetoCounts:
    """Run the guard the proposal's TOML builds over every stored trajectory; count its vetoes."""
    guard = build_guard(proposal.toml)
    counts = VetoCounts(dict.fromkeys(CATEGORIES, 0), dict.fromkeys(CATEGORIES, 0))
    for row, group in zip(rows, groups, strict=True):
        category = labels.get(row.id, "unlabelled")
        passed, _ = guard.check(row.trajectory, group)
        counts.total[category] += 1
        counts.vetoed[category] += not passed
        if category == "hack" and passed:
            counts.missed_hacks.append(row.id)
        if category == "good" and not passed:
            counts.vetoed_good.append(row.id)
    return counts


def build_guard(toml: str):
    """The guard a ``[[reward.components]]`` table builds, through the config loader itself."""
    from grooves.rewards.config import RewardConfig, build_components
    from grooves.serve.local import local_url

    table = tomllib.loads(toml)["reward"]["components"]
    return build_components(RewardConfig(components=table), local_url)[0]


def _groups(rows: list[StoredTrajectory], tasks: dict[str, Task], source: str | None) -> list[Group]:
    """A one-sample group per row: what a guard's ``check`` needs to find the source."""
    if source:
        missing = sorted({str(row.task_id) for row in rows if source not in tasks.get(str(row.task_id), {})})
        if missing:
            raise SuggestError(f"source column {source!r} is missing for task id {', '.join(missing[:5])}"
                               f"{' ...' if len(missing) > 5 else ''} (the tasks given do not hold them)")
    return [Group(task=tasks.get(str(row.task_id), {"id": row.task_id}), trajectories=[row.trajectory])
            for row in rows]


def _table(comment: str, fields: dict[str, str]) -> str:
    lines = [f"# grooves guard suggest: {' '.join(comment.split())}", "[[reward.components]]"]
    lines += [f"{key} = {_toml_string(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def _toml_string(value: str) -> str:
    """A basic string ("..."), or a literal one ('...') where backslashes (a regex) would double."""
    plain = not any(ord(ch) < 32 or ord(ch) == 127 for ch in value)
    if plain and "\\" in value and "'" not in value:
        return f"'{value}'"
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _python_string(value: str) -> str:
    """A raw string literal where it can be: a regex reads as written."""
    return f"r'{value}'" if "'" not in value and "\n" not in value and not value.endswith("\\") else repr(value)


def _source_argument(source: str | None) -> str:
    return f"source={source!r}" if source else ""


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def append_proposal(config: Path, proposal: Proposal) -> None:
    """Append the proposal's table to a run config; refuse what would not load as intended."""
    config = Path(config)
    if not config.is_file():
        raise SuggestError(f"config file {config} does not exist")
    text = config.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SuggestError(f"{config} is not valid TOML ({error}); fix it before adding a guard") from None
    if "mix" in data:
        raise SuggestError(f"{config} has [[mix]] task sets: paste the table into the right set's "
                           "reward by hand, as [[mix.reward.components]]")
    names = [c.get("name") for c in data.get("reward", {}).get("components", [])]
    if proposal.name in names:
        raise SuggestError(f"{config} already has a reward component named {proposal.name!r}")
    updated = text + ("" if text.endswith("\n") or not text else "\n") + "\n" + proposal.toml
    tomllib.loads(updated)  # the table is generated: a failure here is a bug, not bad input
    write_atomic(config, updated)
