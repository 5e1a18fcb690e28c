"""The update's fast paths give the numbers of the plain ones: the forward through the decode's
packed weights (policy/packed_update.py) and a shared prefix's rows run as one unpadded sequence
(``logprobs._packed_rows``), log-probs, entropies and adapter gradients to 1e-5."""

from __future__ import annotations

import pytest
import torch

import grooves.policy.logprobs as logprobs
import grooves.policy.packed_update as packed_update
from grooves import algorithms
from grooves.policy import LoRA, Policy
from grooves.policy.logprobs import build_token_batch, completion_logprobs, shared_prefix_logprobs
from grooves.policy.packing import _foldable_adapter, packed_linears
from grooves.types import Trajectory


def _policy() -> Policy:
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    with torch.no_grad():  # B = 0 would hide the adapter's part of the forward and of dA
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    _fold(policy)
    return policy


def _fold(policy: Policy) -> None:
    """What a decode does first: fold the adapter into the packed copies."""
    with packed_linears(policy, _foldable_adapter(policy, [])):
        pass


def _batch(policy: Policy):
    """Rows of 5, 9, 3, 12 and 1 tokens after one prompt; one row's prompt goes on 2 tokens
    further, one has untrained positions inside and at its end."""
    generator = torch.Generator().manual_seed(0)
    vocab = policy.causal_lm.config.vocab_size
    prompt = torch.randint(0, vocab, (20,), generator=generator).tolist()
    rows = []
    for i, length in enumerate([5, 9, 3, 12, 1]):
        mask = [1] * length
        if i == 3:
            mask[2], mask[-3:] = 0, [0, 0, 0]
        rows.append(Trajectory(messages=[], prompt_ids=prompt + ([7, 8] if i == 1 else []),
                               completion_ids=torch.randint(0, vocab, (length,), generator=generator).tolist(),
                               completion_mask=mask, logprobs=[0.0] * length))
    return build_token_batch(rows)


def _run(policy, batch, forward, monkeypatch, **flags):
    for module, name, value in flags.values():
        monkeypatch.setattr(module, name, value)
    policy.model.zero_grad(set_to_none=True)
    policy.model.train()
    try:
        with packed_update.packed_update(policy):
            logp, entropy = forward(policy.causal_lm, batch, 0.7, True)
        weights = torch.arange(1, logp.numel() + 1, dtype=logp.dtype).reshape(logp.shape) / 10
        (logp * weights).sum().backward()
    finally:
        policy.model.eval()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy, grads


def _close(a, b):
    logp, entropy, grads = a
    assert torch.allclose(logp, b[0], atol=1e-5, rtol=0)
    assert torch.allclose(entropy, b[1], atol=1e-5, rtol=0)
    assert grads.keys() == b[2].keys() and len(grads) > 0
    for name in grads:
        assert torch.allclose(grads[name], b[2][name], atol=1e-5, rtol=1e-5), name


@pytest.mark.parametrize("forward", [completion_logprobs, shared_prefix_logprobs])
def test_packed_weights_give_the_plain_forward_and_gradient(forward, monkeypatch):
    policy = _policy()
    batch = _batch(policy)
    with packed_update.packed_update(policy):  # the path is taken: the LoRA layers and the head are swapped
        assert any(isinstance(m, packed_update._LoRAForward) for m in policy.causal_lm.modules())
        assert isinstance(policy.causal_lm.get_output_embeddings(), packed_update._FrozenForward)
    assert not any(isinstance(m, (packed_update._LoRAForward, packed_update._FrozenForward))
                   for m in policy.causal_lm.modules())
    plain = _run(policy, batch, forward, monkeypatch, pack=(packed_update, "PACK_UPDATE", False))
    packed = _run(policy, batch, forward, monkeypatch, pack=(packed_update, "PACK_UPDATE", True))
    _close(plain, packed)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_unpadded_rows_give_the_padded_batch(attention, monkeypatch):
    policy = _policy()
    policy.causal_lm.config._attn_implementation = attention
    batch = _batch(policy)
    calls = []
    real = logprobs._packed_rows
    monkeypatch.setattr(logprobs, "_packed_rows", lambda *a: calls.append(real(*a)) or calls[-1])
    off = dict(pack=(packed_update, "PACK_UPDATE", False))
    padded = _run(policy, batch, shared_prefix_logprobs, monkeypatch, rows=(logprobs, "PACK_ROWS", False), **off)
    assert not calls
    unpadded = _run(policy, batch, shared_prefix_logprobs, monkeypatch, rows=(logprobs, "PACK_ROWS", True), **off)
    assert calls and calls[-1] is not None
    _close(padded, unpadded)
    monkeypatch.setattr(logprobs, "PACK_ROWS_MAX", 20)  # a longer sequence pads (its attention would cost more)
    assert _run(policy, batch, shared_prefix_logprobs, monkeypatch, **off)[0].shape == padded[0].shape
    assert calls[-1] is None
    assert torch.allclose(completion_logprobs(policy.causal_lm, batch, 0.7)[0].detach(), unpadded[0], atol=1e-5)


def test_the_trainer_update_is_the_same_with_both(monkeypatch):
    from grooves.training.config import OptimConfig
    from grooves.training.trainer import Trainer
    from test_trainer import sampled_groups

    def step(fast: bool):
        monkeypatch.setattr(packed_update, "PACK_UPDATE", fast)
        monkeypatch.setattr(logprobs, "PACK_ROWS", fast)
        policy = _policy()
        groups = sampled_groups(policy, [[1.0, 0.2, 0.0, 0.5]])
        trainer = Trainer(policy, algorithms.grpo(), OptimConfig(learning_rate=1e-2), max_completion_length=8)
        grads = {}
        step_with = trainer.optim_step

        def optim_step(adam):  # the gradient the step applies (Adam's first step would amplify rounding)
            grads.update({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
            return step_with(adam)

        trainer.optim_step = optim_step
        metrics = trainer.train_step(groups)
        return metrics, grads

    (plain, before), (fast, after) = step(False), step(True)
    assert plain["loss/policy"] == pytest.approx(fast["loss/policy"], abs=1e-5)
    assert plain["train/grad_norm"] == pytest.approx(fast["train/grad_norm"], rel=1e-5)
    assert before.keys() == after.keys() and len(before) > 0
    for name in before:
        assert torch.allclose(before[name], after[name], atol=1e-5, rtol=1e-5), name


def test_a_stale_fold_runs_the_plain_path():
    """After an optimizer step within a step the folds are stale: the plain layers run, and the
    next decode folds again."""
    policy = _policy()
    with torch.no_grad():
        next(p for n, p in policy.model.named_parameters() if "lora_A" in n).add_(0.01)
    with packed_update.packed_update(policy):
        assert not any(isinstance(m, packed_update._LoRAForward) for m in policy.causal_lm.modules())
    _fold(policy)
    with packed_update.packed_update(policy):
        assert any(isinstance(m, packed_update._LoRAForward) for m in policy.causal_lm.modules())


def test_rows_pack_only_where_that_costs_less():
    """SmolLM2-135M's shapes: a group's short and long completions after a short prompt pack (the
    padding was a third of the batch); an SFT micro-batch of agent transcripts of similar length
    after a 942-token system prompt pads, because the packed sequence scores every token against
    every other row's (measured: 36 -> 29 s for the same 8 transcripts' forward and backward)."""
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    assert logprobs._packing_pays(smollm2, 119, [5, 48, 17, 30, 9, 44, 12, 26], 48)
    assert not logprobs._packing_pays(smollm2, 942, [536, 571, 589, 603], 604)
    assert logprobs._packing_pays(smollm2, 942, [40, 60, 80, 600], 604)  # mostly padding: it packs
    assert not logprobs._packing_pays(smollm2, 119, [20, 20, 20, 20], 20)  # no padding to save
