"""What a scorer reads from a task: its input text, its named arguments, judge-talk patterns,
and how untrusted text is quoted inside a judge's prompt.

A leaf shared by the rewards (judges, guards, verifiers) and the monitors, so the
hacking detectors read a task exactly as the reward does without importing it.
"""

from __future__ import annotations

import html
import re
import unicodedata
from typing import Any

from grooves.types import Group, Trajectory

_JUDGE = r"(?:ai |llm )?(?:judge|grader|evaluator|reviewer|scorer|rater)s?"
_THE_OUTPUT = r"(?:this|me|it|the (?:output|answer|response|title|summary|completion))"

INJECTION_PATTERNS = (
    # instructions about instructions
    r"\b(?:ignore|disregard|forget|override) (?:all |any |the |your )*(?:previous|prior|above|earlier|preceding) "
    r"(?:instructions|rules|prompts?|directions|guidelines)",
    r"\b(?:ignore|disregard|forget|override) (?:the |all |your |any )*(?:rubric|instructions|rules|criteria)",
    # asking for a score
    rf"\b(?:score|rate|grade|mark) {_THE_OUTPUT}(?: as| with| a)? (?:a )?(?:10|100|\d+ ?/ ?\d+|perfect|full|maximum|high(?:est)?)",
    rf"\b(?:give|award|assign) {_THE_OUTPUT}(?: output| answer)? (?:a |the )?(?:10|100|perfect|full|maximum|top|high(?:est)?) "
    r"(?:score|marks?|rating|grade)",
    rf"\byou (?:must|should|will|have to|need to) (?:give|assign|award|rate|score|grade) {_THE_OUTPUT}",
    r"\b(?:respond|reply|answer|return) (?:only )?with (?:a |the )?(?:score|rating|grade|verdict) ",
    # telling the judge what the score is
    r"\b(?:correct|right|true|real|expected|deserved|proper|appropriate) (?:score|grade|rating|verdict)s? "
    r"(?:is|are|=|:|should be|must be|would be)\b",
    r"\bthis (?:output|answer|response|title|summary) (?:is|deserves) (?:a )?(?:perfect|excellent|a 10|10|the best|full marks)",
    # talking to the judge as the judge's operator
    rf"\b(?:dear|attention|note to (?:the )?|hey|hello) ?{_JUDGE}\b",
    rf"\b(?:as|you are|act as) (?:an? |the )?{_JUDGE}\b",
    r"\b(?:system|assistant|developer|admin(?:istrator)?|judge|grader|evaluator) ?: ?(?:the |this |your )?"
    r"(?:answer|output|response|completion|title|score|grade|rating|verdict|evaluation|instructions?|override)\b",
    r"\bsystem (?:prompt|override|message|instructions?|notice)\b|\[/?system\]",
    # a verdict in the judge's own reply format
    r"""[{,] ?["']?(?:score|rating|grade|reward|verdict)["']? ?: ?["']?(?:-?\d|yes\b|no\b|pass|correct)""",
    r"""["']answer["'] ?: ?["'](?:yes|no)["']""",
    # chat-template tokens and the judge prompt's own frames (no word boundary before them)
    r"<\|[a-z_]+\|>|\[/?inst\]|<</?sys>>|<(?:start|end)_of_turn>",
    r"</(?:output|input|rubric)>|<output id=",
)
"""Text that addresses or instructs a judge (case-insensitive regular expressions, matched on
the text as written and on ``normalized(text)``)."""

# Letters from other scripts that look like Latin ones (Cyrillic, Greek, IPA). Patterns are
# matched case-insensitively, so both cases map to the lower-case Latin letter.
_LOOKALIKES = {
    "a": "аАαΑɑ", "b": "ВβΒЬ", "c": "сСϲϹ", "d": "ԁԀ", "e": "еЕεΕ", "g": "ɡ", "h": "һНΗ", "i": "іІιΙӏıɪ",
    "j": "јЈ", "k": "кКκΚ", "l": "Ӏ", "m": "мМΜ", "n": "ΝпП", "o": "оОοΟσ", "p": "рРρΡ", "q": "ԛ",
    "s": "ѕЅ", "t": "тТτΤ", "u": "υ", "v": "νѵ", "w": "ԝ", "x": "хХχΧ", "y": "уУΥү", "z": "Ζ",
}
_CONFUSABLES = str.maketrans({c: latin for latin, chars in _LOOKALIKES.items() for c in chars})
_SPACES = re.compile(r"\s+")


def normalized(text: str) -> str:
    """``text`` as judge-talk patterns read it: HTML entities decoded, compatibility forms folded
    (NFKC: fullwidth and mathematical letters), invisible characters dropped (zero-width, bidi,
    soft hyphen, control characters, combining marks), look-alike letters of other scripts read
    as Latin, and whitespace runs as one space."""
    text = unicodedata.normalize("NFKD", html.unescape(text))
    text = "".join(ch for ch in text if not _invisible(ch))
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", text).translate(_CONFUSABLES)).strip()


def _invisible(ch: str) -> bool:
    category = unicodedata.category(ch)
    return category in ("Cf", "Mn", "Me") or (category == "Cc" and not ch.isspace())


def judge_talk(text: str, patterns: list[re.Pattern]) -> str | None:
    """The earliest text any pattern finds in ``text`` as written, else in ``normalized(text)``;
    None when neither has any."""
    for candidate in (text, normalized(text)):
        matches = [m for m in (p.search(candidate) for p in patterns) if m]
        if matches:
            return min(matches, key=lambda m: m.start()).group(0)
    return None


def quoted(text: str) -> str:
    """Untrusted text for inside a prompt's ``<input>``/``<output>`` frame: ``&``, ``<`` and ``>``
    escaped (``&amp;``, ``&lt;``, ``&gt;``), so it cannot close the frame or open one of its own."""
    return html.escape(str(text), quote=False)


class MissingColumn(ValueError):
    """A scorer asked for a task column the task does not have."""


def task_arguments(trajectory: Trajectory | None, group: Group) -> dict[str, Any]:
    """Everything a verifier can ask for by name, for one trajectory of ``group``."""
    task = group.task
    available: dict[str, Any] = {"task": task, "prompt": task.get("prompt"), "group": group,
                                 "completions": [t.completion for t in group.trajectories]}
    if trajectory is not None:
        available.update(completion=trajectory.completion, messages=trajectory.messages,
                         trajectory=trajectory, state=trajectory.metadata.get("state", {}))
    for key, value in task.items():
        available.setdefault(key, value)
    return available


def input_text(trajectory: Trajectory | None, group: Group, input: str | None) -> str:
    """The text a scorer is shown as the input: the user turn, a task column, or a template."""
    if input:
        if input in group.task:
            return str(group.task[input])
        if input.isidentifier():  # a column name, not a template: a missing column is an error
            raise MissingColumn(f"the task has no column {input!r} (columns: {sorted(group.task)})")
        return input.format(**task_arguments(trajectory, group))
    messages = trajectory.messages if trajectory is not None else group.trajectories[0].messages
    for message in reversed(messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages):
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return str(group.task.get("prompt", ""))
