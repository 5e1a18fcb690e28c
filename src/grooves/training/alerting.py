"""A run's alerts: the detectors' alerts recorded and shown, the alert policy, and what halts a run.

``AlertHandling`` is a part of ``TrainingRun`` (``grooves.training.loop``): it reads the run's
``config``, ``store``, ``console``, ``monitors``, ``stop_rule``, ``evaluations``, ``acknowledged``
and sets ``_halt`` to ``(action, reason)``; the loop stops after the step that set it.
"""

from __future__ import annotations

import json

from rich.markup import escape
from rich.panel import Panel
from rich.text import Text

from grooves.monitors import Alert
from grooves.rewards.compose import RewardReport
from grooves.types import Group


class AlertHandling:
    def _check_failed(self, step: int, groups: list[Group], reports: dict[str, RewardReport],
                      metrics: dict[str, float]) -> None:
        """A step whose every reward failed, or whose reward statistics overflowed, trains nothing;
        after ``train.max_failed_steps`` of them in a row the run ends instead of spending its budget."""
        rewards = [t.reward for g in groups for t in g.trajectories if t.reward == t.reward]
        failed = None
        if metrics.get("alerts/nonfinite_stats"):
            failed = (f"the reward statistics were not finite (rewards from {min(rewards):.3g} to "
                      f"{max(rewards):.3g}); scale the reward to a moderate range")
            self._alert(step, "nonfinite_stats", f"Step skipped: {failed}.",
                        {"reward_min": min(rewards), "reward_max": max(rewards)})
        elif not rewards:
            errors = "; ".join(f"{name}: {error}" for report in reports.values()
                               for name, error in report.first_error.items())
            failed = f"every reward failed ({errors or 'no component scored any trajectory'})"
        self.failed_steps = self.failed_steps + 1 if failed else 0
        limit = self.config.train.max_failed_steps
        if failed and limit and self.failed_steps >= limit and self._halt is None:
            reason = f"{limit} steps in a row trained nothing: {failed}"
            self.store.record_alert(step, "run_failed", "critical", reason, {"action": "stop"})
            self._halt = ("failed", reason)

    def _watch(self, step: int, groups: list[Group], metrics: dict[str, float]) -> None:
        """Run the hacking detectors; record and show their alerts; apply the alert policy."""
        alerts = self.monitors.observe(step, groups, metrics)
        metrics.update(self.monitors.metrics())
        self._raise(step, alerts)
        if self._halt is None and self.stop_rule is not None:
            reason = self.stop_rule(step, metrics, self.evaluations)
            if reason:
                self._halt = ("stop", reason)

    def _raise(self, step: int, alerts: list[Alert]) -> None:
        """Record and show alerts; the first that is not a warning (by the policy) halts the run."""
        for alert in alerts:
            action = self._action(alert)
            self.store.record_alert(step, alert.detector, alert.severity, alert.message,
                                    {**alert.evidence, "action": action})
            self.console.print(alert_panel(alert, action))
            if action != "warn" and self._halt is None:
                self._halt = (action, f"{alert.detector}: {alert.message}")

    def _action(self, alert: Alert) -> str:
        policy = self.config.alerts
        action = policy.detectors.get(alert.detector, policy.policy)
        mild = policy.act_on == "critical" and alert.severity != "critical"
        return "warn" if mild or alert.detector in self.acknowledged else action

    def _announce_halt(self, step: int) -> None:
        action, reason = self._halt
        if action == "pause":
            detector = reason.split(":", 1)[0]
            self.console.print(Panel(Text(f"Paused after step {step} (checkpoint saved): {reason}"),
                                     title="paused by an alert", border_style="yellow"))
            # The commands to copy go under the panel, one line each: a panel wraps text at its edge.
            for line in (f"Read the samples: grooves review {self.run_dir.name}@{step}",
                         f"Continue, accepting this alert: {self.resume_command} --ack {detector}"):
                self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        elif action == "failed":
            self.console.print(f"[bold red]run failed[/] after step {step} (checkpoint saved): {escape(reason)}")
        else:
            self.console.print(f"[yellow]stopped[/] after step {step} (checkpoint saved): {escape(reason)}")

    def _alert(self, step: int, detector: str, message: str, evidence: dict) -> None:
        self.store.record_alert(step, detector, "warn", message, evidence)
        self.console.print(Panel(Text(message), title=f"alert: {detector} (step {step})", border_style="red"))

    def _report_reward_errors(self, step: int, task_set: str, report: RewardReport) -> None:
        """Show the first failure of each reward component once; later ones only count in metrics."""
        for name, errors in report.errors.items():
            if (task_set, name) in self._reported_errors:
                continue
            self._reported_errors.add((task_set, name))
            self._alert(step, "reward_error",
                        f"reward component {name!r} failed on {errors} of {report.calls[name]} trajectories "
                        f"(they get NaN, not 0, and leave the advantage if required). First error: "
                        f"{report.first_error[name]}",
                        {"component": name, "task_set": task_set, "errors": errors, "calls": report.calls[name],
                         "first_error": report.first_error[name]})


def alert_panel(alert: Alert, action: str) -> Panel:
    """A readable alert: the message, the evidence, and what the run does about it."""
    lines = [alert.message, ""]
    for key, value in alert.evidence.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        lines.append(f"{key}: {text if len(text) <= 200 else text[:197] + '...'}")
    style = "red" if alert.severity == "critical" else "yellow"
    return Panel(Text("\n".join(lines)), border_style=style,
                 title=f"alert: {alert.detector} ({alert.severity}, step {alert.step}) -> {action}")
