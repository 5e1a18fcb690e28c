"""A stale or drifting sampler: the silent failures of an off-policy pipeline.

Three checks, each with its own evidence key:

- ``stall``: the samplers' policy version (the step metric ``rollout/policy_version``, else the
  smallest ``policy_version`` of the step's trajectories) has not advanced for
  ``stall_warn_steps`` trainer steps: workers keep sampling from an old adapter.
- ``jump``: ``train/sampler_kl`` (k3 KL between the sampler's and the trainer's logprobs) is
  ``warn_above`` times its running median or more, and at least ``kl_floor``: the behaviour
  logprobs stopped matching the policy (wrong temperature, a different adapter, an offset).
- ``identical``: the importance ratio is exactly 1 on (nearly) every token although the policy was
  updated since sampling (``train/policy_lag`` >= 1): the "sampler" logprobs are a copy of the
  trainer's own, so the correction corrects nothing.
- ``engine``: an inference engine ([sampler]) given a new adapter answers a fixed probe with other
  log-probs than the trainer's for the same weights (``rollout/engine_logprob_gap``, the mean
  absolute difference per probe token): it kept old weights, or serves another base.
"""

from __future__ import annotations

import math
import statistics

from grooves.monitors.base import Alert, Detector, rounded, severity_above
from grooves.monitors.stats import finite
from grooves.types import Group


def sampled_version(groups: list[Group]) -> int | None:
    """The oldest ``policy_version`` among the step's trajectories (None when none has one)."""
    versions = [t.policy_version for g in groups for t in g.trajectories if t.policy_version is not None]
    return min(versions) if versions else None


class SamplerDrift(Detector):
    """Statistic: ``train/sampler_kl`` as a multiple of its running median (NaN before ``min_history``)."""

    name = "sampler"
    state_fields = ("kl_history", "last_version", "since")

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        self.kl_history: list[float] = []
        self.last_version: float | None = None  # the newest version seen, and the step it appeared
        self.since: int | None = None

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        self.value = math.nan
        return (self._stall(step, groups, metrics) + self._jump(step, metrics) + self._identical(step, metrics)
                + self._engine(step, metrics))

    def _stall(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        version = metrics.get(self.config.version_metric)
        if not finite(version):
            version = sampled_version(groups)
        if version is None:
            return []
        version = float(version)
        if self.last_version is None or version > self.last_version:
            self.last_version, self.since = version, step
            return []
        stuck = step - self.since
        severity = "critical" if stuck >= self.config.stall_critical_steps else (
            "warn" if stuck >= self.config.stall_warn_steps else None)
        evidence = {"policy_version": rounded(version), "since_step": self.since, "steps_stuck": stuck,
                    "trainer_step": step}
        message = (f"The samplers' policy version has stayed at {version:g} for {stuck} trainer steps (since step "
                   f"{self.since}): the rollout workers are not receiving the new adapter.")
        return self.alert(step, "stall", severity, message, evidence, value=float(stuck))

    def _jump(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        kl = metrics.get(self.config.kl_metric)
        if not finite(kl):
            return []
        kl, past = float(kl), self.kl_history
        self.kl_history = (past + [kl])[-self.config.window:]
        if len(past) < self.config.min_history:
            return []
        median = statistics.median(past)
        self.value = kl / max(median, 1e-12)
        if kl < self.config.kl_floor:
            return []
        severity = severity_above(self.value, self.config.warn_above, self.config.critical_above)
        evidence = {"metric": self.config.kl_metric, "value": rounded(kl, 6), "median": rounded(median, 6),
                    "ratio": rounded(min(self.value, 1e12), 2), "history": len(past),
                    "is_ratio_p50": rounded(metrics.get("train/is_ratio/p50", math.nan)),
                    "is_ratio_max": rounded(metrics.get("train/is_ratio/max", math.nan))}
        message = (f"{self.config.kl_metric} jumped to {kl:.4g}, {min(self.value, 1e12):.3g}x its median {median:.3g} "
                   f"over the last {len(past)} steps: the sampler's logprobs no longer match the policy being "
                   f"trained (wrong temperature or adapter, or corrupted behaviour logprobs).")
        return self.alert(step, "jump", severity, message, evidence)

    def _engine(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        gap = metrics.get(self.config.gap_metric)
        if not finite(gap):
            return []
        severity = severity_above(float(gap), self.config.gap_warn_above, self.config.gap_critical_above)
        evidence = {"metric": self.config.gap_metric, "value": rounded(gap, 6),
                    "sampled_by": metrics.get("rollout/engine_model", "")}
        message = (f"The engine answered a probe with log-probs {gap:.3g} nats per token away from the trainer's "
                   f"for the adapter it was just given: it samples other weights (an adapter it did not reload, "
                   f"or another base model).")
        return self.alert(step, "engine", severity, message, evidence, value=float(gap))

    def _identical(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        share, lag = metrics.get("train/is_ratio_exact_frac"), metrics.get("train/policy_lag")
        if not (finite(share) and finite(lag)) or lag < 1 or share < self.config.identical_share:
            return []
        evidence = {"exact_share": rounded(share), "policy_lag": rounded(lag)}
        message = (f"The importance ratio is exactly 1 on {share:.1%} of tokens although the policy was updated "
                   f"{lag:g} steps since sampling: the sampler logprobs are a copy of the trainer's own, and the "
                   f"off-policy correction corrects nothing.")
        return self.alert(step, "identical", "critical", message, evidence, value=float(share))
