"""Trainer primitives: forward_backward / optim_step / publish, and train_step on top of them.

``tests/data/train_step_reference_float64.pt`` holds adapters and metrics that ``train_step``
produced *before* it was rebuilt on the primitives (made by ``make_reference`` below on that code,
commit 38cb918), so the rebuilt path is held to the old one within 1e-6.

The reference model runs in float64. A float32 reference (``train_step_reference.pt``, made on a
CPU with AVX-512) did not carry to another CPU: on an AVX2-only AMD EPYC, the same code's float32
rounding differed, and through two AdamW steps at lr 1e-2 (and PPO's clip) the adapters came out
up to 3e-4 apart. In float64 the two paths' rounding stays far below the tolerance on any CPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from grooves import algorithms
from grooves.policy import LoRA, Policy
from grooves.policy.logprobs import TokenBatch, build_token_batch, completion_logprobs
from grooves.training.config import OptimConfig
from grooves.training.trainer import Trainer
from grooves.types import Group, Trajectory

REFERENCE = Path(__file__).parent / "data" / "train_step_reference_float64.pt"

# name -> (algorithm, optim, trainer options); each runs two train_steps on the fixed groups
CASES = {
    "grpo_micro_kl_logged": (algorithms.grpo(), OptimConfig(learning_rate=1e-2, micro_batch_size=3),
                             {"kl_every": 1}),
    "ppo_two_passes_kl_penalty": (algorithms.ppo(beta=0.1), OptimConfig(learning_rate=1e-2, max_grad_norm=0.5),
                                  {}),
    # the reference predates the off-policy correction: "off" is the behaviour it recorded
    "gspo_sampler_logprobs": (algorithms.gspo(is_correction="off"), OptimConfig(learning_rate=1e-2, weight_decay=0.1),
                              {"use_sampler_logprobs": True}),
    "cispo_truncated_plain_path": (algorithms.cispo(mask_truncated=True, is_correction="off"), OptimConfig(learning_rate=1e-2),
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


def fresh_policy(dtype: torch.dtype = torch.float32) -> Policy:
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0, dtype=dtype)
    with torch.no_grad():  # a non-zero B so that every LoRA matrix gets a gradient
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return policy


def run_case(name: str) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    alg, optim, options = CASES[name]
    policy = fresh_policy(torch.float64)  # see the module doc
    trainer = Trainer(policy, alg, optim, max_completion_length=6, total_steps=2, **options)
    metrics = [trainer.train_step(fixed_groups(step)) for step in range(2)]
    adapter = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    return adapter, metrics


def make_reference() -> None:
    """Was run on the code before the refactor (commit 38cb918, its own test file with a float64
    ``fresh_policy``): ``python -c 'import tests.test_trainer_primitives as t; t.make_reference()'``."""
    torch.save({name: run_case(name) for name in CASES}, REFERENCE)


@pytest.mark.parametrize("name", list(CASES))
def test_train_step_matches_the_path_before_the_primitives(name, monkeypatch):
    # The reference pins the rebuild on the primitives. Trimming the padding after the last
    # trained token came later: it changes matmul shapes, so rounding (1.2e-6 in one case);
    # the tests below hold it to the untrimmed path.
    monkeypatch.setattr(TokenBatch, "trimmed", lambda self: self)
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


def test_trimming_after_the_last_trained_token_keeps_logprobs_and_gradients():
    policy = fresh_policy()
    trajectories = [t for g in fixed_groups(0) for t in g.trajectories]
    for t in trajectories[:3]:  # a tail of env text: never trained, so never needed
        t.completion_ids, t.completion_mask = t.completion_ids + [7] * 9, t.completion_mask + [0] * 9
        t.logprobs = t.logprobs + [0.0] * 9
    batch = build_token_batch(trajectories)
    trimmed = batch.trimmed()
    assert trimmed.targets.shape[1] < batch.targets.shape[1] and trimmed.input_ids.shape[1] < batch.input_ids.shape[1]
    results = []
    for tokens in (batch, trimmed):
        policy.model.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(policy.causal_lm, tokens)
        (logp * tokens.mask).sum().backward()
        results.append((logp, grads(policy)))
    (full, full_grads), (cut, cut_grads) = results
    width = cut.shape[1]
    torch.testing.assert_close(cut, full[:, :width], atol=1e-5, rtol=0)
    assert not full[:, width:].any()  # nothing trained was cut
    for name, grad in full_grads.items():
        torch.testing.assert_close(cut_grads[name], grad, atol=1e-5, rtol=0)


def test_rows_without_an_advantage_are_not_run_and_the_update_is_the_same(monkeypatch):
    groups = fixed_groups(0)
    for t in groups[0].trajectories:
        t.reward = 1.0  # one group without a signal: all four advantages are 0
    rows_run = []
    original = Trainer._logprobs

    def counting(self, micro, *args, **kwargs):
        rows_run.append(len(micro))
        return original(self, micro, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_logprobs", counting)
    adapters = {}
    for kl_every in (0, 1):  # logging the KL needs every row, so every row runs
        rows_run.clear()
        policy = fresh_policy()
        trainer = Trainer(policy, algorithms.grpo(), OptimConfig(learning_rate=1e-2), max_completion_length=6,
                          total_steps=1, kl_every=kl_every)
        trainer.train_step([Group(g.task, list(g.trajectories)) for g in groups])
        adapters[kl_every] = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        trained_rows = sum(rows_run[-2:]) if kl_every else sum(rows_run)
        assert trained_rows == (8 if kl_every else 4), rows_run
    for name, value in adapters[1].items():
        torch.testing.assert_close(adapters[0][name], value, atol=1e-6, rtol=0)


def fresh_policy_state() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in fresh_policy(torch.float64).model.named_parameters() if p.requires_grad}


# --- the primitives ----------------------------------------------------------------

from grooves.algorithms.losses import cross_entropy, importance_sampling  # noqa: E402
from grooves.training.datums import AdamParams, Datum, LossConfig  # noqa: E402


def tinker_datum(seed: int, prompt: int = 4, completion: int = 5) -> Datum:
    """A datum as the cookbook builds one: the sequence shifted by one, loss inputs 0 on the prompt."""
    gen = torch.Generator().manual_seed(seed)
    sequence = torch.randint(3, 200, (prompt + completion,), generator=gen).tolist()
    n = len(sequence) - 1
    on = [0.0] * (prompt - 1) + [1.0] * completion
    advantage = float(torch.randn(1, generator=gen))
    logprobs = [0.0] * (prompt - 1) + (-torch.rand(completion, generator=gen) - 5).tolist()
    return Datum(sequence[:-1], sequence[1:], weights=on, logprobs=logprobs,
                 advantages=[advantage * w for w in on])


def direct_logprobs(policy, datum: Datum) -> torch.Tensor:
    """Every position's log-prob of its target, from the full logits (no grooves fast path)."""
    logits = policy.causal_lm(input_ids=torch.tensor([datum.tokens])).logits[0].float()  # (N, V)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(datum.target_tokens)[:, None]).squeeze(-1)


def grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo"])
def test_forward_backward_gradient_is_the_summed_loss_of_grooves_functions(loss_fn):
    from grooves.algorithms.losses import TINKER_LOSSES

    datums = [tinker_datum(1), tinker_datum(2, prompt=3, completion=7)]
    policy = fresh_policy()
    trainer = Trainer(policy, algorithms.grpo(), OptimConfig())
    out = trainer.forward_backward(datums, loss_fn)
    got = grads(policy)

    policy.model.zero_grad(set_to_none=True)
    loss, eps_low, eps_high = TINKER_LOSSES[loss_fn]
    total = 0.0
    for d in datums:
        logp = direct_logprobs(policy, d)[None]  # (1, N)
        old, adv, w = (torch.tensor([v]) for v in (d.logprobs, d.advantages, d.weights))
        total = total + (loss(logp, old, adv, (w > 0).float(), eps_low, eps_high).per_token * w).sum()
    total.backward()
    assert out.loss == pytest.approx(total.item(), rel=1e-5)
    for name, value in grads(policy).items():
        assert torch.allclose(got[name], value, atol=1e-6, rtol=1e-4), name
    assert [len(lp) for lp in out.logprobs] == [len(d.tokens) for d in datums]  # start 0: every position
    assert out.metrics()["loss:sum"] == out.loss


def test_gradients_accumulate_across_calls():
    datums = [tinker_datum(1), tinker_datum(2)]
    one = fresh_policy()
    Trainer(one, algorithms.grpo(), OptimConfig()).forward_backward(datums, "importance_sampling")
    two = fresh_policy()
    trainer = Trainer(two, algorithms.grpo(), OptimConfig())
    first = trainer.forward_backward(datums[:1], "importance_sampling").loss
    second = trainer.forward_backward(datums[1:], "importance_sampling").loss
    together, apart = grads(one), grads(two)
    for name in together:
        assert torch.allclose(together[name], apart[name], atol=1e-7), name
    assert first != 0 and second != 0


def test_cross_entropy_and_importance_sampling_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.0, -1.0, -0.5]])
    adv = torch.tensor([[0.0, 2.0, -1.0]])  # per token
    mask = torch.ones(1, 3)
    assert cross_entropy(logp, old, adv, mask).per_token.tolist() == [[1.0, 2.0, 0.5]]
    # -exp(logp - old) * A: 0, -2 e^-1, +1
    assert importance_sampling(logp, old, adv, mask).per_token[0].tolist() == pytest.approx(
        [0.0, -2 * math.exp(-1), 1.0])


def test_optim_step_clips_applies_adam_and_clears_the_gradient():
    policy = fresh_policy()
    trainer = Trainer(policy, algorithms.grpo(), OptimConfig())
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    trainer.forward_backward([tinker_datum(1)], "cross_entropy")
    norm = trainer.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=1e-3))
    assert norm > 1e-3  # the norm before clipping
    moved = [(p.detach() - before[n]).abs().max().item() for n, p in policy.model.named_parameters()
             if p.requires_grad]
    # Adam's first step moves every parameter with a gradient by about lr, whatever the clip
    assert max(moved) == pytest.approx(1e-3, rel=1e-2)
    assert all(p.grad is None for p in policy.model.parameters() if p.requires_grad)


def test_a_few_cross_entropy_steps_lower_the_loss():
    policy = fresh_policy()
    trainer = Trainer(policy, algorithms.grpo(), OptimConfig())
    datum = tinker_datum(3)
    losses = []
    for _ in range(4):
        losses.append(trainer.forward_backward([datum], "cross_entropy").loss)
        trainer.optim_step(AdamParams(learning_rate=1e-2))
    assert losses[-1] < losses[0]


def test_nonfinite_gradient_takes_no_step():
    policy = fresh_policy()
    trainer = Trainer(policy, algorithms.grpo(), OptimConfig())
    trainer.forward_backward([tinker_datum(1)], "cross_entropy")
    next(p for p in policy.model.parameters() if p.requires_grad).grad[0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainer.optim_step(AdamParams()) is None
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("datum, message", [
    (Datum([1, 2, 3], [2, 3]), "as many target_tokens"),
    (Datum([1, 2, 3], [2, 3, 4], weights=[1.0]), "weights has 1 values for 3 positions"),
    (Datum([1, 2, 3], [2, 3, 4], start=3), "start 3 is outside"),
    (Datum([], []), "needs tokens"),
])
def test_malformed_datums_are_refused_with_the_reason(datum, message):
    trainer = Trainer(fresh_policy(), algorithms.grpo(), OptimConfig())
    with pytest.raises(ValueError, match=message):
        trainer.forward_backward([datum], "cross_entropy")


def test_unknown_loss_names_the_known_ones():
    trainer = Trainer(fresh_policy(), algorithms.grpo(), OptimConfig())
    with pytest.raises(ValueError, match="available: .*importance_sampling"):
        trainer.forward_backward([tinker_datum(1)], "dpo")


def test_publish_makes_the_adapter_sampleable_by_name(tmp_path):
    policy = fresh_policy()
    trainer = Trainer(policy, algorithms.grpo(), OptimConfig())
    trainer.forward_backward([tinker_datum(1)], "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    trainer.step = 3
    name = trainer.publish(tmp_path / "runs" / "mine")
    assert name == "mine@3"
    served = Policy.load(name, runs=tmp_path / "runs")
    datum = tinker_datum(1)
    with torch.no_grad():
        assert torch.allclose(direct_logprobs(served, datum), direct_logprobs(policy, datum), atol=1e-6)
