"""train_step on hand-made groups with the tiny model."""

import math

import pytest
import torch

from grooves import algorithms
from grooves.policy import Sampling
from grooves.training.config import OptimConfig
from grooves.training.trainer import Trainer, lr_factor, prepare_batch
from grooves.types import Group, Trajectory


def sampled_groups(policy, rewards_per_group, max_new_tokens=8, seed=0):
    prompts = [f"task {i}" for i in range(len(rewards_per_group))]
    results = policy.sampler().generate(prompts, n=len(rewards_per_group[0]),
                                        sampling=Sampling(max_new_tokens=max_new_tokens, seed=seed))
    groups = []
    for i, (samples, rewards) in enumerate(zip(results, rewards_per_group)):
        groups.append(Group({"id": str(i)}, [
            Trajectory(messages=[], prompt_ids=c.prompt_ids, completion_ids=c.token_ids,
                       completion_mask=[1] * len(c.token_ids), logprobs=c.logprobs, finish_reason=c.finish_reason,
                       reward=r) for c, r in zip(samples, rewards)]))
    return groups


def adapter_state(policy):
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def test_prepare_batch_drops_failed_rewards_and_thin_groups():
    def traj(reward):
        return Trajectory(messages=[], prompt_ids=[1], completion_ids=[2, 3], completion_mask=[1, 1],
                          logprobs=[0.0, 0.0], reward=reward)

    groups = [Group({"id": "a"}, [traj(1.0), traj(math.nan), traj(0.0)]),  # one failed: 2 remain
              Group({"id": "b"}, [traj(1.0), traj(math.nan)])]  # 1 remains: the group is skipped
    prepared = prepare_batch(groups, algorithms.grpo(), 16)
    assert len(prepared.trajectories) == 2
    assert prepared.metrics["train/trajectories_unscored"] == 2
    assert prepared.metrics["train/groups_skipped"] == 1
    # advantages over the two scored ones: (1 - 0.5)/(std 0.7071 + 1e-4)
    assert prepared.advantages.tolist() == pytest.approx([0.7070, -0.7070], abs=1e-3)


def test_prepare_batch_overlong_shaping():
    trajectories = [Trajectory(messages=[], prompt_ids=[1], completion_ids=[2] * n, completion_mask=[1] * n,
                               logprobs=[0.0] * n, reward=1.0) for n in (4, 8)]
    prepared = prepare_batch([Group({"id": "a"}, trajectories)], algorithms.dr_grpo(overlong_buffer=0.5), 8)
    # buffer = 4 tokens from 4 to 8: length 4 -> 0, length 8 -> -1; rewards 1, 0 -> advantages +0.5, -0.5
    assert prepared.advantages.tolist() == pytest.approx([0.5, -0.5])


def test_a_step_moves_the_adapter_toward_higher_reward(tiny_policy):
    trainer = Trainer(tiny_policy, algorithms.grpo(), OptimConfig(learning_rate=1e-2), max_completion_length=8)
    groups = sampled_groups(tiny_policy, [[1.0, 0.0, 0.0, 0.0]])
    best = groups[0].trajectories[0]
    from grooves.policy.logprobs import build_token_batch, completion_logprobs

    def best_logprob():
        with torch.no_grad():
            return completion_logprobs(tiny_policy.causal_lm, build_token_batch([best]))[0].sum().item()

    before = best_logprob()
    metrics = trainer.train_step(groups)
    assert best_logprob() > before
    assert metrics["clipfrac"] == 0.0 and metrics["train/approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["entropy"] > 0 and metrics["train/grad_norm"] > 0
    assert trainer.step == 1


@pytest.mark.parametrize("share_prompt", [True, False])
def test_micro_batches_give_the_full_batch_gradient(share_prompt):
    from grooves.policy import LoRA, Policy

    def run(micro):
        policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        groups = sampled_groups(policy, [[1.0, 0.2, 0.0, 0.5], [0.0, 1.0, 0.3, 0.9]])
        trainer = Trainer(policy, algorithms.dapo(), OptimConfig(micro_batch_size=micro, max_grad_norm=1e9),
                          max_completion_length=8, share_prompt=share_prompt)
        metrics = trainer.train_step(groups)
        return metrics, adapter_state(policy)

    (m_full, w_full), (m_micro, w_micro) = run(8), run(3)
    assert m_micro["train/grad_norm"] == pytest.approx(m_full["train/grad_norm"], rel=1e-4)
    for name in w_full:
        assert torch.allclose(w_full[name], w_micro[name], atol=1e-6)


def test_nan_loss_skips_the_step_and_keeps_the_adapter(tiny_policy):
    trainer = Trainer(tiny_policy, algorithms.grpo(), OptimConfig(), max_completion_length=8)
    groups = sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]])
    before = adapter_state(tiny_policy)
    layer = tiny_policy.causal_lm.get_decoder().layers[0]
    # fault injection: the first decoder layer returns NaN while training
    hook = layer.register_forward_hook(lambda m, i, o: o * float("nan") if m.training else o)
    try:
        metrics = trainer.train_step(groups)
    finally:
        hook.remove()
    assert metrics["alerts/nan_loss"] == 1.0 and metrics["train/skipped"] == 1.0
    after = adapter_state(tiny_policy)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert trainer.step == 1
    assert "alerts/nan_loss" not in trainer.train_step(groups)  # the next step trains normally


@pytest.mark.parametrize("preset", ["gspo", "cispo", "rloo", "dr_grpo"])
def test_every_preset_trains(tiny_policy, preset):
    trainer = Trainer(tiny_policy, algorithms.preset(preset), OptimConfig(), max_completion_length=8)
    metrics = trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]]))
    assert math.isfinite(metrics["loss/policy"]) and metrics["train/grad_norm"] > 0


def test_kl_penalty_and_multiple_iterations(tiny_policy):
    trainer = Trainer(tiny_policy, algorithms.ppo(beta=0.1), OptimConfig(learning_rate=5e-2),
                      max_completion_length=8)
    metrics = trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]]))
    # the first pass starts at the reference (KL 0); the second pass has moved away
    assert metrics["kl"] > 0 and metrics["train/approx_kl"] > 0


def test_all_equal_rewards_give_no_update(tiny_policy):
    trainer = Trainer(tiny_policy, algorithms.grpo(), OptimConfig(), max_completion_length=8)
    before = adapter_state(tiny_policy)
    trainer.train_step(sampled_groups(tiny_policy, [[0.5, 0.5, 0.5, 0.5]]))
    after = adapter_state(tiny_policy)
    assert all(torch.allclose(before[n], after[n]) for n in before)  # advantages are all zero


def test_training_needs_an_adapter():
    from grooves.policy import Policy

    with pytest.raises(ValueError, match="LoRA adapter"):
        Trainer(Policy.load("tiny"), algorithms.grpo(), OptimConfig())


def test_lr_schedules():
    assert lr_factor(0, 2, 10, "constant") == 0.5 and lr_factor(1, 2, 10, "constant") == 1.0
    assert lr_factor(2, 2, 10, "linear") == 1.0 and lr_factor(6, 2, 10, "linear") == 0.5
    assert lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(10, 0, 10, "cosine") == pytest.approx(0.0)


def test_gradient_checkpointing_gives_the_same_update():
    from grooves.policy import LoRA, Policy

    def run(checkpointing):
        policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
        if checkpointing:
            policy.causal_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        groups = sampled_groups(policy, [[1.0, 0.0, 0.5, 0.2]])
        Trainer(policy, algorithms.grpo(), OptimConfig(learning_rate=1e-2), max_completion_length=8).train_step(groups)
        return adapter_state(policy)

    plain, checkpointed = run(False), run(True)
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6)
