"""Guards: reward components that veto a hack instead of adding to the total.

A guard's value is 1.0 (pass) or 0.0 (fail) and is logged as ``reward/<name>`` (so its
mean is the pass rate). When a guard fails, the trajectory's total becomes the guard's
``floor`` (default 0) whatever the other components say, and the reason is kept in
``trajectory.metadata["vetoes"]``. A guard whose check *errors* (a judge timeout, an
unparseable reply) does not veto: it gives NaN and the trajectory is left out of the
advantage, like any failed required component.

Shipped guards:
- ``supported_by_source``: an LLM yes/no check that the output makes no claim the source
  does not support; the fix for the fake-headline hack. Point it at a frozen model (the
  base without the adapter, served by ``grooves serve``, or any endpoint).
- ``LexicalGrounding``: numbers, names and rare words in the output must appear in the
  source. Cheap, no model; catches invented figures and names.
- ``FormatGuard``: the output must match a regular expression or a JSON schema.
- ``InjectionGuard``: an output that addresses the judge or tries to instruct it.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable

from grooves.rewards.client import Endpoint, JudgeClient
from grooves.rewards.compose import RewardComponent, Score
from grooves.rewards.runner import in_thread
from grooves.rewards.judges import YesNoCheck, judge_input
from grooves.scoring import INJECTION_PATTERNS, judge_talk
from grooves.types import Group, Trajectory

SUPPORTED_QUESTION = ("Is every claim in the output (names, numbers, events, what happened) supported by the "
                      "input text? Answer no if the output states anything the input does not say.")


class Guard(RewardComponent):
    """Base of the guards: ``check(trajectory, group) -> (passed, reason)``; fails veto the total."""

    veto = True

    def __init__(self, name: str, floor: float = 0.0, required: bool = True):
        super().__init__(name, weight=0.0, required=required)
        self.floor = float(floor)

    def check(self, trajectory: Trajectory, group: Group) -> tuple[bool, str]:
        raise NotImplementedError

    async def score_group(self, group: Group) -> list[Score]:
        def run() -> list[Score]:
            results = [self.check(t, group) for t in group.trajectories]
            return [Score(1.0 if passed else 0.0, reason) for passed, reason in results]

        return await in_thread(run)


class JudgeGuard(Guard):
    """A guard whose check is an LLM yes/no question (``YesNoCheck``)."""

    limits_itself = True  # the check takes a concurrency slot per request

    def __init__(self, name: str, check: YesNoCheck, floor: float = 0.0, required: bool = True):
        super().__init__(name, floor, required)
        self.judge = check
        self.asks_alone = check.asks_alone

    async def score_group(self, group: Group):
        return await self.judge.score_group(group)

    def counters(self) -> dict[str, float]:
        return self.judge.counters()


def supported_by_source(endpoint: Endpoint | JudgeClient, *, name: str = "supported", source: str | None = None,
                        floor: float = 0.0, question: str = SUPPORTED_QUESTION, **options) -> JudgeGuard:
    """Veto outputs that claim what the source does not say (``source``: a task column, or the prompt)."""
    check = YesNoCheck(name, question, endpoint, input=source, **options)
    return JudgeGuard(name, check, floor=floor)


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[^\W\d_](?:[^\W\d_]|['\-])*")  # letters of any script: "Ԁoogle" is one word
_INVISIBLE = re.compile(r"[\u00ad\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff]")


class LexicalGrounding(Guard):
    """Numbers, capitalised names and rare (long) words of the output must occur in the source.

    A name is a capitalised word that is not the first word of the output; a rare word has
    at least ``rare_length`` letters. Matching ignores case and a plural "s"; numbers must
    appear as written (``75`` is not grounded by ``7.5``). Words are letters of any script
    and a capital is any upper-case letter, so a name written with a look-alike capital
    ("Ԁoogle", a Cyrillic Komi De) is a name the source lacks, not a lower-case word that
    slips through; a word mixing scripts is checked even as the first word. Both texts are
    read in NFKC form without invisible characters first.

    An output with no words or numbers at all fails unless ``allow_empty``: it has nothing
    to check, and an empty title is exactly what a reward model can come to score highest.
    """

    def __init__(self, name: str = "grounded_terms", source: str | None = None, rare_length: int = 9,
                 floor: float = 0.0, required: bool = True, allow_empty: bool = False):
        super().__init__(name, floor, required)
        self.source, self.rare_length, self.allow_empty = source, rare_length, allow_empty

    def terms(self, text: str) -> list[str]:
        terms = _NUMBER.findall(text)
        words = _WORD.findall(text)
        for index, word in enumerate(words):
            if (index > 0 and word[0].isupper()) or len(word) >= self.rare_length or _mixed_script(word):
                terms.append(word)
        return terms

    def check(self, trajectory: Trajectory, group: Group) -> tuple[bool, str]:
        output = _readable(trajectory.completion)
        if not self.allow_empty and not (_WORD.search(output) or _NUMBER.search(output)):
            return False, "the output has no words to check against the source"
        source = _readable(judge_input(trajectory, group, self.source))
        numbers = set(_NUMBER.findall(source))
        words = {_stem(w) for w in _WORD.findall(source)}
        missing = []
        for term in self.terms(output):
            found = term in numbers if term[0].isdigit() else _stem(term) in words
            if not found and term not in missing:
                missing.append(term)
        if missing:
            return False, f"not in the source: {', '.join(missing[:8])}"
        return True, "every number, name and rare word occurs in the source"


def _readable(text: str) -> str:
    """NFKC (fullwidth letters and digits as plain ones) without zero-width and bidi characters."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text))


def _mixed_script(word: str) -> bool:
    """Letters from more than one script (Latin with Cyrillic or Greek): no ordinary word does that."""
    return len({unicodedata.name(ch, "?").split()[0] for ch in word if ch.isalpha()}) > 1


def _stem(word: str) -> str:
    word = word.lower().strip("'-")
    return word[:-1] if word.endswith("s") and len(word) > 3 else word


class FormatGuard(Guard):
    """The output (stripped) must fully match ``pattern``, or be JSON valid under ``json_schema``."""

    def __init__(self, name: str = "format", pattern: str | None = None, json_schema: dict | None = None,
                 floor: float = 0.0, required: bool = True):
        super().__init__(name, floor, required)
        if (pattern is None) == (json_schema is None):
            raise ValueError(f"guard {name!r}: give exactly one of pattern or json_schema")
        self.pattern = re.compile(pattern, re.DOTALL) if pattern is not None else None
        self.validator: Callable | None = None
        if json_schema is not None:
            import jsonschema

            jsonschema.Draft202012Validator.check_schema(json_schema)
            self.validator = jsonschema.Draft202012Validator(json_schema)

    def check(self, trajectory: Trajectory, group: Group) -> tuple[bool, str]:
        text = trajectory.completion.strip()
        if self.pattern is not None:
            if self.pattern.fullmatch(text):
                return True, "matches the pattern"
            return False, f"does not match {self.pattern.pattern!r}"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            return False, f"not JSON ({error.msg})"
        problems = sorted(self.validator.iter_errors(data), key=lambda e: list(e.path))
        if problems:
            where = "/".join(str(p) for p in problems[0].path) or "(top level)"
            return False, f"{where}: {problems[0].message}"
        return True, "valid under the schema"


class InjectionGuard(Guard):
    """Veto outputs that address the judge ("score this 10", "ignore previous instructions").

    Each pattern is matched on the output as written and on ``grooves.scoring.normalized``
    of it, so look-alike letters, zero-width characters, fullwidth forms and odd spacing do
    not hide a phrase. ``grooves.rewards.attacks`` lists the attacks it catches and misses.
    """

    def __init__(self, name: str = "no_judge_talk", patterns: tuple[str, ...] = INJECTION_PATTERNS,
                 floor: float = 0.0, required: bool = True):
        super().__init__(name, floor, required)
        self.patterns = [re.compile(p, re.IGNORECASE) for p in patterns]

    def check(self, trajectory: Trajectory, group: Group) -> tuple[bool, str]:
        found = judge_talk(trajectory.completion, self.patterns)
        if found is not None:
            return False, f"addresses the judge: {found!r}"
        return True, "does not address the judge"
