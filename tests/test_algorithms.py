"""Advantages, losses, aggregation and KL against numbers worked out by hand."""

import math

import pytest
import torch

from grooves import algorithms as alg
from grooves.algorithms.advantages import batch_std, group_mean, group_mean_std, leave_one_out, no_baseline
from grooves.algorithms.losses import cispo, constant, gspo, k3_kl, ppo_clip, seq_mean_token_mean, token_mean

def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# Two groups: [1, 2, 3] (mean 2, unbiased std 1) and [0, 4] (mean 2, unbiased std 2.8284).
REWARDS = torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0], dtype=torch.float64)
GROUP = torch.tensor([0, 0, 0, 1, 1])


def test_group_mean():
    assert group_mean(REWARDS, GROUP).tolist() == [-1.0, 0.0, 1.0, -2.0, 2.0]


def test_group_mean_std_uses_unbiased_std_and_eps():
    adv = group_mean_std(REWARDS, GROUP, eps=0.0)
    expected = [-1.0, 0.0, 1.0, -2 / math.sqrt(8), 2 / math.sqrt(8)]
    assert adv.tolist() == pytest.approx(expected)
    # eps keeps a zero-variance group finite (and zero)
    flat = group_mean_std(torch.tensor([5.0, 5.0]), torch.tensor([0, 0]), eps=1e-4)
    assert flat.tolist() == [0.0, 0.0]


def test_leave_one_out():
    # group 0: 1 - (2+3)/2 = -1.5, 2 - 2 = 0, 3 - 1.5 = 1.5 ; group 1: 0 - 4 = -4, 4 - 0 = 4
    assert leave_one_out(REWARDS, GROUP).tolist() == pytest.approx([-1.5, 0.0, 1.5, -4.0, 4.0])


def test_batch_std():
    centred = torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0], dtype=torch.float64)
    std = math.sqrt((1 + 0 + 1 + 4 + 4) / 4)  # unbiased over the 5 centred values (mean 0)
    assert batch_std(REWARDS, GROUP, eps=0.0).tolist() == pytest.approx((centred / std).tolist())


def test_no_baseline_returns_rewards():
    assert no_baseline(REWARDS, GROUP).tolist() == REWARDS.tolist()


# A 2x3 batch: row 0 has 3 tokens, row 1 has 2 (last position is padding).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
NEW = torch.log(torch.tensor([[0.75, 0.5, 0.25], [0.5, 0.7, 0.5]]))  # ratios 1.5, 1, 0.5 / 1, 1.4, 1
ADV = torch.tensor([1.0, -1.0])


def test_ppo_clip_token_values_and_clip_mask():
    out = ppo_clip(NEW, OLD, ADV, MASK, eps_low=0.2, eps_high=0.28)
    # row 0 (A=+1): -min(1.5, 1.28) = -1.28 ; -min(1, 1) = -1 ; -min(0.5, 0.8) = -0.5
    # row 1 (A=-1): -min(-1, -1) = 1 ; -min(-1.4, -1.28) = 1.4 ; padding -min(-1,-1) = 1
    close(out.per_token, [[-1.28, -1.0, -0.5], [1.0, 1.4, 1.0]])
    assert out.clipped.tolist() == [[True, False, False], [False, False, False]]


def test_ppo_clip_gradient_is_zero_where_clipped():
    new = NEW.clone().requires_grad_(True)
    ppo_clip(new, OLD, ADV, MASK, 0.2, 0.28).per_token.sum().backward()
    # d(-A r)/d logp = -A r where unclipped; 0 where the clipped branch is active; 0 on padding
    # (masked positions never enter exp: their log-ratio is a constant 0)
    close(new.grad, [[0.0, -1.0, -0.5], [1.0, 1.4, 0.0]])


def test_gspo_ignores_masked_positions():
    padded = NEW.clone()
    padded[1, 2] = math.log(0.99)  # a padding position with a large log-ratio must not enter s_1
    assert gspo(padded, OLD, ADV, MASK, 0.2, 0.2).per_token[1, :2].tolist() == pytest.approx([math.sqrt(1.4)] * 2)


def test_gspo_sequence_ratio_and_clip():
    out = gspo(NEW, OLD, ADV, MASK, eps_low=0.2, eps_high=0.2)
    # row 0: mean log-ratio = (ln1.5 + 0 + ln0.5)/3 -> s = (0.75)^(1/3) = 0.9086 ; inside the clip range
    s0 = 0.75 ** (1 / 3)
    # row 1: mean over 2 tokens: (0 + ln1.4)/2 -> s = sqrt(1.4) = 1.1832 ; A=-1: -min(-1.1832, -1.1832)
    s1 = math.sqrt(1.4)
    assert out.per_token[0].tolist() == pytest.approx([-s0] * 3, abs=1e-6)
    assert out.per_token[1, :2].tolist() == pytest.approx([s1, s1], abs=1e-6)
    assert not out.clipped.any()
    # Clipping bites only where it lowers the objective: s below 1 - eps with A < 0, above 1 + eps with A > 0.
    assert not gspo(NEW, OLD, ADV, MASK, eps_low=0.05, eps_high=0.05).clipped.any()
    tight = gspo(NEW, OLD, -ADV, MASK, eps_low=0.05, eps_high=0.05)
    assert tight.clipped.tolist() == [[True, True, True], [True, True, False]]
    close(tight.per_token[0], [0.95] * 3)  # A = -1: -min(-0.9086, -0.95)
    close(tight.per_token[1, :2], [-1.05, -1.05])  # A = +1: -min(1.1832, 1.05)


def test_gspo_gradient_equals_sequence_form():
    """GSPO-token with equal advantages has the gradient of the sequence-level objective."""
    new = NEW.clone().requires_grad_(True)
    loss = (gspo(new, OLD, ADV, MASK, 0.9, 10.0).per_token * seq_mean_token_mean(MASK, 3)).sum()
    loss.backward()
    new2 = NEW.clone().requires_grad_(True)
    s = torch.exp(((new2 - OLD) * MASK).sum(-1) / MASK.sum(-1))
    (-(ADV * s).mean()).backward()
    close(new.grad, new2.grad.tolist())


def test_cispo_weight_is_clipped_and_detached():
    new = NEW.clone().requires_grad_(True)
    out = cispo(new, OLD, ADV, MASK, eps_low=1.0, eps_high=0.2)
    # weights: row 0 -> min(1.5, 1.2)=1.2, 1, 0.5 ; row 1 -> 1, min(1.4, 1.2)=1.2, 1
    expected = [[-1.2 * math.log(0.75), -1 * math.log(0.5), -0.5 * math.log(0.25)],
                [1 * math.log(0.5), 1.2 * math.log(0.7), 1 * math.log(0.5)]]
    close(out.per_token, expected)
    assert out.clipped.tolist() == [[True, False, False], [False, True, False]]
    out.per_token.sum().backward()
    # gradient is -w * A (the weight is a constant)
    close(new.grad, [[-1.2, -1.0, -0.5], [1.0, 1.2, 1.0]])


def test_aggregations():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    # token mean: (1+2+3+4+5)/5 = 3
    assert (loss * token_mean(MASK, 4)).sum().item() == pytest.approx(3.0)
    # sequence mean of token means: (2 + 4.5)/2 = 3.25
    assert (loss * seq_mean_token_mean(MASK, 4)).sum().item() == pytest.approx(3.25)
    # constant: 15 / (2 sequences * 4 max tokens) = 1.875
    assert (loss * constant(MASK, 4)).sum().item() == pytest.approx(1.875)


def test_k3_kl():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.25]))
    # exp(ref-logp) - (ref-logp) - 1: 0.5 - ln0.5 - 1 = 0.19315 ; 1 - 0 - 1 = 0
    assert k3_kl(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-6)


def test_overlong_penalty():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    # max 16, buffer 4: start 12 -> 0, 0, (12-14)/4 = -0.5, -1, -1 (clamped)
    assert alg.overlong_penalty(lengths, 16, 4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert alg.overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 5


def test_has_signal():
    assert not alg.has_signal(torch.tensor([1.0, 1.0, 1.0]))
    assert alg.has_signal(torch.tensor([1.0, 0.0]))
    assert not alg.has_signal(torch.tensor([1.0]))


@pytest.mark.parametrize("name", list(alg.PRESETS))
def test_presets_build_and_accept_overrides(name):
    preset = alg.preset(name, beta=0.01)
    assert preset.name == name and preset.beta == 0.01
    assert preset.loss in alg.LOSSES and preset.advantage in alg.ESTIMATORS and preset.aggregation in alg.AGGREGATIONS


def test_preset_choices():
    assert alg.dapo().eps_high == 0.28 and alg.dapo().dynamic_sampling and alg.dapo().aggregation == "token_mean"
    assert alg.dr_grpo().advantage == "group_mean" and alg.dr_grpo().aggregation == "constant"
    assert (alg.gspo().eps_low, alg.gspo().eps_high) == (3e-4, 4e-4)
    assert alg.rloo().advantage == "leave_one_out"
    assert alg.ppo().num_iterations == 2
    with pytest.raises(ValueError, match="unknown algorithm preset"):
        alg.preset("nope")
    with pytest.raises(ValueError):
        alg.grpo(not_a_field=1)
