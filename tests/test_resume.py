"""A run killed with SIGKILL mid-run resumes to the same adapter as a run that never stopped."""

import os
import signal
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from grooves.training import load_config, run_config
from grooves.runs.store import read_metrics
from helpers import tiny_config


def adapter(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step:04d}" / "adapter" / "adapter_model.safetensors"))


def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    config_path = tiny_config(tmp_path, steps=6)
    config = load_config(config_path)
    straight = run_config(config, out=tmp_path / "straight", progress=False)
    assert straight.step == 6

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "grooves.cli", "train", str(config_path), "--out", str(killed),
                             "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step-0002").exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)  # somewhere in step 3 or 4
    proc.wait()
    done_before_resume = {row["step"] for row in read_metrics(killed / "metrics.jsonl")}
    assert 6 not in done_before_resume

    resumed = run_config(load_config(config_path), out=killed, resume=True, progress=False)
    assert resumed.step == 6
    a, b = adapter(tmp_path / "straight", 6), adapter(killed, 6)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5), name
    # the records read as one uninterrupted run
    steps = [row["step"] for row in read_metrics(killed / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    rewards = [row.get("reward/total") for row in read_metrics(killed / "metrics.jsonl")]
    assert rewards == [row.get("reward/total") for row in straight.metrics]


def test_resume_after_a_crash_during_checkpoint_write(tmp_path):
    """A half-written checkpoint (a .tmp folder) is ignored and cleaned up."""
    config_path = tiny_config(tmp_path, steps=2)
    run_dir = tmp_path / "run"
    run_config(load_config(config_path), out=run_dir, progress=False)
    partial = run_dir / "checkpoints" / ".tmp-step-0004-999"
    (partial / "adapter").mkdir(parents=True)
    config = load_config(config_path)
    config.steps = 4
    run = run_config(config, out=run_dir, resume=True, progress=False)
    assert run.step == 4 and not partial.exists()
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_resume_before_the_first_checkpoint_starts_over_once(tmp_path):
    config_path = tiny_config(tmp_path, steps=2)
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(reward_file.read_text() + f'''
import pathlib
def crash_once(completion):
    counter = pathlib.Path({str(tmp_path / "calls")!r})
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == 5:  # the first training call, after step 0's validation of 4 tasks and before any checkpoint
        raise KeyboardInterrupt  # stands for a kill
    return 0.0
''')
    config_path.write_text(config_path.read_text().replace(":short", ":crash_once"))
    run_dir = tmp_path / "run"
    try:
        run_config(load_config(config_path), out=run_dir, progress=False)
    except KeyboardInterrupt:
        pass
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [0]
    assert not list((run_dir / "checkpoints").iterdir())
    run = run_config(load_config(config_path), out=run_dir, resume=True, progress=False)
    assert run.step == 2
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
