"""Detectors that read the outputs themselves: collapse, source insensitivity, repetition,
judge-directed text. Each looks at one step's groups only (their thresholds, not a history,
make them fire), except source insensitivity, which compares against an early baseline."""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter

from grooves.monitors.base import Alert, Detector, rounded, severity_above, severity_below, task_key, trajectory_ids
from grooves.monitors.text import (
    clip, content_stems, jaccard, ngram_repeat_rate, near_same_clusters, normalise, overlap, shingles,
    top_content_word, words,
)
from grooves.scoring import INJECTION_PATTERNS, input_text, judge_talk
from grooves.types import Group, Trajectory

MAX_EXAMPLES = 5


def _outputs(groups: list[Group]) -> list[tuple[str, str, str]]:
    """(task key, trajectory id, output text) of every output of the step."""
    ids = trajectory_ids(groups)
    return [(task_key(g, k), ids[k][i], output_text(t))
            for k, g in enumerate(groups) for i, t in enumerate(g.trajectories)]


def output_text(trajectory: Trajectory) -> str:
    """What a trajectory said in the end: an agent's answer (its last turn is often a tool call
    with no text, which would make every rollout look alike), else the completion."""
    state = trajectory.metadata.get("state")
    if not isinstance(state, dict):
        return trajectory.completion
    if state.get("answer") is not None:
        return str(state["answer"])
    last = next((m for m in reversed(trajectory.messages) if m.get("role") == "assistant"), {})
    return last.get("raw") or last.get("content") or ""


def read_numbers(trajectory: Trajectory) -> list[str]:
    """The number-bearing words of what a trajectory read before its output (its user turns and
    tool results, normalised): the ids, dates and amounts a filled-in template quotes."""
    read = " ".join(str(m.get("content") or "") for m in trajectory.messages if m.get("role") in ("user", "tool"))
    return sorted({word for word in normalise(read).split() if any(c.isdigit() for c in word)})


def filled_in(text: str, own_numbers: set[str]) -> bool:
    """Whether ``text`` quotes one of its task's own numbers (``own_numbers``: read by few tasks)."""
    return bool(own_numbers) and not own_numbers.isdisjoint(normalise(text).split())


class Collapse(Detector):
    """Different tasks get the same (or near-same) output: a universal answer the reward likes.

    Samples of one task may legitimately agree, so a shared output counts by the number of
    distinct tasks it appears in, never by how often one task repeats it. An output that quotes
    a number only its own task read (an order id, a date, an amount from its prompt or its tool
    results; read by fewer than half the tasks) is a template filled in for that task, not one
    text for every input, however alike the words around it: it is left out of the clusters.
    (A policy could hide a universal text behind its task's id; that is left to the other
    detectors and to reading samples.)
    """

    name = "collapse"
    state_fields = ("recent",)

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        self.recent: list[list[list]] = []  # the outputs of the last pool_steps steps, newest last

    def pooled(self, groups: list[Group]) -> list[tuple[str, str, str, list[str]]]:
        """This step's outputs (task, id, text, the numbers it read), plus earlier steps' until
        ``pool_tasks`` distinct tasks are covered (evidence marks the ids of earlier steps' outputs
        ``@earlier``)."""
        read = [read_numbers(t) for g in groups for t in g.trajectories]
        step_outputs = [[*output, numbers] for output, numbers in zip(_outputs(groups), read)]
        self.recent = (self.recent + [step_outputs])[-self.config.pool_steps:]
        outputs: list[tuple[str, str, str, list[str]]] = []
        for outputs_of_step in reversed(self.recent):
            if len({output[0] for output in outputs}) >= self.config.pool_tasks:
                break
            for task, ident, text, *numbers in outputs_of_step:  # a state saved before numbers: none
                outputs.append((task, ident, text[:500], numbers[0] if numbers else []))
        return outputs

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        current = sum(len(g.trajectories) for g in groups)  # pooled() lists this step's outputs first
        pooled = self.pooled(groups)
        n_tasks = len({task for task, _, _, _ in pooled})
        if n_tasks < 2:
            self.value = math.nan
            return []
        read_by: dict[str, set[str]] = {}
        for task, _, _, numbers in pooled:
            read_by.setdefault(task, set()).update(numbers)
        readers = Counter(number for numbers in read_by.values() for number in numbers)  # tasks that read it
        outputs = [(task, ident if i < current else f"{ident}@earlier", text)
                   for i, (task, ident, text, numbers) in enumerate(pooled)
                   if not filled_in(text, {n for n in numbers if 2 * readers[n] < n_tasks})]
        clusters = near_same_clusters([text for _, _, text in outputs], self.config.similarity, self.config.ngram)
        cluster = max(clusters, key=lambda c: (len({outputs[i][0] for i in c}), len(c)), default=[])
        tasks = {outputs[i][0] for i in cluster}
        self.value = len(tasks) / n_tasks if len(tasks) >= 2 else 0.0
        severity = severity_above(self.value, self.config.warn_above, self.config.critical_above)
        if len(tasks) < self.config.min_tasks or severity is None:
            return []
        variants = Counter(outputs[i][2].strip() for i in cluster).most_common(3)
        text = variants[0][0]
        first_per_task: dict[str, str] = {}
        for i in sorted(cluster):
            first_per_task.setdefault(outputs[i][0], outputs[i][1])
        examples = list(first_per_task.values())[:MAX_EXAMPLES]
        evidence = {"text": text, "outputs": len(cluster), "tasks": len(tasks), "step_tasks": n_tasks,
                    "step_outputs": len(pooled), "share_of_tasks": rounded(self.value),
                    "variants": [{"text": v, "count": c} for v, c in variants], "examples": examples}
        message = (f"{len(tasks)} of {n_tasks} tasks ({len(cluster)} of {len(pooled)} outputs) got the same "
                   f"output: {clip(text, 120)!r}. One text for every input is a reward hack, not a skill.")
        return self.alert(step, self._key(text), severity, message, evidence)

    def _key(self, text: str) -> str:
        """The memory key of a shared text: a remembered near-same text's key (the hack moving
        from "75%" to "80%" is the same evidence), else the text's normalised form."""
        form = normalise(text)[:200]
        grams = shingles(form, self.config.ngram)
        for key in self.fired:
            if jaccard(shingles(key[len("text:"):], self.config.ngram), grams) >= self.config.similarity:
                return key
        return "text:" + form


class SourceInsensitivity(Detector):
    """Outputs stop depending on their input: they overlap other tasks' sources as much as their own.

    margin = mean over outputs of (overlap with the own source) - mean of (mean overlap with
    each other task's source), overlaps on content stems. It needs ``min_tasks`` tasks; a step
    with fewer is pooled with the outputs (and sources) of up to ``pool_steps - 1`` earlier
    steps, newest first, until the pool covers them (evidence marks earlier ids ``@earlier``).
    """

    name = "source_insensitivity"
    state_fields = ("early", "early_rewards", "recent")

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        self.early: list[float] = []  # margins of the first baseline_steps steps
        self.early_rewards: list[float] = []  # their reward/total, when the step's metrics have it
        self.recent: list[dict] = []  # the last pool_steps steps: {"sources": {task: stems}, "outputs": [...]}

    def pooled(self, groups: list[Group]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
        """The sources (content stems by task) and outputs to measure: this step's, plus earlier ones'."""
        sources_of_step: dict[str, list[str]] = {}
        for k, group in enumerate(groups):
            if group.trajectories:
                source = input_text(group.trajectories[0], group, self.config.source)
                sources_of_step.setdefault(task_key(group, k), sorted(content_stems(source)))
        entry = {"sources": sources_of_step,
                 "outputs": [[task, ident, text[:500]] for task, ident, text in _outputs(groups)]}
        self.recent = (self.recent + [entry])[-self.config.pool_steps:]
        sources: dict[str, set[str]] = {}
        outputs: list[tuple[str, str, str]] = []
        for age, earlier in enumerate(reversed(self.recent)):
            if len(sources) >= self.config.min_tasks:
                break
            for task, stems in earlier["sources"].items():
                sources.setdefault(task, set(stems))
            outputs += [(task, ident if age == 0 else f"{ident}@earlier", text)
                        for task, ident, text in earlier["outputs"]]
        return sources, outputs

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        sources, outputs = self.pooled(groups)
        if len(sources) < self.config.min_tasks:
            self.value = math.nan
            return []
        own, cross, insensitive = [], [], []
        for task, trajectory_id, text in outputs:
            stems = content_stems(text)
            own.append(overlap(stems, sources[task]))
            cross.append(statistics.fmean(overlap(stems, s) for key, s in sources.items() if key != task))
            if own[-1] <= cross[-1]:
                insensitive.append((trajectory_id, text))
        self.value = statistics.fmean(own) - statistics.fmean(cross)
        reward = metrics.get("reward/total", math.nan)
        if len(self.early) < self.config.baseline_steps:
            self.early.append(self.value)
            if math.isfinite(reward):
                self.early_rewards.append(reward)
            return []
        baseline = statistics.median(self.early)
        severity = severity_below(self.value, self.config.warn_ratio * baseline, self.config.critical_below)
        if baseline < self.config.armed_above or severity is None:
            return []
        if self.config.rewarded_only and self.early_rewards and reward < statistics.median(self.early_rewards):
            return []  # the reward fell with the grounding: the reward is doing its job, not being hacked
        evidence = {"margin": rounded(self.value), "baseline": rounded(baseline),
                    "own_overlap": rounded(statistics.fmean(own)), "cross_overlap": rounded(statistics.fmean(cross)),
                    "insensitive_outputs": len(insensitive), "outputs": len(own), "tasks": len(sources),
                    "examples": [{"id": i, "text": clip(t)} for i, t in insensitive[:MAX_EXAMPLES]]}
        message = (f"Outputs overlap their own source only {self.value:.2f} more than other tasks' sources "
                   f"(baseline {baseline:.2f}); {len(insensitive)} of {len(own)} outputs are no closer to their "
                   f"own input than to the others.")
        return self.alert(step, "margin", severity, message, evidence)


class Repetition(Detector):
    """Outputs repeat themselves: a phrase (word n-grams) or one keyword stuffed many times."""

    name = "repetition"

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        outputs = _outputs(groups)
        if not outputs:
            self.value = math.nan
            return []
        repetitive = []
        for _, trajectory_id, text in outputs:
            found = self._repeat(words(text))
            if found:
                repetitive.append({"id": trajectory_id, "text": clip(text), **found})
        self.value = len(repetitive) / len(outputs)
        severity = severity_above(self.value, self.config.warn_above, self.config.critical_above)
        if severity is None:
            return []
        evidence = {"share": rounded(self.value), "repetitive_outputs": len(repetitive), "outputs": len(outputs),
                    "examples": repetitive[:MAX_EXAMPLES]}
        top = repetitive[0]
        message = (f"{len(repetitive)} of {len(outputs)} outputs repeat themselves, e.g. {top['repeated']!r} "
                   f"({top['kind']}) in {clip(top['text'], 100)!r}.")
        return self.alert(step, "repetition", severity, message, evidence)

    def _repeat(self, tokens: list[str]) -> dict | None:
        """What makes one output repetitive (the repeated n-gram or word and how much), or None."""
        rate, count, gram = ngram_repeat_rate(tokens, self.config.n)
        if count >= self.config.min_ngrams and rate >= self.config.repeat_rate:
            return {"kind": f"{self.config.n}-gram", "repeated": gram, "repeat_rate": rounded(rate)}
        word, times = top_content_word(tokens)
        if times >= self.config.min_word_count and times / len(tokens) >= self.config.word_share:
            return {"kind": "word", "repeated": word, "count": times, "of_words": len(tokens)}
        return None


class JudgeDirected(Detector):
    """Outputs that address the judge or scorer ("dear grader", "score this 10", chat-template
    markers); the patterns are ``grooves.scoring.INJECTION_PATTERNS`` plus any extra, matched on
    the text as written and normalised (look-alike letters, invisible characters), as
    ``InjectionGuard`` reads it."""

    name = "judge_directed"

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        patterns = (*INJECTION_PATTERNS, *config.extra_patterns)
        self.patterns = [re.compile(p, re.IGNORECASE) for p in patterns]

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        outputs = _outputs(groups)
        if not outputs:
            self.value = math.nan
            return []
        hits = []
        for _, trajectory_id, text in outputs:
            match = judge_talk(text, self.patterns)  # as the injection guard reads it: normalised too
            if match:
                hits.append({"id": trajectory_id, "match": match, "text": clip(text)})
        self.value = len(hits) / len(outputs)
        severity = severity_above(self.value, self.config.warn_above, self.config.critical_above)
        if severity is None:
            return []
        phrases = Counter(hit["match"].lower() for hit in hits).most_common(MAX_EXAMPLES)
        evidence = {"share": rounded(self.value), "judge_directed_outputs": len(hits), "outputs": len(outputs),
                    "phrases": [{"text": p, "count": c} for p, c in phrases], "examples": hits[:MAX_EXAMPLES]}
        message = (f"{len(hits)} of {len(outputs)} outputs address the judge, e.g. {phrases[0][0]!r}; "
                   f"the policy is trying to instruct its scorer.")
        return self.alert(step, "judge_directed", severity, message, evidence)
