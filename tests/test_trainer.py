"""train_step on hand-made groups with the tiny model."""

import math

import pytest
import torch

from grooves import algorithms
from grooves.policy import Sampling
from grooves.training.config import OptimConfig
from grooves.training.step import lr_factor, prepare_batch
from grooves.training.trainer import Trainer
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


@pytest.mark.parametrize("preset", list(algorithms.PRESETS))
def test_every_preset_raises_the_best_completion(preset):
    from grooves.policy import LoRA, Policy
    from grooves.policy.logprobs import build_token_batch, completion_logprobs

    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    groups = sampled_groups(policy, [[1.0, 0.0, 0.0, 0.0]])
    best = build_token_batch([groups[0].trajectories[0]])

    def best_logprob():
        with torch.no_grad():
            return completion_logprobs(policy.causal_lm, best)[0].sum().item()

    before = best_logprob()
    trainer = Trainer(policy, algorithms.preset(preset, dynamic_sampling=False), OptimConfig(learning_rate=1e-2),
                      max_completion_length=8)
    metrics = trainer.train_step(groups)
    assert best_logprob() > before
    assert math.isfinite(metrics["loss/policy"]) and metrics["train/grad_norm"] > 0


@pytest.mark.parametrize("preset", ["grpo", "gspo", "cispo"])
def test_a_second_pass_is_off_policy_and_clips(tiny_policy, preset):
    """With two passes the second sees a moved policy: the ratio leaves 1 and the clip bites."""
    trainer = Trainer(tiny_policy, algorithms.preset(preset, num_iterations=2, eps_low=0.01, eps_high=0.01),
                      OptimConfig(learning_rate=5e-2), max_completion_length=8)
    metrics = trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]]))
    assert metrics["train/approx_kl"] > 0 and metrics["clipfrac"] > 0


def test_kl_penalty_holds_the_policy_near_the_base_model():
    from grooves.policy import LoRA, Policy
    from grooves.policy.logprobs import build_token_batch, completion_logprobs

    def drift(beta):
        policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
        groups = sampled_groups(policy, [[1.0, 0.0, 0.5, 0.2]])
        trainer = Trainer(policy, algorithms.ppo(beta=beta, num_iterations=4), OptimConfig(learning_rate=5e-2),
                          max_completion_length=8)
        trainer.train_step(groups)
        batch = build_token_batch(groups[0].trajectories)
        with torch.no_grad():
            logp, _ = completion_logprobs(policy.causal_lm, batch)
            with policy.reference():
                ref, _ = completion_logprobs(policy.causal_lm, batch)
        return (algorithms.k3_kl(logp, ref) * batch.mask).sum().item() / batch.mask.sum().item()

    free, held = drift(0.0), drift(5.0)
    assert 0 < held < free


def test_all_equal_rewards_give_no_update_even_with_adam_momentum(tiny_policy):
    trainer = Trainer(tiny_policy, algorithms.grpo(), OptimConfig(learning_rate=1e-2), max_completion_length=8)
    trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]]))  # builds AdamW momentum
    before = adapter_state(tiny_policy)
    metrics = trainer.train_step(sampled_groups(tiny_policy, [[0.5, 0.5, 0.5, 0.5]], seed=1))
    after = adapter_state(tiny_policy)
    assert metrics["train/skipped"] == 1.0
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_nan_in_a_later_pass_undoes_the_earlier_passes(tiny_policy):
    trainer = Trainer(tiny_policy, algorithms.ppo(), OptimConfig(learning_rate=1e-2), max_completion_length=8)
    trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]]))  # optimizer state exists
    before = adapter_state(tiny_policy)
    optimizer_before = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    stepped = []
    handle = trainer.optimizer.register_step_post_hook(lambda opt, args, kwargs: stepped.append(1))
    layer = tiny_policy.causal_lm.get_decoder().layers[0]
    # fault injection: NaN only after the first pass's optimizer step
    hook = layer.register_forward_hook(lambda m, i, o: o * float("nan") if m.training and stepped else o)
    try:
        metrics = trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.3, 0.2]], seed=2))
    finally:
        hook.remove()
        handle.remove()
    assert stepped and metrics["alerts/nan_loss"] == 1.0
    after = adapter_state(tiny_policy)
    assert all(torch.equal(before[n], after[n]) for n in before)
    for key, value in trainer.optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, optimizer_before[key]), key


def test_kl_to_the_base_model_is_logged_without_a_penalty(tiny_policy):
    trainer = Trainer(tiny_policy, algorithms.grpo(), OptimConfig(learning_rate=5e-2), max_completion_length=8,
                      kl_every=1)
    first = trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]]))
    second = trainer.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]], seed=1))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # a fresh LoRA is the base model
    assert second["kl"] > 0
    default = Trainer(tiny_policy, algorithms.grpo(), OptimConfig(), max_completion_length=8)  # every 10 steps
    logged = ["kl" in default.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]], seed=k))
              for k in range(11)]
    assert logged == [True] + [False] * 9 + [True]
    quiet = Trainer(tiny_policy, algorithms.grpo(), OptimConfig(), max_completion_length=8, kl_every=0)
    assert "kl" not in quiet.train_step(sampled_groups(tiny_policy, [[1.0, 0.0, 0.5, 0.2]]))


def test_kl_to_a_pinned_adapter_holds_rl_near_its_warm_start():
    """``algorithm.reference = 'adapter'``: the KL term compares with the adapter RL started from
    (an SFT run's), not with the base model, which a warm start is already far from."""
    from grooves.policy import LoRA, Policy
    from grooves.policy.logprobs import build_token_batch, completion_logprobs

    def warm_start():
        policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
        with torch.no_grad():  # a trained adapter: away from the base model
            for name, param in policy.model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(7)) * 0.3)
        return policy

    def mean_kl(policy, batch, ref):
        with torch.no_grad():
            logp, _ = completion_logprobs(policy.causal_lm, batch)
        return (algorithms.k3_kl(logp, ref) * batch.mask).sum().item() / batch.mask.sum().item()

    def run(beta):
        policy = warm_start()
        policy.pin_reference()
        groups = sampled_groups(policy, [[1.0, 0.0, 0.5, 0.2]])
        batch = build_token_batch(groups[0].trajectories)
        with torch.no_grad():
            start, _ = completion_logprobs(policy.causal_lm, batch)
        trainer = Trainer(policy, algorithms.ppo(beta=beta, num_iterations=4), OptimConfig(learning_rate=5e-2),
                          max_completion_length=8, kl_every=1)
        metrics = trainer.train_step(groups)
        with torch.no_grad(), policy.reference():  # the pinned adapter, and the live one back after
            pinned, _ = completion_logprobs(policy.causal_lm, batch)
        assert torch.allclose(pinned, start, atol=1e-6)
        return metrics, mean_kl(policy, batch, start)

    (free_metrics, free), (_, held) = run(0.0), run(5.0)
    assert free_metrics["kl"] == pytest.approx(0.0, abs=1e-7)  # logged before the update: at its reference
    assert 0 < held < free
    base = warm_start()  # the same adapter unpinned: its reference is the base model, away from it
    groups = sampled_groups(base, [[1.0, 0.0, 0.5, 0.2]])
    far = Trainer(base, algorithms.grpo(), OptimConfig(), max_completion_length=8, kl_every=1).train_step(groups)
    assert far["kl"] > 0.01


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
