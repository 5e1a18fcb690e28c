"""Runs you can trust: one trainer per run, corrupt checkpoints found, failing rewards stop the
run, bad user files are messages, and the exit code tells a stop from a finish."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

from grooves.cli import app
from grooves.runs.store import read_metrics
from helpers import tiny_config

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def start_training(config, runs, *extra):
    return subprocess.Popen([sys.executable, "-m", "grooves.cli", "train", str(config), "--runs", str(runs),
                             *map(str, extra)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, proc, seconds=120):
    deadline = time.time() + seconds
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def steps_logged(run_dir):
    path = run_dir / "metrics.jsonl"
    return [row["step"] for row in read_metrics(path)] if path.exists() else []


# --- 1. one training process per run ----------------------------------------------------


def test_a_second_trainer_on_the_same_run_exits_2_naming_the_first(tmp_path):
    runs = tmp_path / "runs"
    config = tiny_config(tmp_path, steps=400)
    first = start_training(config, runs, "--quiet")
    try:
        wait_for(lambda: len(steps_logged(runs / "tiny-run")) >= 2, first)
        second = invoke("train", config, "--runs", runs, "--resume", "--quiet")
        assert second.exit_code == 2, second.output
        assert f"PID {first.pid}" in second.output and "another process" in second.output
        before = steps_logged(runs / "tiny-run")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert len(before) == len(set(before))  # no step was written twice

    from grooves.runs.lock import RunLock

    with RunLock(runs / "tiny-run"):  # the dead process's lock went with it
        pass


# --- 2. a corrupt newest checkpoint ---------------------------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [
    lambda ck: _truncate(ck / "adapter" / "adapter_model.safetensors"),
    lambda ck: _truncate(ck / "trainer.pt"),
    lambda ck: (ck / "state.json").write_text(""),
], ids=["truncated-adapter", "truncated-trainer", "empty-state"])
def test_resume_falls_back_past_a_corrupt_checkpoint(tmp_path, monkeypatch, damage):
    from grooves.policy.checkpoints import CheckpointError, resolve_checkpoint

    monkeypatch.setenv("COLUMNS", "200")  # the runs table on one line a row
    runs = tmp_path / "runs"
    config = tiny_config(tmp_path, steps=4)
    assert invoke("train", config, "--runs", runs, "--quiet").exit_code == 0
    run_dir = runs / "tiny-run"
    damage(run_dir / "checkpoints" / "step-0004")

    listing = invoke("runs", "--runs", runs)
    assert "tiny-run@2 (step 4 corrupt)" in " ".join(listing.output.split())
    assert resolve_checkpoint("tiny-run@latest", runs).name == "step-0002"
    with pytest.raises(CheckpointError, match="tiny-run@4 is corrupt"):
        resolve_checkpoint("tiny-run@4", runs)

    resumed = invoke("train", config, "--runs", runs, "--resume", "--steps", "5", "--quiet")
    assert resumed.exit_code == 0, resumed.output
    text = " ".join(resumed.output.split())
    assert "checkpoint step 4 is corrupt" in text and "resuming from the newest complete checkpoint, step-0002" in text
    assert steps_logged(run_dir) == [0, 1, 2, 3, 4, 5]  # steps 3-4 were trained again, once
    assert (run_dir / "checkpoints" / "corrupt-step-0004").is_dir()  # kept for inspection
    assert resolve_checkpoint("tiny-run@4", runs).name == "step-0004"  # the re-trained step is whole


# --- 3. rewards that all fail, columns that do not exist -------------------------------------


def _add_reward(tmp_path, config, code, name):
    reward = tmp_path / "my_reward.py"
    reward.write_text(reward.read_text() + code)
    config.write_text(config.read_text().replace(":short", f":{name}"))


def test_a_run_whose_rewards_all_fail_stops_early_with_the_reason(tmp_path):
    runs = tmp_path / "runs"
    config = tiny_config(tmp_path, steps=12)
    _add_reward(tmp_path, config, "\ndef down(completion):\n    raise ConnectionError('judge is down')\n", "down")
    result = invoke("train", config, "--runs", runs, "--quiet")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "3 steps in a row trained nothing: every reward failed" in text
    assert "down: ConnectionError: judge is down" in text and "reward -" in text
    assert steps_logged(runs / "tiny-run") == [0, 1, 2, 3]  # not the whole budget of 12
    assert "Traceback" not in result.output


def test_a_verifier_asking_for_a_missing_column_fails_before_training(tmp_path):
    runs = tmp_path / "runs"
    config = tiny_config(tmp_path)
    _add_reward(tmp_path, config, "\ndef mentions(completion, keyword):\n    return 1.0\n", "mentions")
    result = invoke("train", config, "--runs", runs, "--quiet")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "reward component 'mentions' asks for task column 'keyword', which 24 of 24 tasks lack" in text
    assert steps_logged(runs / "tiny-run") == []


# --- 4. huge rewards, duplicate ids, rewards that are not numbers ------------------------------


def test_overflowing_reward_statistics_are_detected_not_silently_skipped():
    from grooves.algorithms import grpo
    from grooves.training.step import prepare_batch
    from grooves.types import Group, Trajectory

    def group(*rewards):
        return Group({"id": "a"}, [Trajectory(messages=[], prompt_ids=[1], completion_ids=[2], completion_mask=[1],
                                              logprobs=[0.0], reward=r) for r in rewards])

    prepared = prepare_batch([group(1e300, 0.0, 5.0)], grpo(), 16)
    assert prepared.metrics["alerts/nonfinite_stats"] == 1.0  # the std overflowed to inf
    assert torch.equal(prepared.advantages, torch.zeros(3))
    fine = prepare_batch([group(1e100, 0.0)], grpo(), 16)
    assert "alerts/nonfinite_stats" not in fine.metrics and fine.advantages[0] > 0


def test_a_run_with_huge_rewards_alerts_and_stops(tmp_path):
    runs = tmp_path / "runs"
    config = tiny_config(tmp_path, steps=10)
    _add_reward(tmp_path, config, "\ndef huge(completion):\n    return 1e300 * (len(completion) % 3)\n", "huge")
    result = invoke("train", config, "--runs", runs, "--quiet")
    assert result.exit_code == 1, result.output
    assert "reward statistics were not finite" in " ".join(result.output.split())
    rows = read_metrics(runs / "tiny-run" / "metrics.jsonl")
    assert rows[1]["alerts/nonfinite_stats"] == 1.0


def test_duplicate_task_ids_warn_and_say_what_the_split_did(tmp_path):
    config = tiny_config(tmp_path, steps=1)
    tasks = tmp_path / "tasks.jsonl"
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    rows[5]["id"] = rows[6]["id"] = "same"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = invoke("train", config, "--runs", tmp_path / "runs", "--quiet")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "1 task ids occur more than once (e.g. 'same' x2)" in text and "copies stay on one side" in text


def test_a_reward_that_returns_a_string_is_an_error_not_a_number():
    from grooves.rewards import Reward, RewardReport, Verifier
    from grooves.types import Group, Trajectory

    reward = Reward([Verifier("stringy", lambda completion: "0.5"), Verifier("fine", lambda completion: True)])
    group = Group({"id": "a"}, [Trajectory(messages=[{"role": "assistant", "content": "x"}], prompt_ids=[1],
                                           completion_ids=[2], completion_mask=[1], logprobs=[0.0])])
    report = reward.score([group], RewardReport())
    trajectory = group.trajectories[0]
    assert math.isnan(trajectory.components["stringy"]) and trajectory.components["fine"] == 1.0
    assert report.errors == {"stringy": 1}
    assert report.first_error["stringy"] == "returned '0.5' (str), expected a finite number"


# --- 5. user-file mistakes are messages ---------------------------------------------------------


@pytest.mark.parametrize("source, expected", [
    ("def vowels(completion:\n    return 1\n", "my_reward.py:1: syntax error"),
    ("import json\nraise RuntimeError('no API key')\n", "my_reward.py:2: importing it raised RuntimeError: no API key"),
])
def test_a_broken_reward_file_is_one_line_exit_2(tmp_path, source, expected):
    config = tiny_config(tmp_path)
    (tmp_path / "my_reward.py").write_text(source)
    result = invoke("train", config, "--runs", tmp_path / "runs")
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_non_utf8_task_file_is_a_message(tmp_path, suffix):
    config = tiny_config(tmp_path)
    tasks = tmp_path / f"latin.{suffix}"
    header = b"" if suffix == "jsonl" else b"id,text,limit\n"
    row = b'{"id": "1", "text": "caf\xe9", "limit": 5}\n' if suffix == "jsonl" else b"1,caf\xe9,5\n"
    tasks.write_bytes(header + row)
    config.write_text(config.read_text().replace(str(tmp_path / "tasks.jsonl"), str(tasks)))
    result = invoke("train", config, "--runs", tmp_path / "runs")
    assert result.exit_code == 2, result.output
    line = 1 if suffix == "jsonl" else 2
    assert f"latin.{suffix}:{line}: not UTF-8 text (byte 0xe9" in " ".join(result.output.split())


def test_zero_steps_is_a_plain_message(tmp_path):
    result = invoke("train", tiny_config(tmp_path), "--steps", "0")
    assert result.exit_code == 2
    assert "--steps" in result.output and "pydantic" not in result.output


# --- 6. resume, Ctrl-C and the hints -------------------------------------------------------------


def test_resume_with_nothing_to_resume_says_so(tmp_path):
    result = invoke("train", tiny_config(tmp_path), "--runs", tmp_path / "runs", "--resume")
    assert result.exit_code == 2
    assert "nothing to resume" in result.output and not (tmp_path / "runs" / "tiny-run" / "metrics.jsonl").exists()


def test_ctrl_c_saves_then_exits_130_with_the_full_resume_command(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "elsewhere"
    config = tiny_config(tmp_path, steps=400)
    proc = subprocess.Popen([sys.executable, "-m", "grooves.cli", "train", str(config), "--runs", str(runs),
                             "--out", str(out), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(steps_logged(out)) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    last = steps_logged(out)[-1]
    assert (out / "checkpoints" / f"step-{last:04d}").is_dir()  # saved before exiting
    text = " ".join((stdout + stderr).split())  # progress and its messages go to stdout
    assert f"grooves train {config} --resume --out {out} --runs {runs}" in text


def test_the_python_api_names_its_own_resume_call(tmp_path):
    import grooves as gr
    from grooves.training import RunExistsError

    policy = gr.Policy.load("tiny", lora=gr.LoRA(rank=4), seed=0)
    tasks = [{"prompt": f"say {i}"} for i in range(8)]
    kwargs = dict(tasks=tasks, reward=lambda completion: float(len(completion) % 2), steps=1, group_size=2,
                  runs=tmp_path, progress=False)
    gr.train(policy, **kwargs)
    with pytest.raises(RunExistsError) as error:
        gr.train(policy, **kwargs)
    message = str(error.value)
    assert "gr.train(..., name='run', resume=True)" in message and "\n" not in message
    assert gr.train(policy, **{**kwargs, "steps": 2}, resume=True).step == 2


def test_runs_says_which_step_the_heldout_number_is_from(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    runs = tmp_path / "runs"
    config = tiny_config(tmp_path, steps=3)  # val_every = 2: held-out at steps 0, 2 and 3 (the end)
    assert invoke("train", config, "--runs", runs, "--quiet").exit_code == 0
    last_val = [row for row in read_metrics(runs / "tiny-run" / "metrics.jsonl") if "val/reward/total" in row][-1]
    listing = " ".join(invoke("runs", "--runs", runs).output.split())
    assert f"{last_val['val/reward/total']:.3f} (step 3)" in listing
