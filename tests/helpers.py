"""Small run configurations on the tiny model, shared by the CLI and resume tests."""

from __future__ import annotations

import json
from pathlib import Path

REWARD_PY = '''
def vowels(completion):
    """Share of vowels: something the tiny model can move quickly."""
    return sum(ch in "aeiou" for ch in completion) / max(1, len(completion))

def short(completion, limit):
    return 1.0 if len(completion) <= int(limit) else 0.0
'''


def tiny_config(tmp_path: Path, steps: int = 4) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "text": f"item {i} " * (i % 3 + 1), "limit": 6 + i % 5})
                             + "\n" for i in range(24)))
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD_PY)
    body = f'''
name = "tiny-run"
seed = 3
steps = {steps}

[model]
spec = "tiny"

[lora]
rank = 4
alpha = 8
dropout = 0.1

[tasks]
source = "{tasks}"
prompt_template = "Echo: {{text}}"
heldout_fraction = 0.25

[[reward.components]]
function = "{reward}:vowels"

[[reward.components]]
function = "{reward}:short"
weight = 0.5

[algorithm]
preset = "dapo"
max_sampling_rounds = 2

[sampling]
max_completion_length = 12

[optim]
learning_rate = 0.01
micro_batch_size = 3

[train]
group_size = 4
tasks_per_step = 2

[log]
save_every = 2
val_every = 2
val_size = 4
tensorboard = false
'''
    path = tmp_path / "config.toml"
    path.write_text(body)
    return path


class FakeRollouts:
    """A rollouts backend for an ``AsyncPipeline`` whose ``produce`` makes the batches itself."""

    def __init__(self):
        self.version = None
        self.applied = []

    def snapshot(self):
        return {"marker": 1}

    def apply(self, version, state):
        self.applied.append(version)
        self.version = version

    def close(self):
        pass
