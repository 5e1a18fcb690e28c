"""``Alert`` and the ``Detector`` base: one step in, alerts out, history in a JSON-able state.

A detector remembers which evidence it last alerted on (a key such as the shared text or
the metric name) and at which step and severity; the same key stays quiet for
``cooldown_steps`` unless the severity rises. That memory is part of ``state_dict()``, so a
resumed run neither forgets its history nor fires the same alert again at once.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

from grooves.types import Group

SEVERITIES = ("warn", "critical")


@dataclass
class Alert:
    """One finding of one detector at one step, with the evidence a person needs to judge it."""

    detector: str
    severity: str  # "warn" or "critical"
    step: int
    message: str  # one or two readable sentences with the numbers
    evidence: dict[str, Any]  # JSON-serialisable: the repeated text, counts, metric values, example ids
    value: float  # the statistic behind this alert
    key: str = ""  # the evidence it fired on (a text, a metric): the cooldown's memory key

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def task_key(group: Group, index: int) -> str:
    """The task's id (``task["id"]``, else the first trajectory's ``metadata["task_id"]``), else its position."""
    if "id" in group.task:
        return str(group.task["id"])
    if group.trajectories and "task_id" in group.trajectories[0].metadata:
        return str(group.trajectories[0].metadata["task_id"])
    return f"group-{index}"


def trajectory_ids(groups: list[Group]) -> list[list[str]]:
    """``TASK#i`` for sample i of each group: how evidence names a trajectory."""
    return [[f"{task_key(g, k)}#{i}" for i in range(len(g.trajectories))] for k, g in enumerate(groups)]


def severity_above(value: float, warn: float, critical: float) -> str | None:
    if not math.isfinite(value) or value < warn:
        return None
    return "critical" if value >= critical else "warn"


def severity_below(value: float, warn: float, critical: float) -> str | None:
    if not math.isfinite(value) or value > warn:
        return None
    return "critical" if value <= critical else "warn"


def rounded(value: float, digits: int = 4) -> float | None:
    """A float for evidence: rounded, and None for NaN/inf (evidence must be plain JSON)."""
    return round(float(value), digits) if math.isfinite(value) else None


class Detector:
    """Base of the detectors. Subclasses set ``name``, list their history attributes in
    ``state_fields`` (plain lists/dicts of numbers) and implement ``observe``."""

    name = ""
    state_fields: tuple[str, ...] = ()

    def __init__(self, config, cooldown_steps: int = 10):
        self.config = config
        self.cooldown_steps = cooldown_steps
        self.value = math.nan  # the last step's statistic; NaN when it could not be computed
        self.fired: dict[str, list] = {}  # evidence key -> [step, severity] of its last alert

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        raise NotImplementedError

    def alert(self, step: int, key: str, severity: str | None, message: str, evidence: dict,
              value: float | None = None) -> list[Alert]:
        """``[Alert]``, or ``[]`` when there is no severity or ``key`` is still cooling down."""
        if severity is None:
            return []
        self.fired = {k: v for k, v in self.fired.items() if step - v[0] < self.cooldown_steps}
        last = self.fired.get(key)
        if last is not None and SEVERITIES.index(severity) <= SEVERITIES.index(last[1]):
            return []
        self.fired[key] = [step, severity]
        value = self.value if value is None else value
        return [Alert(self.name, severity, step, message, evidence, rounded(value, 6), key)]

    def state_dict(self) -> dict[str, Any]:
        state = {"value": rounded(self.value, 12), "fired": self.fired}
        state.update({name: getattr(self, name) for name in self.state_fields})
        return copy.deepcopy(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; keys it lacks keep their fresh values."""
        state = copy.deepcopy(state)
        value = state.get("value")
        self.value = math.nan if value is None else float(value)
        self.fired = state.get("fired", {})
        for name in self.state_fields:
            if name in state:
                setattr(self, name, state[name])
