"""Multi-task runs: several task sets, each with its own reward, training one adapter."""

import collections
import json
import sqlite3

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from grooves.cli import app
from grooves.rewards import Component, Reward
from grooves.training import load_config, run_config
from grooves.runs.store import read_metrics
from grooves.training.tasksets import TaskMix, TaskSet

REWARDS = '''
def vowels(completion):
    return sum(ch in "aeiou" for ch in completion) / max(1, len(completion))

def short(completion):
    return 1.0 if len(completion) < 8 else 0.0
'''


def mix_config(tmp_path, steps=3, rank=1):
    (tmp_path / "r.py").write_text(REWARDS)
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(
            json.dumps({"id": f"{name}{i}", "prompt": f"task {name} number {i}"}) + "\n" for i in range(20)))
    path = tmp_path / "mix.toml"
    path.write_text(f'''
name = "mix"
steps = {steps}
[model]
spec = "tiny"
[lora]
rank = {rank}
[[mix]]
name = "vowels"
weight = 3.0
[mix.tasks]
source = "{tmp_path / 'a.jsonl'}"
[[mix.reward.components]]
function = "{tmp_path / 'r.py'}:vowels"
[[mix]]
name = "brief"
[mix.tasks]
source = "{tmp_path / 'b.jsonl'}"
[[mix.reward.components]]
function = "{tmp_path / 'r.py'}:short"
[sampling]
max_completion_length = 10
[optim]
learning_rate = 0.05
[train]
group_size = 4
tasks_per_step = 4
[log]
save_every = 1
val_every = 3
val_size = 3
tensorboard = false
''')
    return path


def test_a_mixed_run_reports_each_task_set(tmp_path):
    run = run_config(load_config(mix_config(tmp_path)), out=tmp_path / "run", progress=False)
    first = run.metrics[1]
    for key in ("reward/total", "task/vowels/reward/total", "task/vowels/reward/vowels",
                "task/brief/reward/short", "task/brief/reward/short/error_rate"):
        assert key in first, key
    assert "reward/vowels" not in first  # component metrics live under their task set
    final = run.metrics[-1]
    assert {"val/reward/total", "val/task/vowels/reward/total", "val/task/brief/reward/total"} <= set(final)
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        tasks = [t for (t,) in db.execute("SELECT DISTINCT task_id FROM trajectories WHERE split = 'train'")]
        val = [t for (t,) in db.execute("SELECT DISTINCT task_id FROM trajectories WHERE split = 'val'")]
    assert any(t.startswith("a") for t in tasks) and any(t.startswith("b") for t in tasks)
    assert sum(t.startswith("a") for t in val) >= 1 and sum(t.startswith("b") for t in val) >= 1
    lora = load_file(str(tmp_path / "run" / "checkpoints" / "step-0003" / "adapter" / "adapter_model.safetensors"))
    assert {tuple(v.shape) for k, v in lora.items() if "lora_A" in k} >= {(1, 64)}  # rank 1
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)


def test_a_mixed_run_resumes_to_the_same_adapter(tmp_path):
    straight = load_config(mix_config(tmp_path, steps=4))
    run_config(straight, out=tmp_path / "straight", progress=False)
    first_half = load_config(mix_config(tmp_path, steps=2))
    run_config(first_half, out=tmp_path / "halves", progress=False)
    run_config(load_config(mix_config(tmp_path, steps=4)), out=tmp_path / "halves", resume=True, progress=False)
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step-0004" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "halves" / "checkpoints" / "step-0004" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert [r["step"] for r in read_metrics(tmp_path / "halves" / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_tasks_are_drawn_by_weight_in_a_seeded_order():
    def task_set(name, weight):
        return TaskSet(name, [{"id": f"{name}{i}"} for i in range(5)], [], Reward([Component("x", lambda: 0)]),
                       weight=weight)

    mix = TaskMix([task_set("a", 3.0), task_set("b", 1.0)], seed=1)
    counts = collections.Counter(mix.take()[0].name for _ in range(4000))
    assert 2800 < counts["a"] < 3200
    state = mix.state()
    following = [mix.take()[1]["id"] for _ in range(10)]
    again = TaskMix([task_set("a", 3.0), task_set("b", 1.0)], seed=1)
    again.restore(state)
    assert [again.take()[1]["id"] for _ in range(10)] == following


@pytest.mark.parametrize("edit, message", [
    (("[sampling]", '[tasks]\nsource = "x.jsonl"\n[sampling]'), "either [tasks] and [reward], or [[mix]]"),
    (('name = "brief"', 'name = "vowels"'), "[[mix]] names must be unique"),
    (('name = "brief"', 'name = "no spaces allowed"'), "mix.1.name"),
])
def test_mix_config_errors(tmp_path, edit, message):
    path = mix_config(tmp_path)
    path.write_text(path.read_text().replace(*edit, 1))
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2 and message in " ".join(result.output.split())
