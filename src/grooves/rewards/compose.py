"""A reward is a named, weighted list of components that score whole groups.

A component here is a verifier: a plain Python function whose parameters are looked up
by name among ``completion``, ``task``, ``messages``, ``prompt``, ``trajectory``,
``group`` and the task's own columns (``text``, ``reference``, ...). It returns a number
for one trajectory. Weight 0 makes a component a logged metric only.

Failures are explicit: a component that raises or returns a non-finite value yields NaN
for that trajectory and counts as an error; if a required, weighted component is NaN the
trajectory's total is NaN and the trainer leaves it out of the advantage.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grooves.types import Group, Trajectory

_BUILTIN_ARGS = {"completion", "task", "messages", "prompt", "trajectory", "group"}


@dataclass
class Component:
    name: str
    fn: Callable[..., float]
    weight: float = 1.0
    required: bool = True

    def __post_init__(self) -> None:
        if self.name == "total" or "/" in self.name:
            raise ValueError(f"reward component name {self.name!r} is reserved or contains '/'")
        signature = inspect.signature(self.fn)
        self._params = [p.name for p in signature.parameters.values()
                        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self._takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())

    def arguments(self, trajectory: Trajectory, group: Group) -> dict[str, Any]:
        task = group.task
        available = {
            "completion": trajectory.completion, "task": task, "messages": trajectory.messages,
            "prompt": task.get("prompt"), "trajectory": trajectory, "group": group,
        }
        for key, value in task.items():
            available.setdefault(key, value)
        if self._takes_kwargs:
            return available
        missing = [p for p in self._params if p not in available]
        if missing:
            raise TypeError(f"reward {self.name!r} asks for {missing}, which neither the trajectory "
                            f"nor the task provides (task columns: {sorted(task)})")
        return {p: available[p] for p in self._params}


@dataclass
class RewardReport:
    """What scoring one batch of groups produced, for metrics."""

    errors: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    first_error: dict[str, str] = field(default_factory=dict)

    def add_error(self, name: str, error: str) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1
        self.first_error.setdefault(name, error)


class Reward:
    """Scores groups: fills ``trajectory.components`` and ``trajectory.reward`` (the weighted sum)."""

    def __init__(self, components: Iterable[Component]):
        self.components = list(components)
        names = [c.name for c in self.components]
        if not names:
            raise ValueError("a reward needs at least one component")
        if len(set(names)) != len(names):
            raise ValueError(f"reward component names must be unique: {names}")

    def score(self, groups: list[Group], report: RewardReport | None = None) -> RewardReport:
        report = report or RewardReport()
        for group in groups:
            for trajectory in group.trajectories:
                for component in self.components:
                    trajectory.components[component.name] = self._call(component, trajectory, group, report)
                trajectory.reward = self.total(trajectory.components)
        return report

    def total(self, components: dict[str, float]) -> float:
        total = 0.0
        for component in self.components:
            value = components.get(component.name, math.nan)
            if component.weight == 0:
                continue
            if math.isnan(value):
                if component.required:
                    return math.nan
                continue
            total += component.weight * value
        return total

    @staticmethod
    def _call(component: Component, trajectory: Trajectory, group: Group, report: RewardReport) -> float:
        report.calls[component.name] = report.calls.get(component.name, 0) + 1
        try:
            value = float(component.fn(**component.arguments(trajectory, group)))
        except Exception as error:  # a broken verifier must not stop the run; it is counted and shown
            report.add_error(component.name, f"{type(error).__name__}: {error}")
            return math.nan
        if not math.isfinite(value):
            report.add_error(component.name, f"returned {value}")
            return math.nan
        return value


def as_reward(spec: Reward | Callable | list | dict) -> Reward:
    """Build a Reward from a function, a list of functions/Components, or ``{name: fn}``."""
    if isinstance(spec, Reward):
        return spec
    if callable(spec):
        return Reward([Component(getattr(spec, "__name__", "reward"), spec)])
    if isinstance(spec, dict):
        return Reward([Component(name, fn) for name, fn in spec.items()])
    components = []
    for item in spec:
        components.append(item if isinstance(item, Component) else Component(item.__name__, item))
    return Reward(components)


def import_object(path: str) -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"{path!r} must look like 'module:function' or 'file.py:function'")
    if module_name.endswith(".py"):
        file = Path(module_name)
        if not file.exists():
            raise FileNotFoundError(f"reward file {file} does not exist")
        spec = importlib.util.spec_from_file_location(f"grooves_user_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name} has no attribute {attr!r}") from None
