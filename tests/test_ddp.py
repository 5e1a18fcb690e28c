"""DDP (issue 16, part 4): two gloo processes on 127.0.0.1, each training on its shard of the
same global batch, give the 1-process LoRA update within 1e-5, for every loss normalisation
(per sequence then token, per token, Dr. GRPO's constant) and with mini-batches and the
importance-sampling correction on.

The two ranks are real processes started as ``torchrun`` starts them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``); each runs this file as a script.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from grooves import algorithms
from grooves.policy import LoRA, Policy
from grooves.training.config import OptimConfig
from grooves.training.trainer import Trainer
from grooves.types import Group, Trajectory

# name -> (algorithm, optim, trainer options); each runs two train_steps on the fixed groups
CASES = {
    "grpo_seq_token_mean_kl": (algorithms.grpo(), OptimConfig(learning_rate=1e-2, micro_batch_size=3),
                               {"kl_every": 1}),
    "dr_grpo_constant": (algorithms.dr_grpo(), OptimConfig(learning_rate=1e-2), {}),
    "dapo_token_mean_minibatches_is": (algorithms.dapo(dynamic_sampling=False, mask_truncated=True),
                                       OptimConfig(learning_rate=1e-2),
                                       {"minibatches": 2, "use_sampler_logprobs": True}),
}


def fixed_groups(step: int) -> list[Group]:
    """Three groups of four hand-made trajectories of different lengths (one env token, one truncated)."""
    gen = torch.Generator().manual_seed(300 + step)
    groups = []
    for g, rewards in enumerate(([1.0, 0.0, 0.5, 0.2], [0.0, 1.0, 0.3, 0.9], [0.4, 0.4, 1.0, 0.0])):
        prompt = torch.randint(3, 200, (5 + g,), generator=gen).tolist()
        trajectories = []
        for i, reward in enumerate(rewards):
            n = 2 + (i + g) % 4
            mask = [1] * n
            if i == 2:
                mask[1] = 0
            trajectories.append(Trajectory([], prompt, torch.randint(3, 200, (n,), generator=gen).tolist(), mask,
                                           (-torch.rand(n, generator=gen) * 2 - 4).tolist(), reward=reward,
                                           finish_reason="length" if (g, i) == (0, 3) else "stop"))
        groups.append(Group({"id": str(g)}, trajectories))
    return groups


def fresh_policy() -> Policy:
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    with torch.no_grad():  # a non-zero B so that every LoRA matrix gets a gradient
        for param_name, param in policy.model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return policy


def initial_adapter() -> list[torch.Tensor]:
    return [p.detach().clone() for p in fresh_policy().trainable_parameters()]


def run_case(name: str, world=None) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    alg, optim, options = CASES[name]
    policy = fresh_policy()
    trainer = Trainer(policy, alg, optim, max_completion_length=6, total_steps=2, world=world, **options)
    metrics = [trainer.train_step(fixed_groups(step)) for step in range(2)]
    return [p.detach().clone() for p in policy.trainable_parameters()], metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_give_the_one_process_update(tmp_path):
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, str(tmp_path / f"rank{rank}.pt")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, output
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name in CASES:
        want_adapter, want_metrics = run_case(name)
        for got in ranks:
            adapter, metrics = got[name]
            for a, b in zip(adapter, want_adapter):
                assert torch.allclose(a, b, atol=1e-5, rtol=0), name
            for step_got, step_want in zip(metrics, want_metrics):
                for key in ("loss/policy", "clipfrac", "train/approx_kl", "train/grad_norm"):
                    assert abs(step_got[key] - step_want[key]) <= 1e-5 + 1e-4 * abs(step_want[key]), (name, key)
        assert any(not torch.equal(a, b) for a, b in zip(want_adapter, initial_adapter())), name  # it moved


if __name__ == "__main__":  # one rank of the test above
    from grooves.training.ddp import init_from_env

    world = init_from_env("gloo")
    assert world is not None and world.size == 2
    torch.save({name: run_case(name, world) for name in CASES}, sys.argv[1])
