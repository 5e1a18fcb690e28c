"""DDP (issue 16, part 4): two gloo processes on 127.0.0.1, each training on its shard of the
same global batch, give the 1-process LoRA update within 1e-5, for every loss normalisation
(per sequence then token, per token, Dr. GRPO's constant) and with mini-batches and the
importance-sampling correction on.

The two ranks are real processes started as ``torchrun`` starts them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``); each runs this file as a script.

The model runs in float64. In float32 the gradient summed over two shards rounds differently from
the whole batch's, and four AdamW steps at lr 1e-2 carried that to 1.3e-5 on an AVX2-only CPU
(under 1e-5 on an AVX-512 one). A mistake in the sharding or the normalisation moves the update
by far more than float64 rounding can.
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
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0, dtype=torch.float64)  # see the module doc
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


def test_grooves_train_under_torchrun_trains_like_one_process(tmp_path):
    # `torchrun --nproc_per_node 2 -m grooves.cli train CONFIG`, started by hand: rank 0 samples, scores,
    # logs and saves; rank 1 trains on its shard and writes nothing (its runs root stays absent).
    import json

    from helpers import tiny_config

    config = tiny_config(tmp_path, steps=2)
    # LoRA dropout draws its masks per process: with it the ranks agree with 1 process in expectation only
    config.write_text(config.read_text().replace("dropout = 0.1", "dropout = 0.0"))
    assert "dropout = 0.0" in config.read_text()
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GROOVES_RUNS": str(tmp_path / f"runs{rank}")}
        procs.append(subprocess.Popen([sys.executable, "-m", "grooves.cli", "train", str(config), "--quiet"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    single = subprocess.run([sys.executable, "-m", "grooves.cli", "train", str(config), "--quiet"],
                            env={**os.environ, "GROOVES_RUNS": str(tmp_path / "single")}, capture_output=True,
                            text=True, timeout=900)
    assert single.returncode == 0, single.stdout + single.stderr
    for proc in procs:
        output, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, output
    assert not (tmp_path / "runs1").exists()

    def rows(root):
        lines = (root / "tiny-run" / "metrics.jsonl").read_text().splitlines()
        return {row["step"]: row for row in map(json.loads, lines) if row.get("step", 0) >= 1}

    ddp_rows, one_rows = rows(tmp_path / "runs0"), rows(tmp_path / "single")
    first = ddp_rows[1], one_rows[1]  # the same samples (same seed, same adapter), so the same update
    assert first[0]["reward/total"] == first[1]["reward/total"]
    for key in ("loss/policy", "train/grad_norm"):  # absent on both when the step had nothing to learn
        got, want = first[0].get(key), first[1].get(key)
        assert (got is None) == (want is None), key
        assert got is None or abs(got - want) <= 1e-5 + 1e-4 * abs(want), key
    assert sorted(ddp_rows) == sorted(one_rows) == [1, 2]


if __name__ == "__main__":  # one rank of the test above
    from grooves.training.ddp import init_from_env

    world = init_from_env("gloo")
    assert world is not None and world.size == 2
    torch.save({name: run_case(name, world) for name in CASES}, sys.argv[1])
