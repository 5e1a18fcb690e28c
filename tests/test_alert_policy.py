"""The alert policy in a real run (tiny model): pause leaves a checkpoint, resume keeps the
monitors' memory, --ack turns a detector's alerts into warnings; alerts reach every sink.

The "hack" is planted through the config: a judge-directed pattern that every output matches
(the detector itself is the real one), so the alert fires at step 1 without waiting for the
tiny model to find a trick.
"""

import json
import sqlite3

from typer.testing import CliRunner

from grooves.cli import app
from grooves.training import load_config, run_config
from grooves.runs.store import read_metrics
from helpers import tiny_config

PLANTED = '''
[monitors]
cooldown_steps = {cooldown}
[monitors.judge_directed]
extra_patterns = ["[\\\\s\\\\S]"]

[alerts]
policy = "{policy}"
'''


def planted_config(tmp_path, steps=5, policy="pause", cooldown=10):
    path = tiny_config(tmp_path, steps=steps)
    path.write_text(path.read_text() + PLANTED.format(policy=policy, cooldown=cooldown))
    return path


def alerts(run_dir, detector="judge_directed"):
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        rows = db.execute("SELECT step, severity, evidence FROM alerts WHERE detector = ? ORDER BY id",
                          (detector,)).fetchall()
    return [(step, severity, json.loads(evidence)["action"]) for step, severity, evidence in rows]


def test_pause_checkpoints_and_resume_keeps_the_monitors_memory(tmp_path):
    path = planted_config(tmp_path)
    run = run_config(load_config(path), out=tmp_path / "run", progress=False)
    assert (run.step, run.halted_by) == (1, "pause") and run.halt_reason.startswith("judge_directed: ")
    assert (tmp_path / "run" / "checkpoints" / "step-0001").is_dir()
    assert alerts(run.dir) == [(1, "critical", "pause")]
    assert read_metrics(run.dir / "metrics.jsonl")[-1]["alerts/judge_directed"] == 1.0
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-0001" / "state.json").read_text())
    assert state["monitors"]["detectors"]["judge_directed"] and state["acknowledged"] == []

    # Same evidence within the cooldown: the resumed run does not pause again at once.
    resumed = run_config(load_config(path), out=tmp_path / "run", resume=True, progress=False)
    assert (resumed.step, resumed.halted_by) == (5, None)
    assert alerts(resumed.dir) == [(1, "critical", "pause")]
    assert [row["step"] for row in read_metrics(resumed.dir / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]


def test_acknowledged_detectors_only_warn_and_the_ack_is_kept(tmp_path):
    path = planted_config(tmp_path, steps=6, cooldown=2)
    first = run_config(load_config(path), out=tmp_path / "run", progress=False)
    assert first.halted_by == "pause"
    again = run_config(load_config(path), out=tmp_path / "run", resume=True, progress=False)
    assert (again.step, again.halted_by) == (3, "pause")  # the cooldown of 2 steps is over: it fires again
    acked = run_config(load_config(path), out=tmp_path / "run", resume=True, progress=False,
                       acknowledge=("judge_directed",))
    assert (acked.step, acked.halted_by) == (6, None)
    assert alerts(acked.dir) == [(1, "critical", "pause"), (3, "critical", "pause"), (5, "critical", "warn")]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-0006" / "state.json").read_text())
    assert state["acknowledged"] == ["judge_directed"]


def test_stop_policy_and_per_detector_override(tmp_path):
    path = planted_config(tmp_path, policy="warn")
    path.write_text(path.read_text() + '\n[alerts.detectors]\njudge_directed = "stop"\n')
    run = run_config(load_config(path), out=tmp_path / "run", progress=False)
    assert (run.step, run.halted_by) == (1, "stop")
    (tmp_path / "b").mkdir()
    warn_only = planted_config(tmp_path / "b", policy="warn")
    run = run_config(load_config(warn_only), out=tmp_path / "b" / "run", progress=False)
    assert (run.step, run.halted_by) == (5, None) and alerts(run.dir)[0] == (1, "critical", "warn")


def test_cli_pause_exits_3_with_the_resume_command_and_bad_acks_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the resume command's paths on one panel line
    path = planted_config(tmp_path)
    result = CliRunner().invoke(app, ["train", str(path), "--out", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 3, result.output
    text = " ".join(result.output.replace("│", " ").split())  # the panel wraps lines
    assert f"--resume --out {tmp_path / 'run'} " in text and "--ack judge_directed" in text
    assert "grooves review run@1" in text
    bad = CliRunner().invoke(app, ["train", str(path), "--out", str(tmp_path / "run"), "--resume", "--ack", "vibes"])
    assert bad.exit_code == 2 and "not a detector" in bad.output
    no_resume = CliRunner().invoke(app, ["train", str(path), "--ack", "collapse"])
    assert no_resume.exit_code == 2 and "use it with --resume" in no_resume.output
