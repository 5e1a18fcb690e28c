"""The rollout gate and the alias history of ``grooves learn``, with numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from grooves.workflows.learn import alias_stack, gate
from grooves.workflows.learn_state import AliasRow


def test_a_drop_within_two_standard_errors_passes_and_beyond_them_does_not():
    before, after = [0.5, 0.5, 0.5, 0.5], [0.4, 0.5, 0.3, 0.5]
    # d = (-0.1, 0, -0.2, 0): mean -0.075; stdev sqrt(0.0275 / 3) = 0.095743; SE = 0.047871
    decision, reason, (mean, se, b, a) = gate(before, after, [], 2.0, current=4)
    assert (mean, se, b, a) == pytest.approx((-0.075, 0.047871, 0.5, 0.425), abs=1e-6)
    assert decision == "in"  # 0.075 < 2 x 0.047871 = 0.0957
    assert reason == "held-out reward 0.425 against 0.500 (step 4), difference -0.075 ± 0.048; no alert"
    decision, reason, _ = gate(before, after, [], 1.0, current=4)
    assert decision == "out"  # 0.075 > 1 x 0.0479
    assert reason == ("held-out reward 0.425 against 0.500 (step 4): worse by 0.075, more than 1 standard errors "
                      "(0.048)")


def test_a_drop_with_no_noise_at_all_is_refused():
    decision, _, (mean, se, _, _) = gate([0.5] * 4, [0.4] * 4, [], 2.0, current=0)
    assert (decision, se) == ("out", 0.0) and mean == pytest.approx(-0.1)


def test_only_tasks_scored_by_both_are_paired():
    # pairs (0.5, 0.5) and (0.5, 0.7): d = (0, 0.2), mean 0.1, stdev 0.141421, SE 0.1
    decision, _, stats = gate([math.nan, 0.5, 0.5], [1.0, 0.5, 0.7], [], 2.0, current=0)
    assert decision == "in" and stats == pytest.approx((0.1, 0.1, 0.5, 0.6))
    decision, reason, _ = gate([math.nan, 0.5], [1.0, math.nan], [], 2.0, current=0)
    assert (decision, reason) == ("out", "no held-out task was scored by both checkpoints")


def test_an_alert_keeps_a_better_candidate_aside():
    alert = {"detector": "reward_spike", "severity": "critical", "message": "reward/total jumped"}
    decision, reason, (mean, _, _, _) = gate([0.1, 0.2], [0.9, 0.8], [alert], 2.0, current=0)
    assert mean == pytest.approx(0.7)
    assert (decision, reason) == ("out", "alert reward_spike (critical): reward/total jumped")


def test_each_rollback_goes_one_checkpoint_further_back():
    rows = [AliasRow(0, [], "start"), AliasRow(1, [], "gated in"), AliasRow(2, [], "gated in"),
            AliasRow(1, [], "rollback from step 2"), AliasRow(3, [], "gated in"),
            AliasRow(1, [], "rollback from step 3")]
    assert [r.step for r in alias_stack(rows[:3])] == [0, 1, 2]
    assert [r.step for r in alias_stack(rows[:4])] == [0, 1]
    assert [r.step for r in alias_stack(rows)] == [0, 1]
    assert [r.step for r in alias_stack(rows + [AliasRow(0, [], "rollback from step 1")])] == [0]
