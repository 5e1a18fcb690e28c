"""grooves probe: a short run that stops on an alert or a clear held-out gain, then a review."""

import math

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from grooves.training import load_config
from grooves.workflows.probe import heldout_rose, paired_gain, probe_config
from grooves.training.gather import Evaluation
from grooves.types import Group, Trajectory
from helpers import tiny_config
from test_alert_policy import planted_config


def evaluation(rewards):
    groups = []
    for index, reward in enumerate(rewards):
        t = Trajectory([{"role": "assistant", "content": "x"}], [1], [2], [1], [0.0], reward=reward)
        groups.append(Group({"id": f"t{index}"}, [t]))
    return Evaluation(groups, {})


def test_paired_gain_by_hand():
    mean, stderr, n = paired_gain(evaluation([0, 0, 1, 0.5]), evaluation([1, 0.5, 1, 1.5]))
    # differences 1, 0.5, 0, 1: mean 0.625, sample std sqrt(0.229167) = 0.4787, / sqrt(4)
    assert (n, mean) == (4, 0.625) and stderr == pytest.approx(0.4787 / 2, abs=1e-4)
    assert paired_gain(evaluation([0, math.nan]), evaluation([1, 1])) is None  # one task left: no stderr


def test_heldout_rose_needs_a_clear_gain_enough_tasks_and_steps():
    rule = heldout_rose(min_step=10, z=2.0)
    before = evaluation([0.2, 0.4, 0.3, 0.5, 0.1, 0.3])
    clear = evaluation([0.6, 0.7, 0.7, 0.8, 0.5, 0.6])  # every task up by 0.3 or 0.4: mean 0.35
    noisy = evaluation([0.6, 0.0, 0.7, 0.1, 0.5, 0.3])  # up and down
    assert "held-out reward rose by +0.350 per task" in rule(10, {}, {0: before, 10: clear})
    assert rule(8, {}, {0: before, 8: clear}) is None  # before min_step
    assert rule(10, {}, {0: before, 10: noisy}) is None
    assert rule(11, {}, {0: before, 10: clear}) is None  # not a validation step
    assert heldout_rose(min_tasks=7)(10, {}, {0: before, 10: clear}) is None


def test_probe_config(tmp_path):
    config = load_config(tiny_config(tmp_path, steps=100))
    config.log.val_every, config.log.save_every = 50, 3
    probe = probe_config(config, 40)
    assert (probe.name, probe.steps, probe.log.val_every, probe.log.save_every) == ("tiny-run-probe", 40, 10, 3)
    assert (probe.alerts.policy, probe.alerts.act_on) == ("pause", "warn")
    assert config.name == "tiny-run" and config.alerts.policy == "warn"  # the config itself is untouched
    assert probe_config(load_config(tiny_config(tmp_path, steps=4)), 40).steps == 4


def test_probe_pauses_on_an_alert_and_reviews(tmp_path):
    path = planted_config(tmp_path, steps=6, policy="warn")  # the probe pauses whatever the config says
    result = CliRunner().invoke(app, ["probe", str(path), "--runs", str(tmp_path / "runs")])
    assert result.exit_code == 3, result.output
    text = " ".join(result.output.replace("│", " ").split())
    assert "tiny-run-probe: probed 1 steps; stopped because judge_directed:" in text
    assert "top" in text.lower() and "bottom" in text.lower() and "grooves guard suggest tiny-run-probe" in text
    assert (tmp_path / "runs" / "tiny-run-probe" / "checkpoints" / "step-0001").is_dir()
    resumed = CliRunner().invoke(app, ["probe", str(path), "--runs", str(tmp_path / "runs"), "--resume",
                                       "--ack", "judge_directed", "--steps", "3"])
    assert resumed.exit_code == 0, resumed.output
    assert "probed 3 steps; stopped because the budget of 3 steps is spent" in " ".join(resumed.output.split())
