"""A judge that times out is reported with its cause in the step's output, not only counted:
a training run on the tiny model against a judge server on 127.0.0.1 that answers too late."""

import io
import json
import sqlite3

import pytest
from rich.console import Console

from fault_server import FaultServer
from helpers import tiny_config


@pytest.fixture(scope="module")
def slow():
    with FaultServer() as server:
        yield server


def test_a_judge_timeout_shows_its_cause_in_the_step_output(slow, tmp_path):
    from grooves.training import load_config, run_config

    slow.play(("sleep", 2.0, "{}"))  # every request answers after 2 s; the judge waits 0.2 s
    path = tiny_config(tmp_path, steps=1)
    path.write_text(path.read_text() + f'''
[reward.endpoints.slow]
base_url = "{slow.base_url}"
model = "fault"
timeout = 0.2
max_retries = 1
backoff = 0.01

[[reward.components]]
kind = "group_judge"
name = "relative"
endpoint = "slow"
rubric = "Prefer the shorter output."
conversation = true
required = false
''')
    out = io.StringIO()
    run = run_config(load_config(path), out=tmp_path / "run", progress=False,
                     console=Console(file=out, width=400, color_system=None))
    step = run.metrics[1]
    assert step["reward/relative/error_rate"] == 1.0 and step["reward/relative"] is None  # NaN, written as null
    assert step["reward/relative/retries"] > 0
    shown = " ".join(out.getvalue().replace("│", " ").split())
    cause = f"judge 'relative': {slow.base_url} timed out after 0.2 s (1 retry); last: APITimeoutError"
    assert "alert: reward_error (step 1)" in shown
    assert "reward component 'relative' failed on" in shown and cause in shown
    assert shown.count("reward component 'relative' failed") == 1  # once, though validation failed too
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        evidence = [json.loads(e) for (e,) in db.execute("SELECT evidence FROM alerts WHERE detector = 'reward_error'")]
        stored = [json.loads(d) for (d,) in db.execute("SELECT data FROM trajectories WHERE split = 'train'")]
    assert len(evidence) == 1 and cause in evidence[0]["first_error"]
    reasons = [t["metadata"]["reasons"]["relative"] for t in stored]  # each sample says why (review, dashboard)
    assert len(reasons) == len(stored) >= 8 and all(r == f"failed: JudgeError: {cause}: Request timed out." for r in reasons)
