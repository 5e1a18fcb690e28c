"""``Monitors``: the set of detectors a run uses, observed once per training step.

The detectors that read outputs (collapse, source insensitivity, repetition, judge-directed
text) also watch the held-out evaluations, with their own memory: greedy held-out outputs
are where a universal answer is loudest (in the HN example's probe all 16 held-out titles
became the same empty string while the held-out reward "rose" by 9.7 standard errors). The
held-out source-insensitivity baseline is the first evaluation (step 0), and nothing pools.
What the first evaluation already shows is the base model, not a hack: a held-out alert is
raised only when it is more severe than that detector's alert on the first evaluation (a
base model that answers every held-out task with the same text does not pause the run).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from grooves.monitors.base import SEVERITIES, Alert, Detector
from grooves.monitors.config import MonitorsConfig
from grooves.monitors.outputs import Collapse, JudgeDirected, Repetition, SourceInsensitivity
from grooves.monitors.sampler import SamplerDrift
from grooves.monitors.signals import Divergence, EntropyCollapse, LengthExploitation, RewardSpike
from grooves.monitors.vetoes import GuardVeto
from grooves.types import Group

DETECTORS: tuple[type[Detector], ...] = (
    Collapse, SourceInsensitivity, RewardSpike, Divergence, LengthExploitation, Repetition, EntropyCollapse,
    JudgeDirected, SamplerDrift, GuardVeto,
)
"""Every shipped detector; each ``name`` is also its ``MonitorsConfig`` field."""

STATE_VERSION = 1

HELDOUT_DETECTORS: tuple[type[Detector], ...] = (Collapse, SourceInsensitivity, Repetition, JudgeDirected)
"""The detectors that also watch held-out evaluations."""

_HELDOUT_OVERRIDES: dict[str, dict[str, Any]] = {"collapse": {"pool_steps": 1},
                                                 "source_insensitivity": {"pool_steps": 1, "baseline_steps": 1}}


class Monitors:
    """The enabled detectors of a ``MonitorsConfig`` (all of them with the defaults)."""

    def __init__(self, config: MonitorsConfig | None = None):
        self.config = config or MonitorsConfig()
        sections = [(cls, getattr(self.config, cls.name)) for cls in DETECTORS]
        self.detectors: list[Detector] = [cls(section, self.config.cooldown_steps) for cls, section in sections
                                          if self.config.enabled and section.enabled]
        self.heldout: list[Detector] = [
            cls(_with(section, _HELDOUT_OVERRIDES.get(cls.name, {})), self.config.cooldown_steps)
            for cls, section in sections if cls in HELDOUT_DETECTORS and self.config.enabled and section.enabled]
        self.heldout_first: dict[str, str | None] = {}  # detector -> its severity on the first evaluation
        self.last_step: int | None = None

    def observe_heldout(self, step: int, groups: list[Group]) -> list[Alert]:
        """Alerts on a held-out evaluation's outputs (messages start "Held-out:", evidence has
        ``split = "val"``); ``heldout_metrics()`` gives their statistics."""
        alerts = []
        for detector in self.heldout:
            found = detector.observe(step, groups, {})
            if detector.name not in self.heldout_first:
                self.heldout_first[detector.name] = max((a.severity for a in found), key=SEVERITIES.index,
                                                        default=None)
                continue
            first = self.heldout_first[detector.name]
            for alert in found:
                if first is not None and SEVERITIES.index(alert.severity) <= SEVERITIES.index(first):
                    continue
                alert.message = f"Held-out: {alert.message}"
                alert.evidence = {"split": "val", **alert.evidence}
                alerts.append(alert)
        return sorted(alerts, key=lambda a: a.severity != "critical")

    def heldout_metrics(self) -> dict[str, float]:
        """``alerts/val/<detector>``: each held-out detector's statistic at the last evaluation."""
        return {f"alerts/val/{detector.name}": float(detector.value) for detector in self.heldout}

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        """Alerts of every detector for this step (most severe first); updates their histories."""
        alerts = [alert for detector in self.detectors for alert in detector.observe(step, groups, metrics)]
        self.last_step = step
        return sorted(alerts, key=lambda a: a.severity != "critical")

    def metrics(self) -> dict[str, float]:
        """``alerts/<detector>``: each detector's statistic at the last step (NaN: not computed)."""
        return {f"alerts/{detector.name}": float(detector.value) for detector in self.detectors}

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "last_step": self.last_step,
                "detectors": {detector.name: detector.state_dict() for detector in self.detectors},
                "heldout": {detector.name: detector.state_dict() for detector in self.heldout},
                "heldout_first": dict(self.heldout_first)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore histories and alert memories; a detector absent from ``state`` starts fresh."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"monitor state version {state.get('version')!r} is not {STATE_VERSION}")
        self.last_step = state.get("last_step")
        saved = state.get("detectors", {})
        for detector in self.detectors:
            if detector.name in saved:
                detector.load_state_dict(saved[detector.name])
        self.heldout_first = dict(state.get("heldout_first", {}))
        saved = state.get("heldout", {})
        for detector in self.heldout:
            if detector.name in saved:
                detector.load_state_dict(saved[detector.name])


def _with(section: BaseModel, overrides: dict[str, Any]) -> BaseModel:
    return section.model_copy(update=overrides) if overrides else section
