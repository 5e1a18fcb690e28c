"""Task sets: what a run trains on, one set or a weighted mix of several.

A ``TaskSet`` bundles tasks, held-out tasks, prompt rendering and the reward that scores
them (and, for an agent, the env whose tools its rollouts use). A run with several sets (``[[mix]]`` in the config) trains one adapter on all of
them: ``TaskMix`` draws each task's set by weight, in an order fixed by the seed and the
draw number, so a resumed run draws the same sequence. Metrics of a mixed run are
reported per set under ``task/<name>/...`` besides the overall ``reward/total``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from grooves.envs.base import Env
from grooves.rewards.compose import Reward
from grooves.tasks.sources import BalancedStream, TaskSourceError, TaskStream, render_prompt
from grooves.types import Message, Task


@dataclass
class TaskSet:
    name: str  # "" for a run with a single set
    train: list[Task]
    heldout: list[Task]
    reward: Reward
    prompt_template: str | None = None
    system: str | None = None
    weight: float = 1.0
    env: Env | None = None  # an agent env: multi-turn rollouts with its tools

    def render(self, task: Task) -> list[Message]:
        if self.env is not None:
            return self.env.prompt(task)
        return render_prompt(task, self.prompt_template, self.system)

    def check(self) -> list[str]:
        """Raise ConfigError when a verifier asks for a task column some tasks lack; return
        warnings about the tasks (ids that occur more than once)."""
        from grooves.training.config import ConfigError

        tasks = self.train + self.heldout
        where = f"task set {self.name!r}: " if self.name else ""
        for component in self.reward.components:
            for column in getattr(component, "task_columns", lambda: [])():
                lacking = [t["id"] for t in tasks if column not in t]
                if lacking:
                    raise ConfigError(f"{where}reward component {component.name!r} asks for task column {column!r}, "
                                      f"which {len(lacking)} of {len(tasks)} tasks lack (e.g. task {lacking[0]!r}, "
                                      f"whose columns are {sorted(next(t for t in tasks if t['id'] == lacking[0]))})")
        warnings = []
        counts = Counter(t["id"] for t in tasks)
        repeated = {i: n for i, n in counts.items() if n > 1}
        if repeated:
            example, times = next(iter(repeated.items()))
            warnings.append(f"{where}{len(repeated)} task ids occur more than once (e.g. {example!r} x{times}). "
                            f"Every copy is kept and drawn (or evaluated) once per copy; a split made by "
                            f"heldout_fraction goes by id, so copies stay on one side. Give each task its own "
                            f"id to tell them apart in reviews and alerts.")
        both = {t["id"] for t in self.train} & {t["id"] for t in self.heldout}
        if both:
            warnings.append(f"{where}{len(both)} task ids are both trained on and held out "
                            f"(e.g. {next(iter(both))!r}): the held-out reward overstates generalisation.")
        return warnings

    def prefix(self, metric: str) -> str:
        """Where a set's metric goes: unchanged for a single set, under task/<name>/ in a mix."""
        if not self.name:
            return metric
        head, sep, rest = metric.partition("/")
        return f"{head}/task/{self.name}/{rest}" if head == "val" and sep else f"task/{self.name}/{metric}"


class TaskMix:
    """Tasks from several sets, each set chosen by weight; the position is checkpointed."""

    def __init__(self, sets: list[TaskSet], seed: int = 0, balance_by: str | None = None):
        if not sets:
            raise ValueError("a run needs at least one task set")
        self.sets = sets
        self.seed = seed
        if balance_by is None:
            self.streams = [TaskStream(s.train, seed=seed) for s in sets]
        else:
            try:
                self.streams = [BalancedStream(s.train, balance_by, seed=seed) for s in sets]
            except TaskSourceError as error:
                raise _balance_error(str(error)) from None
        self.weights = [s.weight for s in sets]
        self.draws = 0

    def take(self) -> tuple[TaskSet, Task]:
        index = 0
        if len(self.sets) > 1:
            point = random.Random(f"{self.seed}:mix:{self.draws}").random() * sum(self.weights)
            while point >= self.weights[index] and index < len(self.sets) - 1:
                point -= self.weights[index]
                index += 1
        self.draws += 1
        return self.sets[index], self.streams[index].take(1)[0]

    def state(self) -> dict:
        return {"draws": self.draws, "streams": [s.state() for s in self.streams]}

    def restore(self, state: dict) -> None:
        self.draws = state["draws"]
        for stream, saved in zip(self.streams, state["streams"]):
            balanced = isinstance(stream, BalancedStream)
            if ("values" in saved) != balanced or (balanced and set(saved["values"]) != set(stream.values)):
                raise _balance_error("the checkpoint's tasks were drawn "
                                     + (f"in turns over {sorted(saved['values'])}" if "values" in saved
                                        else "in one order, without balance_by")
                                     + "; resume with the tasks and train.balance_by the run started with")
            stream.restore(saved)


def _balance_error(message: str) -> Exception:
    from grooves.training.config import ConfigError

    return ConfigError(f"train.balance_by: {message}")
