"""Trainer primitives: forward_backward / optim_step / publish, and train_step on top of them.

``tests/data/train_step_reference.pt`` holds adapters and metrics that ``train_step`` produced
*before* it was rebuilt on the primitives (made by ``make_reference`` below on that code), so the
rebuilt path is held to the old one within 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grooves import algorithms
from grooves.policy import LoRA, Policy
from grooves.training.config import OptimConfig
from grooves.training.trainer import Trainer
from grooves.types import Group, Trajectory

REFERENCE = Path(__file__).parent / "data" / "train_step_reference.pt"

# name -> (algorithm, optim, trainer options); each runs two train_steps on the fixed groups
CASES = {
    "grpo_micro_kl_logged": (algorithms.grpo(), OptimConfig(learning_rate=1e-2, micro_batch_size=3),
                             {"kl_every": 1}),
    "ppo_two_passes_kl_penalty": (algorithms.ppo(beta=0.1), OptimConfig(learning_rate=1e-2, max_grad_norm=0.5),
                                  {}),
    "gspo_sampler_logprobs": (algorithms.gspo(), OptimConfig(learning_rate=1e-2, weight_decay=0.1),
                              {"use_sampler_logprobs": True}),
    "cispo_truncated_plain_path": (algorithms.cispo(mask_truncated=True), OptimConfig(learning_rate=1e-2),
                                   {"share_prompt": False, "use_sampler_logprobs": True}),
    "dr_grpo_overlong": (algorithms.dr_grpo(overlong_buffer=0.5), OptimConfig(learning_rate=1e-2), {}),
}


def fixed_groups(step: int) -> list[Group]:
    """Two groups of four hand-made trajectories (token ids and sampler logprobs from a seed)."""
    gen = torch.Generator().manual_seed(100 + step)
    groups = []
    for g, rewards in enumerate(([1.0, 0.0, 0.5, 0.2], [0.0, 1.0, 0.3, 0.9])):
        prompt = torch.randint(3, 200, (5 + g,), generator=gen).tolist()
        trajectories = []
        for i, reward in enumerate(rewards):
            n = 3 + (i + g) % 4
            completion = torch.randint(3, 200, (n,), generator=gen).tolist()
            mask = [1] * n
            if i == 2:
                mask[1] = 0  # an env token inside the completion
            logprobs = (-torch.rand(n, generator=gen) * 3 - 4).tolist()
            trajectories.append(Trajectory(messages=[], prompt_ids=prompt, completion_ids=completion,
                                           completion_mask=mask, logprobs=logprobs, reward=reward,
                                           finish_reason="length" if i == 3 and g == 0 else "stop"))
        groups.append(Group({"id": str(g)}, trajectories))
    return groups


def fresh_policy() -> Policy:
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    with torch.no_grad():  # a non-zero B so that every LoRA matrix gets a gradient
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return policy


def run_case(name: str) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    alg, optim, options = CASES[name]
    policy = fresh_policy()
    trainer = Trainer(policy, alg, optim, max_completion_length=6, total_steps=2, **options)
    metrics = [trainer.train_step(fixed_groups(step)) for step in range(2)]
    adapter = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    return adapter, metrics


def make_reference() -> None:
    """Run on the code before the refactor: ``python -c 'import tests.test_trainer_primitives as t; t.make_reference()'``."""
    torch.save({name: run_case(name) for name in CASES}, REFERENCE)


@pytest.mark.parametrize("name", list(CASES))
def test_train_step_matches_the_path_before_the_primitives(name):
    want_adapter, want_metrics = torch.load(REFERENCE)[name]
    adapter, metrics = run_case(name)
    assert any(not torch.equal(want_adapter[n], fresh) for n, fresh in fresh_policy_state().items())
    for n, value in want_adapter.items():
        assert torch.allclose(adapter[n], value, atol=1e-6, rtol=0), n
    for got, want in zip(metrics, want_metrics):
        for key, value in want.items():
            if "time" in key or "per_s" in key:
                continue
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def fresh_policy_state() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in fresh_policy().model.named_parameters() if p.requires_grad}
