"""``GuardVeto``: one of the run's own guards vetoes (nearly) every sample, step after step.

Not a hack by the policy but a run that cannot learn: every vetoed total is the guard's
floor, so no group has a spread of rewards, every advantage is 0 and the steps train
nothing, while the curves look calm (a flat reward, no error). Usual causes: a ``format``
pattern the base model never meets, a grounding guard given the wrong source column, a
guard proposed from too few examples.
"""

from __future__ import annotations

import math
from collections import Counter

from grooves.monitors.base import Alert, Detector, rounded, severity_above, trajectory_ids
from grooves.monitors.signals import guard_names
from grooves.monitors.stats import finite
from grooves.monitors.text import clip
from grooves.types import Group


class GuardVeto(Detector):
    """Statistic: the most steps in a row that one guard vetoed at least ``veto_rate`` of the samples."""

    name = "guard_veto"
    state_fields = ("streaks",)

    def __init__(self, config, cooldown_steps: int = 10):
        super().__init__(config, cooldown_steps)
        self.streaks: dict[str, int] = {}  # guard -> steps in a row at or above veto_rate

    def observe(self, step: int, groups: list[Group], metrics: dict[str, float]) -> list[Alert]:
        guards = guard_names(metrics)
        if not guards:
            self.value = math.nan
            return []
        rates = {g: metrics.get(f"reward/{g}/veto_rate") for g in guards}
        for guard, rate in rates.items():
            blocked = finite(rate) and float(rate) >= self.config.veto_rate
            self.streaks[guard] = self.streaks.get(guard, 0) + 1 if blocked else 0
        self.value = float(max(self.streaks[g] for g in guards))
        alerts = []
        for guard in guards:
            steps = self.streaks[guard]
            severity = severity_above(steps, self.config.warn_steps, self.config.critical_steps)
            if severity is None:
                continue
            reasons, examples = _reasons(groups, guard)
            why = f" Its most common reason: {reasons[0]['reason']!r}." if reasons else ""
            message = (f"The guard {guard} vetoed {float(rates[guard]):.0%} of the samples for {steps} steps in a "
                       f"row: every vetoed reward is its floor, so the run has nothing to learn from.{why} "
                       f"Check the guard against the model's outputs (grooves review) before training on.")
            evidence = {"guard": guard, "veto_rate": rounded(float(rates[guard])), "steps": steps,
                        "reward_total": rounded(float(metrics.get("reward/total", math.nan))),
                        "reasons": reasons, "examples": examples}
            alerts += self.alert(step, f"reward/{guard}/veto_rate", severity, message, evidence, value=steps)
        return alerts


def _reasons(groups: list[Group], guard: str, top: int = 3) -> tuple[list[dict], list[dict]]:
    """The guard's most common veto reasons with counts, and a few vetoed samples (id, output)."""
    counts: Counter = Counter()
    examples = []
    for ids, group in zip(trajectory_ids(groups), groups):
        for ident, trajectory in zip(ids, group.trajectories):
            reason = trajectory.metadata.get("vetoes", {}).get(guard)
            if reason is None:
                continue
            counts[clip(str(reason))] += 1
            if len(examples) < top:
                examples.append({"id": ident, "output": clip(trajectory.completion)})
    return [{"reason": r, "count": n} for r, n in counts.most_common(top)], examples
