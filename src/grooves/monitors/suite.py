"""``Monitors``: the set of detectors a run uses, observed once per training step."""

from __future__ import annotations

from typing import Any

from grooves.monitors.base import Alert, Detector
from grooves.monitors.config import MonitorsConfig
from grooves.monitors.outputs import Collapse, JudgeDirected, Repetition, SourceInsensitivity
from grooves.monitors.signals import Divergence, EntropyCollapse, LengthExploitation, RewardSpike
from grooves.types import Group

DETECTORS: tuple[type[Detector], ...] = (
    Collapse, SourceInsensitivity, RewardSpike, Divergence, LengthExploitation, Repetition, EntropyCollapse,
    JudgeDirected,
)
"""Every shipped detector; each ``name`` is also its ``MonitorsConfig`` field."""

STATE_VERSION = 1


class Monitors:
    """The enabled detectors of a ``MonitorsConfig`` (all of them with the defaults)."""

    def __init__(self, config: MonitorsConfig | None = None):
        self.config = config or MonitorsConfig()
        sections = [(cls, getattr(self.config, cls.name)) for cls in DETECTORS]
        self.detectors: list[Detector] = [cls(section, self.config.cooldown_steps) for cls, section in sections
                                          if self.config.enabled and section.enabled]
        self.last_step: int | None = None

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
                "detectors": {detector.name: detector.state_dict() for detector in self.detectors}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore histories and alert memories; a detector absent from ``state`` starts fresh."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"monitor state version {state.get('version')!r} is not {STATE_VERSION}")
        self.last_step = state.get("last_step")
        saved = state.get("detectors", {})
        for detector in self.detectors:
            if detector.name in saved:
                detector.load_state_dict(saved[detector.name])
