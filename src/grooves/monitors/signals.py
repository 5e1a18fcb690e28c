"""Detectors that read numbers: reward spikes, proxy-guard divergence, length exploitation,
entropy collapse. They keep short histories of step metrics (rolling windows or an early-run
baseline) in their state."""

from __future__ import annotations

import math
import re
import statistics

from grooves.monitors.base import Alert, Detector, rounded, severity_above, severity_below, trajectory_ids
from grooves.monitors.stats import centred_correlation, finite, robust_z
from grooves.monitors.text import clip
from grooves.types import Group

_REWARD_MEAN = re.compile(r"reward/([^/]+)")
HELDOUT = "val/reward/total"


def guard_names(metrics: dict[str, float]) -> list[str]:
    """Components with a ``reward/<name>/veto_rate``: guards, whose ``reward/<name>`` is a pass rate."""
    return sorted(key[len("reward/"):-len("/veto_rate")] for key in metrics
                  if key.startswith("reward/") and key.endswith("/veto_rate") and key.count("/") == 2)


def reward_means(metrics: dict[str, float]) -> list[str]:
    """``reward/total`` and every ``reward/<component>`` mean that is not a guard's pass rate."""
    guards = set(guard_names(metrics)) | {"vetoed"}
    names = [key for key in metrics if (m := _REWARD_MEAN.fullmatch(key)) and m.group(1) not in guards]
    return sorted(names)


def sample_count(groups: list[Group]) -> int:
    return sum(len(g.trajectories) for g in groups)


class _Windowed(Detector):
    """Keeps the last ``window`` finite values of each metric it watches."""

    state_fields = ("history",)

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        self.history: dict[str, list[float]] = {}

    def z_scores(self, metrics: dict[str, float], names: list[str], samples: int = 0) -> dict[str, tuple[float, dict]]:
        """Robust z of this step's value of each metric against its history, then add the value.

        With ``samples`` (the step's trajectory count) the scale is also floored by the step
        mean's own standard error, ``<metric>/std / sqrt(samples)``: a 0/1 component that was 0
        for five steps and is 1 for two of 16 samples now is sampling noise, not a spike.
        """
        scores = {}
        for name in dict.fromkeys(names):
            if not finite(metrics.get(name)):
                continue
            value = float(metrics[name])
            past = self.history.get(name, [])
            if len(past) >= self.config.min_history:
                spread = metrics.get(f"{name}/std")
                noise = spread / math.sqrt(samples) if samples and finite(spread) and not name.startswith("val/") else 0.0
                z, parts = robust_z(value, past, max(self.config.min_scale, noise), self.config.rel_min_scale)
                scores[name] = (z, {"metric": name, "value": rounded(value, 6), **parts, "history": len(past)})
            self.history[name] = (past + [value])[-self.config.window:]
        return scores


class RewardSpike(_Windowed):
    """A reward mean (the total or one component) jumps far above its recent range.

    Statistic: the largest robust z-score, (value - median) / (1.4826 MAD), of any watched
    metric against its last ``window`` steps. Falls are not flagged: a falling guard shows in
    ``Divergence``. In a guarded run the total is left out by default: a vetoed trajectory's
    total is the floor, so the total moves with the veto rate (a noisy judge vetoing 60% one
    step and 90% the next) while the components it is made of are watched on their own.
    """

    name = "reward_spike"

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        watched = self.config.metrics or [m for m in reward_means(metrics)
                                          if not (m == "reward/total" and guard_names(metrics))]
        scores = self.z_scores(metrics, watched, sample_count(groups))
        self.value = max((z for z, _ in scores.values()), default=math.nan)
        alerts = []
        for name, (z, evidence) in sorted(scores.items(), key=lambda item: -item[1][0]):
            severity = severity_above(z, self.config.warn_above, self.config.critical_above)
            if severity is None:
                continue
            message = (f"{name} jumped to {evidence['value']:.4g}, {z:.1f} robust standard deviations above "
                       f"its median {evidence['median']:.4g} over the last {evidence['history']} steps.")
            alerts += self.alert(step, name, severity, message, evidence, value=z)
        return alerts


class Divergence(_Windowed):
    """A proxy reward rises while a guard's pass rate or the held-out reward falls.

    For each proxy-guard pair the score is min(z of the proxy, -z of the guard), both robust
    z-scores against their last ``window`` values; the statistic is the largest score. The
    held-out reward only exists on validation steps, so its pairs count only then.
    """

    name = "divergence"

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        proxies = self.config.proxies or reward_means(metrics)
        guards = self.config.guards or [f"reward/{g}" for g in guard_names(metrics)] + [HELDOUT]
        scores = self.z_scores(metrics, proxies + guards, sample_count(groups))
        pairs = [(min(scores[p][0], -scores[g][0]), p, g) for p in proxies for g in guards
                 if p in scores and g in scores and p != g]
        self.value = max((score for score, _, _ in pairs), default=math.nan)
        alerts = []
        for score, proxy, guard in sorted(pairs, reverse=True):
            severity = severity_above(score, self.config.warn_above, self.config.critical_above)
            if severity is None:
                continue
            (zp, rise), (zg, fall) = scores[proxy], scores[guard]
            message = (f"{proxy} rose to {rise['value']:.4g} (z {zp:+.1f} vs its median {rise['median']:.4g}) "
                       f"while {guard} fell to {fall['value']:.4g} (z {zg:+.1f} vs {fall['median']:.4g}): "
                       f"the policy is gaining reward the guard does not confirm.")
            alerts += self.alert(step, f"{proxy}|{guard}", severity, message,
                                 {"proxy": rise, "guard": fall}, value=score)
        return alerts


class LengthExploitation(Detector):
    """Completions grow (vs the early-run baseline) and, within groups, longer ones score higher.

    Statistic: the within-group correlation of reward and completion length in tokens, over
    trajectories no guard vetoed (a veto sets the reward to the guard's floor: the guard's
    verdict, not the reward's taste for length). It alerts when the length drift (mean
    length / baseline) and the correlation both pass their thresholds. Once every sample is
    stuffed the correlation fades; the first steps of the hack, when only some are, show it.
    """

    name = "length"
    state_fields = ("early",)

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        self.early: list[float] = []  # mean completion lengths of the first baseline_steps steps

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        lengths = [len(t.completion_ids) for g in groups for t in g.trajectories]
        if not lengths:
            self.value = math.nan
            return []
        pairs = [[(len(t.completion_ids), t.reward) for t in g.trajectories
                  if finite(t.reward) and not t.metadata.get("vetoes")] for g in groups]
        self.value = centred_correlation(pairs)
        mean_len = statistics.fmean(lengths)
        if len(self.early) < self.config.baseline_steps:
            self.early.append(mean_len)
            return []
        baseline = statistics.median(self.early)
        drift = mean_len / baseline if baseline > 0 else math.inf
        severity = severity_above(drift, self.config.warn_above, self.config.critical_above)
        if severity is None or not self.value >= self.config.min_correlation:
            return []
        ids = trajectory_ids(groups)
        longest = sorted(((len(t.completion_ids), ids[k][i], t) for k, g in enumerate(groups)
                          for i, t in enumerate(g.trajectories)), key=lambda item: -item[0])[:3]
        evidence = {"mean_length": rounded(mean_len, 2), "baseline_length": rounded(baseline, 2),
                    "drift": rounded(drift, 3), "correlation": rounded(self.value, 3),
                    "examples": [{"id": i, "tokens": n, "reward": rounded(t.reward), "text": clip(t.completion)}
                                 for n, i, t in longest]}
        message = (f"Mean completion length is {mean_len:.0f} tokens, {drift:.1f}x the early baseline of "
                   f"{baseline:.0f}, and longer samples of a task score higher (correlation {self.value:.2f}).")
        return self.alert(step, "length", severity, message, evidence)


class EntropyCollapse(Detector):
    """The policy's entropy falls far below its early-run baseline (statistic: entropy / baseline)."""

    name = "entropy"
    state_fields = ("early",)

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        self.early: list[float] = []  # the first baseline_steps values

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        self.value = math.nan
        if not finite(metrics.get(self.config.metric)):
            return []
        value = float(metrics[self.config.metric])
        if len(self.early) < self.config.baseline_steps:
            self.early.append(value)
            return []
        baseline = statistics.median(self.early)
        if baseline <= 0:
            return []
        self.value = value / baseline
        severity = severity_below(self.value, self.config.warn_below, self.config.critical_below)
        evidence = {"metric": self.config.metric, "value": rounded(value), "baseline": rounded(baseline),
                    "ratio": rounded(self.value, 3)}
        message = (f"{self.config.metric} fell to {value:.3g}, {self.value:.0%} of its early baseline "
                   f"{baseline:.3g}: the policy is collapsing onto a few outputs.")
        return self.alert(step, "entropy", severity, message, evidence)
