"""The rubric interview: a few questions about the task, then a rubric file.

Built so that a weak model cannot lose the user's words:

- the topics are a fixed skeleton (``SKELETON``): the task, what a good output does, what
  a bad one does, the criteria and how much each matters, an example. The model only
  phrases each question in the context of the answers so far; when its reply is
  unusable (no question mark, empty, too long) the skeleton's plain question is asked;
- the answers go into the rubric verbatim (task, good, bad, the example);
- the model drafts the criteria as JSON (``JudgeClient.ask`` with a schema), and the
  criteria the user named are always kept: merged with the draft, deduplicated by
  name, the user's weight and wording winning;
- with no endpoint, or one that cannot be reached, the plain questions are asked and
  the caller is told once (``warn``).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grooves.rewards.client import Endpoint, JudgeClient, JudgeError, ReplyError
from grooves.rewards.runner import run_coroutine
from grooves.rewards.rubric import Criterion, Example, Rubric, criterion_key


@dataclass(frozen=True)
class Topic:
    """One fixed step of the interview: what it is about and the plain question for it."""

    key: str
    about: str
    question: str


SKELETON = (
    Topic("task", "the task: what the model is given and what it should produce",
          "What does the model get as input, and what should its output be (form, length, audience)?"),
    Topic("good", "what a good output does",
          "What does a good output do? What would make you say it is excellent?"),
    Topic("bad", "what a bad output does",
          "What does a bad output do? Which mistakes do you most want to stop?"),
    Topic("criteria", "the criteria the score depends on and how much each matters",
          "Which criteria should the score depend on, and how much does each matter? "
          "(one per line or separated by ';', e.g. 'specific: 2 - names who did what')"),
    Topic("example", "one example output, whether it is good or bad, and why",
          "Can you give one example output and say whether it is good or bad, and why? "
          "(e.g. 'bad: You won't believe this! / why: clickbait')"),
)

SYSTEM = ("You help a user write a grading rubric for an AI model's outputs. You ask one short, "
          "clear question at a time and answer with a single JSON object and nothing else.")

QUESTION_PROMPT = """The user is writing a rubric for this task: {task}

The interview so far:
{transcript}

Next topic: {about}
Plain question: {question}

Rephrase the plain question for this task in one or two sentences ending with a question mark.
Ask only about the next topic. Reply with JSON: {{"question": "..."}}"""

DRAFT_PROMPT = """The user is writing a rubric for this task: {task}

Their answers:
{transcript}

List the criteria a grader should score outputs on: a short name, one sentence saying what
meeting it looks like (in the user's terms), and a weight from 1 (minor) to 5 (most important).
Keep every criterion the user named. Reply with JSON:
{{"criteria": [{{"name": "...", "description": "...", "weight": <number>}}]}}"""

QUESTION_SCHEMA = {"type": "object", "properties": {"question": {"type": "string", "maxLength": 300}},
                   "required": ["question"], "additionalProperties": False}
DRAFT_SCHEMA = {"type": "object", "properties": {"criteria": {"type": "array", "maxItems": 8, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 60},
                                     "description": {"type": "string", "maxLength": 200},
                                     "weight": {"type": "number"}},
    "required": ["name", "description", "weight"], "additionalProperties": False}}},
    "required": ["criteria"], "additionalProperties": False}

NO_ANSWER = {"", "-", "none", "n/a", "skip"}


class Interviewer:
    """Phrases questions and drafts criteria through an endpoint, if there is a usable one."""

    def __init__(self, task: str, endpoint: Endpoint | None, warn: Callable[[str], None]):
        self.task = task
        self.client = JudgeClient(endpoint, "rubric-interview") if endpoint else None
        self.warn = warn
        self.unusable = 0  # replies that came back but could not be used (the plain text was used)
        if endpoint is None:
            warn("no model endpoint given; asking the plain questions")

    def question(self, topic: Topic, answers: dict[str, str]) -> str:
        """The model's phrasing of ``topic``'s question, or the plain question."""
        prompt = QUESTION_PROMPT.format(task=self.task, transcript=_transcript(answers) or "(nothing yet)",
                                        about=topic.about, question=topic.question)

        def check(reply: dict) -> str:
            text = " ".join(str(reply.get("question", "")).split())
            if not 8 <= len(text) <= 300 or "?" not in text:
                raise ReplyError("'question' must be one short question, with a question mark")
            return text

        return self._ask(prompt, QUESTION_SCHEMA, check) or topic.question

    def draft_criteria(self, answers: dict[str, str]) -> list[Criterion]:
        """The model's criteria from the answers; [] without a usable reply."""
        prompt = DRAFT_PROMPT.format(task=self.task, transcript=_transcript(answers))

        def check(reply: dict) -> list[Criterion]:
            drafted = []
            for item in reply.get("criteria") or []:
                if not isinstance(item, dict) or not str(item.get("name", "")).strip():
                    continue
                weight = item.get("weight")
                weight = min(5.0, max(1.0, float(weight))) if isinstance(weight, (int, float)) else 1.0
                drafted.append(Criterion(name=str(item["name"])[:80], weight=weight,
                                         description=str(item.get("description", ""))))
            if not drafted:
                raise ReplyError("'criteria' must list at least one criterion with a name")
            return drafted

        return self._ask(prompt, DRAFT_SCHEMA, check) or []

    def _ask(self, prompt: str, schema: dict, check: Callable):
        """``client.ask`` or None; an endpoint that fails (not just a bad reply) is dropped with a warning."""
        if self.client is None:
            return None
        unparseable = self.client.stats["unparseable"]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        try:
            return run_coroutine(self.client.ask(messages, schema, check))
        except JudgeError as error:
            if self.client.stats["unparseable"] == unparseable:  # no reply came at all: the endpoint is down
                self.warn(f"no usable endpoint ({error}); asking the plain questions")
                self.client = None
            else:
                self.unusable += 1
            return None


def interview(task: str, answer: Callable[[Topic, str], str], endpoint: Endpoint | None = None,
              warn: Callable[[str], None] = print) -> Rubric:
    """Ask every topic of ``SKELETON`` through ``answer(topic, question)`` and build the rubric."""
    interviewer = Interviewer(task, endpoint, warn)
    answers: dict[str, str] = {}
    for topic in SKELETON:
        reply = answer(topic, interviewer.question(topic, answers)).strip()
        answers[topic.key] = "" if reply.lower() in NO_ANSWER else reply
    stated = parse_criteria(answers["criteria"])
    drafted = interviewer.draft_criteria(answers) if any(answers.values()) else []
    if interviewer.unusable:
        warn(f"{interviewer.unusable} of the model's replies were unusable; the plain question was asked "
             "or its criteria draft left out (your answers are all kept)")
    details = [task.strip(), answers["task"]]
    return Rubric(task="\n\n".join(d for d in details if d), good=answers["good"], bad=answers["bad"],
                  criteria=merge_criteria(stated, drafted),
                  examples=[e for e in [parse_example(answers["example"])] if e is not None])


def _transcript(answers: dict[str, str]) -> str:
    topics = {t.key: t for t in SKELETON}
    return "\n".join(f"- {topics[key].about}: {text[:400]}" for key, text in answers.items() if text)


_BULLET = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s+")
_WEIGHTED = re.compile(r"^(?P<name>.+?)\s*(?::\s*|\(\s*|\s+x\s*|\s+weight\s+)(?P<weight>\d+(?:\.\d+)?)\s*\)?"
                       r"\s*(?:[-\u2013\u2014:]\s*(?P<description>.*))?$", re.IGNORECASE)
_DESCRIPTION_MARK = re.compile(r"\s[-\u2013\u2014]\s")
_DESCRIBED = re.compile(r"^(?P<name>[^:\u2013\u2014]+?)\s*(?::|\s-\s|\s\u2013\s|\s\u2014\s)\s*(?P<description>.+)$")


@dataclass
class Stated:
    """A criterion as the user wrote it; ``weight`` is None where they gave none."""

    name: str
    description: str = ""
    weight: float | None = None


def parse_criteria(text: str) -> list[Stated]:
    """The user's criteria: one per line or ';' (',' on a single line), each ``name[: weight][ - description]``.

    Words that fit no pattern still land: a long phrase keeps its first words as the
    name and the whole phrase as the description.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) == 1 and ";" not in lines[0] and not _DESCRIPTION_MARK.search(lines[0]):
        items = lines[0].split(",")  # a one-line list; commas inside a description keep it whole
    else:
        items = [part for line in lines for part in line.split(";")]
    stated = []
    for item in items:
        item = _BULLET.sub("", item).strip().rstrip(".")
        if not item:
            continue
        weighted, described = _WEIGHTED.match(item), _DESCRIBED.match(item)
        if weighted:
            stated.append(Stated(weighted["name"].strip(), (weighted["description"] or "").strip(),
                                 float(weighted["weight"])))
        elif described and len(described["name"]) <= 60:
            stated.append(Stated(described["name"].strip(), described["description"].strip()))
        elif len(item) > 60:
            stated.append(Stated(" ".join(item.split()[:5]), item))
        else:
            stated.append(Stated(item))
    return [s for s in stated if s.name and (s.weight is None or s.weight > 0)]


def merge_criteria(stated: list[Stated], drafted: list[Criterion]) -> list[Criterion]:
    """The user's criteria first (their wording and weight win), then the draft's new ones."""
    merged: dict[str, Criterion] = {}
    drafts = {criterion_key(c.name): c for c in drafted}
    for s in stated:
        key = criterion_key(s.name)
        if not key or key in merged:
            continue
        draft = drafts.get(key)
        weight = s.weight if s.weight is not None else (draft.weight if draft else 1.0)
        description = s.description or (draft.description if draft else "")
        merged[key] = Criterion(name=s.name[:80], description=description, weight=weight)
    for key, criterion in drafts.items():
        if key and key not in merged:
            merged[key] = criterion
    return list(merged.values())


_LABEL = re.compile(r"^\s*(?P<kind>good|bad)(?:\s+example)?\s*[:\-\u2013\u2014]\s*", re.IGNORECASE)
# The note starts a line or follows '/' (its colon optional), or follows a space on the same line as
# the output: then only with its colon, so "explains why the bridge closed" stays an output.
_WHY = re.compile(r"\s*(?:^|\n|/)\s*(?:why|note|because)\s*:?\s+|\s+(?:why|note|because)\s*:\s*", re.IGNORECASE)


def parse_example(text: str) -> Example | None:
    """``[good:|bad:] OUTPUT [why: NOTE]`` (why: on its own line, after '/' or after a space); good when
    unlabelled."""
    if not text:
        return None
    label = _LABEL.match(text)
    kind = label["kind"].lower() if label else "good"
    body = text[label.end():] if label else text
    output, _, note = (part.strip() for part in _split_once(_WHY, body))
    return Example(kind=kind, output=output or body.strip(), note=note if output else "")


def _split_once(pattern: re.Pattern, text: str) -> tuple[str, str, str]:
    match = pattern.search(text)
    return (text[:match.start()], match.group(0), text[match.end():]) if match else (text, "", "")


def read_answers(path: str | Path) -> list[str]:
    """Scripted answers: a JSON list, a TOML ``answers = [...]``, or text with blank lines between answers."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"answers file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            answers = json.loads(text)
        elif path.suffix == ".toml":
            answers = tomllib.loads(text).get("answers")
        else:
            answers = [block.strip() for block in re.split(r"\n\s*\n", text) if block.strip()]
    except ValueError as error:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"answers file {path}: cannot be read ({error})") from None
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"answers file {path}: expected a list of strings (JSON list or TOML answers = [...])")
    if len(answers) != len(SKELETON):
        raise ValueError(f"answers file {path} has {len(answers)} answers; the interview asks {len(SKELETON)} "
                         f"questions ({', '.join(t.key for t in SKELETON)}); use '-' for no answer")
    return answers
