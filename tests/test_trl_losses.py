"""TRL's losses that grooves added (SAPO, VESPO, LUSPO) and its bias-corrected KL, against numbers
worked out by hand on a 2x3 batch. docs/algorithms.md maps each to its TRL setting."""

import math

import pytest
import torch

from grooves import algorithms as alg
from grooves.algorithms.losses import gspo, k3_kl, kl_ratio, sapo, seq_mean_token_mean, seq_mean_token_sum, vespo
from grooves.training.config import parse_config


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# Row 0 has 3 tokens, row 1 has 2 (the last position is padding).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
NEW = torch.log(torch.tensor([[0.75, 0.5, 0.25], [0.5, 0.7, 0.9]]))  # ratios 1.5, 1, 0.5 / 1, 1.4, (pad)
ADV = torch.tensor([1.0, -1.0])


def test_sapo_gate_values_and_gradient():
    new = NEW.clone().requires_grad_(True)
    out = sapo(new, OLD, ADV, MASK, sapo_temperature_pos=2.0, sapo_temperature_neg=4.0)
    # row 0, A = +1, tau = 2: f(r) = sigmoid(2 (r - 1)) * 4/2 -> r 1.5: 2 sig(1); r 1: 2 * 0.5 = 1; r 0.5: 2 sig(-1)
    # row 1, A = -1, tau = 4: f(r) = sigmoid(4 (r - 1)) * 1  -> r 1: 0.5; r 1.4: sig(1.6)
    expected = [[-2 * sigmoid(1), -1.0, -2 * sigmoid(-1)], [0.5, sigmoid(1.6), 0.5]]
    close(out.per_token, expected)
    assert not out.clipped.any()  # a soft gate clips nothing
    (out.per_token * MASK).sum().backward()
    # dL/dlogp = -A * 4 s (1 - s) * r, s = sigmoid(tau (r - 1)): 1.5 * 4 sig(1) sig(-1) at r = 1.5, 1 at r = 1
    g = lambda x: 4 * sigmoid(x) * sigmoid(-x)  # noqa: E731
    close(new.grad, [[-1.5 * g(1), -1.0, -0.5 * g(-1)], [1.0, 1.4 * g(1.6), 0.0]])


def test_sapo_is_the_policy_gradient_on_policy_whatever_the_temperature():
    new = NEW.clone().requires_grad_(True)
    sapo(new, new.detach(), ADV, MASK).per_token.mul(MASK).sum().backward()
    close(new.grad, [[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]])  # -A, as REINFORCE


def test_vespo_gamma_weight_on_the_sequence_ratio():
    new = NEW.clone().requires_grad_(True)
    out = vespo(new, OLD, ADV, MASK)
    # row 0: W = 1.5 * 1 * 0.5 = 0.75, A >= 0 -> k 2, lambda 3: phi = 0.75^2 e^(3 * 0.25)
    # row 1: W = 1 * 1.4 = 1.4 (padding left out), A < 0 -> k 3, lambda 2: phi = 1.4^3 e^(2 * -0.4)
    phi0, phi1 = 0.5625 * math.exp(0.75), 2.744 * math.exp(-0.8)
    assert (phi0, phi1) == pytest.approx((1.1908126, 1.2329587))
    expected = [[-phi0 * math.log(0.75), -phi0 * math.log(0.5), -phi0 * math.log(0.25)],
                [phi1 * math.log(0.5), phi1 * math.log(0.7), phi1 * math.log(0.9)]]
    close(out.per_token, expected)
    (out.per_token * MASK).sum().backward()
    # phi is a constant (no gradient through W): dL/dlogp = -phi * A
    close(new.grad, [[-phi0] * 3, [phi1, phi1, 0.0]])


def test_vespo_weight_is_one_on_policy_and_zero_when_the_ratio_explodes():
    on = vespo(NEW, NEW, ADV, MASK).per_token
    close(on * MASK, (-ADV[:, None] * NEW * MASK).tolist())  # phi(1) = e^0 = 1: REINFORCE on log pi(o)
    far = vespo(OLD + 30.0, OLD, ADV, MASK).per_token  # log W clamped to 20: phi = e^(3 + 40 - 3 e^20) = 0
    assert torch.isfinite(far).all() and far.abs().max().item() == 0.0


def test_vespo_takes_the_sampler_correction_into_w():
    # W = pi/old * prod_t is_weight_t. Row 0: 0.75 * 2 = 1.5 (A >= 0): phi = 1.5^2 e^(3 * -0.5);
    # row 1: 1.4 * 0.5 = 0.7 (the padding's weight 0 is off the mask) (A < 0): phi = 0.7^3 e^(2 * 0.3)
    weight = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 0.0]])
    out = vespo(NEW, OLD, ADV, MASK, is_weight=weight)
    phi0, phi1 = 2.25 * math.exp(-1.5), 0.343 * math.exp(0.6)
    assert (phi0, phi1) == pytest.approx((0.5020429, 0.6249868))
    close(out.per_token * MASK, [[-phi0 * math.log(0.75), -phi0 * math.log(0.5), -phi0 * math.log(0.25)],
                                 [phi1 * math.log(0.5), phi1 * math.log(0.7), 0.0]])
    # a token dropped by the mask mode (weight 0) sends ln W to ln 1e-8: phi(7.5e-9) ~ 1e-15, the sequence is out
    dropped = vespo(NEW, OLD, ADV, MASK, is_weight=torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    assert dropped.per_token[0].abs().max().item() < 1e-12 and torch.isfinite(dropped.per_token).all()


def test_luspo_scales_gspo_by_the_length():
    new = NEW.clone().requires_grad_(True)
    out = gspo(new, OLD, ADV, MASK, eps_low=0.2, eps_high=0.2)
    loss = (out.per_token * seq_mean_token_sum(MASK, 3)).sum()
    # s_0 = 0.75^(1/3) (3 tokens, A = +1), s_1 = 1.4^(1/2) (2 tokens, A = -1), both inside [0.8, 1.2]:
    # 1/2 (3 * -s_0 + 2 * s_1) = 1/2 (-2.725681 + 2.366432)
    s0, s1 = 0.75 ** (1 / 3), math.sqrt(1.4)
    assert loss.item() == pytest.approx((-3 * s0 + 2 * s1) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(-0.1796245, abs=1e-6)
    gspo_loss = (out.per_token * seq_mean_token_mean(MASK, 3)).sum()
    assert gspo_loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-6)  # GSPO: no length factor
    loss.backward()
    # the sequence form 1/G sum_i |o_i| * -A_i s_i has the same gradient: ds_i/dlogp_t = s_i / |o_i|
    close(new.grad, [[-s0 / 2] * 3, [s1 / 2, s1 / 2, 0.0]])


def test_seq_mean_token_sum_aggregation():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    assert (loss * seq_mean_token_sum(MASK, 4)).sum().item() == pytest.approx((6 + 9) / 2)
    empty = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # a row with no token does not count
    assert (loss * seq_mean_token_sum(empty, 4)).sum().item() == pytest.approx(3.0)


# KL: logp = ln[0.5, 0.25], ref = ln[0.25, 0.5], old = ln[0.25, 0.5] -> r = [2, 0.5];
# delta = ref - logp = [ln 0.5, ln 2]: k3 = [0.5 + ln 2 - 1, 2 - ln 2 - 1] (their sum is 0.5).
LOGP = torch.log(torch.tensor([[0.5, 0.25]]))
REF = torch.log(torch.tensor([[0.25, 0.5]]))
OLD_KL = torch.log(torch.tensor([[0.25, 0.5]]))
K3 = [math.log(2) - 0.5, 1 - math.log(2)]
ONE = torch.ones(1, 2)


def test_bias_corrected_kl_token_level():
    logp = LOGP.clone().requires_grad_(True)
    kl = k3_kl(logp, REF, kl_ratio(logp, OLD_KL, ONE))
    close(kl, [[2 * K3[0], 0.5 * K3[1]]])
    kl.sum().backward()
    # d(k3 r)/dlogp = (1 - e^delta) r + k3 r: (1 - 0.5) 2 + 2 k3_0 ; (1 - 2) 0.5 + 0.5 k3_1
    close(logp.grad, [[1 + 2 * K3[0], -0.5 + 0.5 * K3[1]]])


def test_bias_corrected_kl_changes_the_gradient_on_policy():
    logp = LOGP.clone().requires_grad_(True)
    kl = k3_kl(logp, REF, kl_ratio(logp, logp.detach(), ONE))
    close(kl, [K3])  # the ratio's value is 1 ...
    kl.sum().backward()
    close(logp.grad, [[0.5 + K3[0], -1 + K3[1]]])  # ... its gradient is not: (1 - e^delta) + k3
    plain = LOGP.clone().requires_grad_(True)
    k3_kl(plain, REF).sum().backward()
    close(plain.grad, [[0.5, -1.0]])  # without the correction: 1 - e^delta


def test_bias_corrected_kl_sequence_level():
    logp = LOGP.clone().requires_grad_(True)
    ratio = kl_ratio(logp, OLD_KL, ONE, level="sequence")  # s = exp((ln 2 + ln 0.5) / 2) = 1
    close(ratio, [[1.0]])
    kl = k3_kl(logp, REF, ratio)
    close(kl, [K3])
    kl.sum().backward()
    # (1 - e^delta_t) s + (k3_0 + k3_1) * s / 2 = [0.5 + 0.25, -1 + 0.25]
    close(logp.grad, [[0.75, -0.75]])
    with pytest.raises(ValueError, match="level"):
        kl_ratio(logp, OLD_KL, ONE, level="batch")


def test_presets_and_their_trl_settings():
    assert (alg.sapo().loss, alg.sapo().aggregation) == ("sapo", "seq_mean_token_mean")
    assert alg.sapo().loss_options() == {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}
    assert (alg.vespo().loss, alg.vespo().aggregation) == ("vespo", "token_mean")
    assert alg.vespo(vespo_k_pos=1.5).loss_options() == {"vespo_k_pos": 1.5, "vespo_lambda_pos": 3.0,
                                                         "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}
    luspo = alg.luspo()
    assert (luspo.loss, luspo.aggregation, luspo.eps_low, luspo.eps_high) == ("gspo", "seq_mean_token_sum",
                                                                              2e-3, 2.5e-3)
    assert alg.grpo().loss_options() == {} and alg.cispo().eps_high == 4.0  # cap 5 = TRL's epsilon_high=5
    assert alg.grpo().kl_ratio_level() is None  # off by default
    assert alg.grpo(kl_bias_correction=True).kl_ratio_level() == "token"
    assert alg.gspo(kl_bias_correction=True).kl_ratio_level() == "sequence"
    assert luspo.model_copy(update={"kl_bias_correction": True}).kl_ratio_level() == "sequence"
    with pytest.raises(ValueError, match="dual_clip applies to ppo_clip and gspo"):
        alg.sapo(dual_clip=3.0)
    with pytest.raises(ValueError, match="sapo_temperature_neg"):
        alg.sapo(sapo_temperature_neg=0.0)


def test_toml_algorithm_section_sets_the_new_fields():
    config = parse_config({"algorithm": {"preset": "vespo", "beta": 0.01, "kl_bias_correction": True,
                                         "vespo_lambda_neg": 1.5}})
    assert config.algorithm.name == "vespo" and config.algorithm.kl_bias_correction
    assert config.algorithm.loss_options()["vespo_lambda_neg"] == 1.5
    with pytest.raises(ValueError, match="sapo_temperature"):
        parse_config({"algorithm": {"preset": "sapo", "sapo_temperature_pos": -1}})


# --- the trainer: forward_backward takes the options, a train step passes the algorithm's -----------

# One sequence of 7 tokens; the loss reads positions 2..5. Old and reference log-probs are made up,
# so the ratio exp(logp - old) is far from 1 and the corrected KL differs from the plain one.
SEQUENCE = [5, 17, 42, 99, 7, 23, 61]
OLD_LP = [0.0, 0.0, -5.0, -5.5, -4.0, -6.0]
REF_LP = [0.0, 0.0, -4.0, -5.0, -6.0, -5.0]


def datum(advantage: float):
    from grooves.training.datums import Datum

    return Datum(tokens=SEQUENCE[:-1], target_tokens=SEQUENCE[1:], weights=[0, 0, 1, 1, 1, 1], logprobs=OLD_LP,
                 advantages=[0, 0] + [advantage] * 4, ref_logprobs=REF_LP)


def test_forward_backward_adds_the_bias_corrected_kl(tiny_policy):
    from grooves.training.datums import LossConfig
    from grooves.training.trainer import Trainer

    trainer = Trainer(tiny_policy, alg.grpo())
    plain = trainer.forward_backward([datum(0.0)], "ppo_clip", LossConfig(kl_coef=0.5), backward=False)
    fixed = trainer.forward_backward([datum(0.0)], "ppo_clip", LossConfig(kl_coef=0.5, kl_ratio="token"),
                                     backward=False)
    logp = plain.logprobs[0][2:].double()
    old, ref = torch.tensor(OLD_LP[2:], dtype=torch.float64), torch.tensor(REF_LP[2:], dtype=torch.float64)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    # A = 0: the loss is the KL term alone, 0.5 * sum_t k3_t, and with the correction 0.5 * sum_t k3_t r_t
    assert plain.loss == pytest.approx(0.5 * k3.sum().item(), rel=1e-5)
    assert fixed.loss == pytest.approx(0.5 * (k3 * torch.exp(logp - old)).sum().item(), rel=1e-5)
    assert abs(fixed.loss - plain.loss) > 0.01 * plain.loss


def test_forward_backward_passes_sapo_temperatures(tiny_policy):
    from grooves.training.datums import LossConfig
    from grooves.training.trainer import Trainer

    trainer = Trainer(tiny_policy, alg.sapo())
    options = {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 4.0}
    out = trainer.forward_backward([datum(1.0)], "sapo", LossConfig(loss_options=options), backward=False)
    default = trainer.forward_backward([datum(1.0)], "sapo", LossConfig(), backward=False)
    ratio = torch.exp(out.logprobs[0][2:].double() - torch.tensor(OLD_LP[2:], dtype=torch.float64))
    # A = +1 -> tau_pos: sum_t -sigmoid(tau (r_t - 1)) * 4 / tau
    assert out.loss == pytest.approx(-(torch.sigmoid(2.0 * (ratio - 1)) * 2.0).sum().item(), rel=1e-5)
    assert default.loss == pytest.approx(-(torch.sigmoid(ratio - 1) * 4.0).sum().item(), rel=1e-5)


def test_forward_backward_puts_the_sampler_correction_into_vespos_w(tiny_policy):
    from dataclasses import replace

    from grooves.training.datums import LossConfig
    from grooves.training.trainer import Trainer

    # the sampler's log-probs differ from the old policy's by +0.5, -0.5, 0, +1: w_t = exp(old - mu), none
    # above the cap 3, so sum_t ln w_t = 1 and W = exp(sum_t (logp_t - old_t) + 1)
    sampled = replace(datum(1.0), sampler_logprobs=[0.0, 0.0, -5.5, -5.0, -4.0, -7.0])
    trainer = Trainer(tiny_policy, alg.vespo())
    out = trainer.forward_backward([sampled], "vespo", LossConfig(is_level="token", is_cap=3.0), backward=False)
    logp = out.logprobs[0][2:].double()
    log_w = (logp - torch.tensor(OLD_LP[2:], dtype=torch.float64)).sum().item() + 1.0
    phi = math.exp(3.0 + 2.0 * log_w - 3.0 * math.exp(log_w))  # A = +1: k 2, lambda 3
    assert out.loss == pytest.approx(-phi * logp.sum().item(), rel=1e-5)  # not multiplied by w_t as well


def test_vespo_refuses_a_sequence_level_sampler_correction():
    with pytest.raises(ValueError, match="does not apply to vespo"):
        alg.vespo(is_correction="sequence")


def test_train_step_passes_the_algorithms_loss_options_and_kl_ratio(tiny_policy, monkeypatch):
    from grooves.training.trainer import Trainer
    from grooves.types import Group, Trajectory

    algorithm = alg.vespo(vespo_k_pos=1.5, beta=0.1, kl_bias_correction=True)
    trainer = Trainer(tiny_policy, algorithm, max_completion_length=4)
    seen, original = [], trainer.forward_backward

    def spy(datums, loss_fn, config=None, **kwargs):
        seen.append((loss_fn, config))
        return original(datums, loss_fn, config, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward", spy)
    group = Group({"id": "0"}, [Trajectory(messages=[], prompt_ids=[5, 17, 42], completion_ids=[99, 7, 23],
                                           completion_mask=[1, 1, 1], logprobs=[-5.0] * 3, reward=r)
                                for r in (1.0, 0.0)])
    metrics = trainer.train_step([group])
    assert math.isfinite(metrics["loss/policy"])
    loss_fn, config = seen[0]
    assert loss_fn == "vespo" and config.kl_ratio == "token" and config.kl_coef == 0.1
    assert config.loss_options == {"vespo_k_pos": 1.5, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
                                   "vespo_lambda_neg": 2.0}
