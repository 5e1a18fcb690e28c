"""Reward-hacking detectors: each sees one training step and returns alerts with evidence.

Interface (what the training loop, checkpoints and the alert policy use)::

    monitors = Monitors(config: MonitorsConfig | None = None)   # [monitors] of the run config
    alerts = monitors.observe(step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]
    monitors.metrics() -> dict[str, float]      # {"alerts/<detector>": statistic at the last step; NaN = not computed}
    monitors.state_dict() -> dict                # JSON-serialisable; goes into each checkpoint
    monitors.load_state_dict(state: dict)        # on resume: histories and alert memories come back

    Alert(detector: str, severity: "warn" | "critical", step: int, message: str,
          evidence: dict (JSON-serialisable), value: float, key: str)   # alert.to_dict() for the run store

- ``groups`` are the step's sampled, scored groups (all of them, also those dynamic
  sampling drops); ``metrics`` the step's metrics (``reward/total``, ``reward/<component>``,
  ``reward/<guard>/veto_rate``, ``entropy``, ``val/reward/total`` on validation steps, ...).
  Call ``observe`` after scoring and the update, before logging, then log ``metrics()``.
- Evidence names trajectories ``TASK#i``: the task's id and the sample's index in its group.
- An alert fires once per evidence key (the shared text, the metric, the metric pair) and
  stays quiet on that key for ``cooldown_steps`` unless its severity rises from warn to
  critical. The memory is in ``state_dict()``, so a resumed run does not fire again at once.
- What a run does with an alert (warn, pause, stop) is the alert policy of the training
  loop; detectors only report.

Detectors (``Detector.name``, also the config section and the metric name):
``collapse``, ``source_insensitivity``, ``reward_spike``, ``divergence``, ``length``,
``repetition``, ``entropy``, ``judge_directed``, and two that are not hacks: ``sampler`` (a stale or
drifting sampler: ``grooves.monitors.sampler``) and ``guard_veto`` (a guard of the run vetoing every
sample, so nothing is learned: ``grooves.monitors.vetoes``). docs/reward_hacking.md describes each.
A new detector subclasses ``Detector``: set ``name`` and ``state_fields``, implement
``observe`` and report through ``self.alert(step, key, severity, message, evidence)``.
"""

from grooves.monitors.base import SEVERITIES, Alert, Detector
from grooves.monitors.config import (
    CollapseConfig, DivergenceConfig, EntropyConfig, GuardVetoConfig, JudgeDirectedConfig, LengthConfig,
    MonitorsConfig, RepetitionConfig, RewardSpikeConfig, SamplerConfig, SourceInsensitivityConfig, config_tables,
)
from grooves.monitors.outputs import Collapse, JudgeDirected, Repetition, SourceInsensitivity
from grooves.monitors.sampler import SamplerDrift
from grooves.monitors.signals import Divergence, EntropyCollapse, LengthExploitation, RewardSpike
from grooves.monitors.suite import DETECTORS, Monitors
from grooves.monitors.vetoes import GuardVeto

__all__ = [
    "DETECTORS", "SEVERITIES", "Alert", "Collapse", "CollapseConfig", "Detector", "Divergence", "DivergenceConfig",
    "EntropyCollapse", "EntropyConfig", "GuardVeto", "GuardVetoConfig", "JudgeDirected", "JudgeDirectedConfig",
    "LengthConfig", "LengthExploitation", "Monitors", "MonitorsConfig", "Repetition", "RepetitionConfig",
    "RewardSpike", "RewardSpikeConfig", "SamplerConfig", "SamplerDrift", "SourceInsensitivity",
    "SourceInsensitivityConfig", "config_tables",
]
