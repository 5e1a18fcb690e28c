"""What a scorer reads from a task: its input text, its named arguments, judge-talk patterns,
and how untrusted text is quoted inside a judge's prompt.

A leaf shared by the rewards (judges, guards, verifiers) and the monitors, so the
hacking detectors read a task exactly as the reward does without importing it.
"""

from __future__ import annotations

import html
from typing import Any

from grooves.types import Group, Trajectory

INJECTION_PATTERNS = (
    r"ignore (?:all |any |the )?(?:previous|prior|above|earlier) (?:instructions|rules|prompts?)",
    r"disregard (?:the |all |your )?(?:rubric|instructions|rules)",
    r"\b(?:score|rate|grade|mark) (?:this|me|it|the output)(?: as| with| a)? (?:a )?(?:10|100|\d+ ?/ ?\d+|perfect|full|maximum|high(?:est)?)",
    r"\b(?:give|award|assign) (?:this|me|it)(?: output| answer)? (?:a |the )?(?:10|100|perfect|full|maximum|top|high(?:est)?) (?:score|marks?|rating|grade)",
    r"\b(?:dear|attention|note to (?:the )?)\s*(?:judge|grader|evaluator|reviewer|scorer)s?\b",
    r"\b(?:as|you are) an? (?:ai |llm )?(?:judge|grader|evaluator)\b",
    r"\bsystem prompt\b|<\|im_start\|>|\[/?inst\]",  # chat-template markers have no word boundary
    r"\bthis (?:output|answer|response) (?:is|deserves) (?:perfect|excellent|a 10|the best)",
)
"""Text that addresses or instructs a judge (case-insensitive regular expressions)."""


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
