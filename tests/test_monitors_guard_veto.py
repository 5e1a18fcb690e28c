"""guard_veto: a guard of the run that vetoes every sample for steps in a row raises an alert
(the run learns nothing), on numbers by hand and in a real tiny run with a guard that never passes."""

import json
import math
import sqlite3

import pytest

from grooves.monitors import GuardVeto, GuardVetoConfig, Monitors, MonitorsConfig
from grooves.training import load_config, run_config
from grooves.types import Group, Trajectory
from helpers import tiny_config


def vetoed_group(task_id: str, *texts: str, reason: str = "does not match 'X'") -> Group:
    trajectories = [Trajectory(messages=[{"role": "user", "content": "u"}, {"role": "assistant", "content": t}],
                               prompt_ids=[1], completion_ids=[2], completion_mask=[1], logprobs=[0.0], reward=0.0,
                               metadata={"vetoes": {"fmt": reason}}) for t in texts]
    return Group({"id": task_id}, trajectories)


def step_metrics(fmt: float, other: float = 0.0) -> dict[str, float]:
    return {"reward/total": 0.0, "reward/fmt": 1 - fmt, "reward/fmt/veto_rate": fmt,
            "reward/other": 1 - other, "reward/other/veto_rate": other}


def test_three_steps_of_every_sample_vetoed_warn_and_six_are_critical():
    detector = GuardVeto(GuardVetoConfig())
    groups = [vetoed_group("t0", "a", "b"), vetoed_group("t1", "c", "d", reason="too long")]
    seen = []
    for step, rate in enumerate([1.0, 1.0, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], start=1):
        alerts = detector.observe(step, groups, step_metrics(rate))
        seen.append((step, detector.value, [a.severity for a in alerts]))
    # 0.75 at step 3 resets the count: steps 4, 5, 6 make three in a row (warn), 4..9 make six (critical);
    # steps 7 and 8 repeat the warning on the same metric inside the cooldown, so they are quiet.
    assert seen == [(1, 1.0, []), (2, 2.0, []), (3, 0.0, []), (4, 1.0, []), (5, 2.0, []), (6, 3.0, ["warn"]),
                    (7, 4.0, []), (8, 5.0, []), (9, 6.0, ["critical"])]
    first = GuardVeto(GuardVetoConfig())
    for step in (1, 2):
        first.observe(step, groups, step_metrics(1.0))
    [warn] = first.observe(3, groups, step_metrics(1.0))
    assert (warn.detector, warn.key, warn.value) == ("guard_veto", "reward/fmt/veto_rate", 3.0)
    assert warn.evidence["reasons"] == [{"reason": "does not match 'X'", "count": 2}, {"reason": "too long", "count": 2}]
    assert [e["id"] for e in warn.evidence["examples"]] == ["t0#0", "t0#1", "t1#0"]
    assert (warn.evidence["guard"], warn.evidence["veto_rate"], warn.evidence["steps"]) == ("fmt", 1.0, 3)
    assert "The guard fmt vetoed 100% of the samples for 3 steps in a row" in warn.message


def test_no_guard_is_nan_a_lower_rate_counts_and_the_count_survives_a_resume():
    detector = GuardVeto(GuardVetoConfig(veto_rate=0.9, warn_steps=2))
    assert detector.observe(1, [], {"reward/total": 0.5}) == [] and math.isnan(detector.value)
    detector.observe(1, [], step_metrics(0.9))
    resumed = GuardVeto(GuardVetoConfig(veto_rate=0.9, warn_steps=2))
    resumed.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    [alert] = resumed.observe(2, [], step_metrics(0.95))
    assert alert.evidence["reasons"] == [] and alert.value == 2.0
    with pytest.raises(ValueError, match="critical_steps"):
        GuardVetoConfig(warn_steps=4, critical_steps=3)


def test_the_suite_runs_it_and_logs_its_statistic():
    monitors = Monitors(MonitorsConfig())
    monitors.observe(1, [], step_metrics(1.0, other=1.0))
    assert monitors.metrics()["alerts/guard_veto"] == 1.0
    assert Monitors(MonitorsConfig(guard_veto={"enabled": False})).metrics().get("alerts/guard_veto") is None


NEVER_PASSES = '''
[[reward.components]]
kind = "guard"
guard = "format"
name = "fmt"
pattern = "ZZZ-NEVER[0-9]{40}"

[alerts]
policy = "pause"
'''


def test_a_run_whose_guard_vetoes_every_sample_pauses_after_three_steps(tmp_path):
    path = tiny_config(tmp_path, steps=8)
    path.write_text(path.read_text() + NEVER_PASSES)
    run = run_config(load_config(path), out=tmp_path / "run", progress=False)
    assert (run.step, run.halted_by) == (3, "pause") and run.halt_reason.startswith("guard_veto: ")
    with sqlite3.connect(run.dir / "run.sqlite") as db:
        [(step, severity, evidence)] = db.execute(
            "SELECT step, severity, evidence FROM alerts WHERE detector = 'guard_veto'").fetchall()
    evidence = json.loads(evidence)
    assert (step, severity, evidence["guard"], evidence["steps"], evidence["veto_rate"]) == (3, "warn", "fmt", 3, 1.0)
    assert "does not match" in evidence["reasons"][0]["reason"]
