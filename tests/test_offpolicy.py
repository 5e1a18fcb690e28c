"""Off-policy correction and loss hygiene (issue 16, part 3), each checked against numbers worked
out by hand in the comments: truncated/masked importance weights, the sampler KL, the log-ratio
clamp, dual clip, CISPO's cap, masked positions outside ``exp``, no AdamW step without signal,
mini-batches, and the switch that turns the correction on."""

from __future__ import annotations

import math

import pytest
import torch

from grooves import algorithms
from grooves.algorithms.losses import cispo, ppo_clip
from grooves.algorithms.offpolicy import importance_weights, sampler_kl
from grooves.policy import LoRA, Policy
from grooves.policy.logprobs import build_token_batch
from grooves.training.config import ConfigError, OptimConfig, parse_config
from grooves.training.datums import Datum, LossConfig
from grooves.training.trainer import Trainer
from grooves.types import Group, Trajectory

LN2, LN4 = math.log(2.0), math.log(4.0)


# --- the weights, by hand ------------------------------------------------------------


def test_token_weights_truncate_and_mask_by_hand():
    # old - sampler = [ln2, ln4, -ln2] -> ratios [2, 4, 0.5]; row 2 has one loss token (ratio 2) and
    # a masked position whose sampler logprob is -inf (it must not matter).
    old = torch.tensor([[LN2, LN4, -LN2], [LN2, 0.0, 0.0]])
    sampler = torch.tensor([[0.0, 0.0, 0.0], [0.0, -math.inf, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    cut = importance_weights(old, sampler, mask, "token", "truncate", cap=3.0)
    # truncate: min(w, 3) -> [2, 3, 0.5] and [2, 0, 0]
    assert torch.allclose(cut.weights, torch.tensor([[2.0, 3.0, 0.5], [2.0, 0.0, 0.0]]))
    assert cut.truncated.tolist() == [[False, True, False], [False, False, False]]
    assert sorted(cut.ratios.tolist()) == pytest.approx([0.5, 2.0, 2.0, 4.0])
    dropped = importance_weights(old, sampler, mask, "token", "mask", cap=3.0)
    # mask: the token whose weight 4 passes the cap counts as 0 -> [2, 0, 0.5]
    assert torch.allclose(dropped.weights, torch.tensor([[2.0, 0.0, 0.5], [2.0, 0.0, 0.0]]))
    assert dropped.masked.tolist() == [[False, True, False], [False, False, False]]


def test_sequence_weights_by_hand():
    # row 1: ln2 + ln2 - ln2 = ln2 -> 2 (under the cap); row 2: ln2 + ln2 = ln4 -> 4 (over it)
    old = torch.tensor([[LN2, LN2, -LN2], [LN2, LN2, 0.0]])
    sampler = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    cut = importance_weights(old, sampler, mask, "sequence", "truncate", cap=3.0)
    assert torch.allclose(cut.weights, torch.tensor([[2.0, 2.0, 2.0], [3.0, 3.0, 0.0]]))
    assert cut.ratios.tolist() == pytest.approx([2.0, 4.0])
    dropped = importance_weights(old, sampler, mask, "sequence", "mask", cap=3.0)
    assert torch.allclose(dropped.weights, torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]))
    assert dropped.masked.sum().item() == 2  # both loss tokens of row 2


def test_sampler_kl_by_hand():
    # k3 with d = old - sampler: e^d - d - 1. d = ln2: 2 - 0.693147 - 1 = 0.306853;
    # d = -ln2: 0.5 + 0.693147 - 1 = 0.193147; the masked position counts 0.
    old = torch.tensor([[LN2, -LN2, 5.0]])
    kl = sampler_kl(old, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    assert kl.tolist()[0] == pytest.approx([0.306853, 0.193147, 0.0], abs=1e-6)


# --- the losses -------------------------------------------------------------------------


def test_masked_positions_never_enter_exp():
    # A masked position whose old logprob is -200 (a garbage sampler value on a masked truncated row):
    # the plain exp(logp - old) is exp(199) = inf in float32, and inf * weight 0 = NaN. That is what
    # use_sampler_logprobs + mask_truncated did; the loss must now be finite, gradient included.
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -200.0]])
    mask = torch.tensor([[1.0, 0.0]])
    assert torch.isnan((torch.exp(logp - old) * mask).sum())  # the bug, reproduced
    loss = (ppo_clip(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2).per_token * mask).sum()
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)  # ratio 1 on the one loss token, A = 1
    assert torch.isfinite(logp.grad).all()
    assert logp.grad.tolist() == [[-1.0, 0.0]]  # d(-r A)/dlogp = -r A = -1; none for the masked one


def test_logratio_clamp_and_dual_clip_by_hand():
    # logp - old = 50 on a loss token: clamped to 20, ratio e^20 = 4.85165e8 (finite).
    # A = -1: L = max(-A r, -A clip(r, 0.8, 1.2)) = max(4.85165e8, 1.2) = 4.85165e8.
    logp, old, mask = torch.tensor([[0.0]]), torch.tensor([[-50.0]]), torch.ones(1, 1)
    plain = ppo_clip(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.2).per_token
    assert plain.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    # dual clip c = 3 bounds it: min(4.85165e8, -A c = 3) = 3
    assert ppo_clip(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.2, dual_clip=3.0).per_token.item() == 3.0
    # ratio 2 (logp - old = ln2), A = -1: max(2, 1.2) = 2 < 3, unchanged; A = +1: max(-2, -1.2) = -1.2,
    # unchanged (dual clip acts only on negative advantages)
    old2 = torch.tensor([[-LN2]])
    assert ppo_clip(logp, old2, torch.tensor([-1.0]), mask, 0.2, 0.2, dual_clip=3.0).per_token.item() == pytest.approx(2.0)
    assert ppo_clip(logp, old2, torch.tensor([1.0]), mask, 0.2, 0.2, dual_clip=3.0).per_token.item() == pytest.approx(-1.2)
    # GSPO: the same bound on its sequence ratio. Two tokens with log-ratios ln4 and 0: s = exp(ln4 / 2) = 2;
    # A = -1, eps 0.2: max(2, 1.2) = 2 per token; with c = 1.5: min(2, 1.5) = 1.5
    logp3, old3, mask3 = torch.zeros(1, 2), torch.tensor([[-LN4, 0.0]]), torch.ones(1, 2)
    g = algorithms.losses.gspo(logp3, old3, torch.tensor([-1.0]), mask3, 0.2, 0.2, dual_clip=1.5).per_token
    assert g.tolist()[0] == pytest.approx([1.5, 1.5])


def test_cispo_cap_is_one_plus_eps_high():
    # ratio e^ln10 = 10, eps_high = 4: weight sg(clip(10, 0, 5)) = 5; L = -5 * A * logp = -5 * 1 * (-1) = 5
    logp = torch.tensor([[-1.0]], requires_grad=True)
    out = cispo(logp, torch.tensor([[-1.0 - math.log(10.0)]]), torch.tensor([1.0]), torch.ones(1, 1), 1.0, 4.0)
    assert out.per_token.item() == pytest.approx(5.0)
    assert out.clipped.item()


# --- the trainer ------------------------------------------------------------------------


def policy() -> Policy:
    p = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    with torch.no_grad():  # a non-zero B so that the adapter's output (and its gradient) is not trivial
        for name, param in p.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return p


def groups(*, logprob: float = -4.0, truncated=(False, False, False, False), version=None) -> list[Group]:
    """Two groups of two short trajectories (rewards 1/0 and 0/1): every advantage is +-0.707."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for g, rewards in enumerate(((1.0, 0.0), (0.0, 1.0))):
        prompt = torch.randint(3, 200, (4,), generator=gen).tolist()
        trajectories = []
        for i, reward in enumerate(rewards):
            completion = torch.randint(3, 200, (3,), generator=gen).tolist()
            trajectories.append(Trajectory([], prompt, completion, [1, 1, 1], [logprob] * 3, reward=reward,
                                           finish_reason="length" if truncated[2 * g + i] else "stop",
                                           policy_version=version))
        out.append(Group({"id": str(g)}, trajectories))
    return out


def adapter(p: Policy) -> list[torch.Tensor]:
    return [param.detach().clone() for param in p.trainable_parameters()]


def test_auto_turns_the_correction_on_when_the_policies_can_differ():
    p = policy()
    trainer = Trainer(p, algorithms.grpo())
    trainer.step = 5
    fresh = [t for g in groups(version=5) for t in g.trajectories]
    stale = [t for g in groups(version=4) for t in g.trajectories]
    unknown = [t for g in groups() for t in g.trajectories]
    assert trainer.correction_level(fresh) is None and trainer.correction_level(unknown) is None
    assert trainer.correction_level(stale) == "token"
    assert Trainer(p, algorithms.grpo(), use_sampler_logprobs=True).correction_level(fresh) == "token"
    assert Trainer(p, algorithms.grpo(), remote_sampler=True).correction_level(fresh) == "token"
    assert Trainer(p, algorithms.grpo(is_correction="off"), use_sampler_logprobs=True).correction_level(fresh) is None
    assert Trainer(p, algorithms.grpo(is_correction="sequence")).correction_level(fresh) == "sequence"


def test_correction_in_forward_backward_equals_reweighting_by_hand():
    # One datum, 3 loss tokens. Its sampler logprobs are the trainer's minus [ln2, ln4, -ln2], so the
    # weights exp(old - sampler) are [2, 4, 0.5], truncated at 3 to [2, 3, 0.5]: the corrected loss and
    # gradient are those of the plain loss with the datum's weights multiplied by [2, 3, 0.5].
    p = policy()
    trainer = Trainer(p, algorithms.grpo())
    tokens = [5, 9, 14, 33, 71, 18]
    base = Datum(tokens[:-1], tokens[1:], weights=[0, 0, 1, 1, 1], advantages=[0, 0, 1.0, -0.5, 1.0], start=2)
    logp = trainer.forward_backward([base], "ppo", backward=False).logprobs[0]  # positions 2..4
    offsets = torch.tensor([LN2, LN4, -LN2])
    sampler = [0.0, 0.0] + (logp - offsets).tolist()
    corrected = Datum(**{**base.__dict__, "sampler_logprobs": sampler})
    reweighted = Datum(**{**base.__dict__, "weights": [0, 0, 2.0, 3.0, 0.5]})
    out = trainer.forward_backward([corrected], "ppo", LossConfig(is_level="token", is_cap=3.0))
    grads = [q.grad.clone() for q in trainer.params]
    trainer.optimizer.zero_grad(set_to_none=True)
    want = trainer.forward_backward([reweighted], "ppo")
    # ratio 1 (old = current): L = -sum(w * A) = -(2 * 1 + 3 * -0.5 + 0.5 * 1) = -1.0
    assert out.loss == pytest.approx(want.loss) == pytest.approx(-1.0, abs=1e-5)
    for got, expected in zip(grads, [q.grad for q in trainer.params]):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert out.sums["is_truncated"] == 1.0  # the token of weight 4
    assert sorted(torch.cat(out.ratios).tolist()) == pytest.approx([0.5, 2.0, 4.0], rel=1e-5)


def test_sampler_logprobs_with_mask_truncated_is_finite_and_ignores_masked_rows():
    # Two truncated trajectories (masked by mask_truncated) carry sampler logprobs of -200: today's
    # ratio exp(logp + 200) was inf there and the step NaN (skipped, alerts/nan_loss). Now the update
    # is the same as with sane values on those rows (-3), because masked rows never enter exp.
    alg = algorithms.grpo(mask_truncated=True, is_correction="off")
    updates = []
    for garbage in (-200.0, -3.0):
        p = policy()
        trainer = Trainer(p, alg, OptimConfig(learning_rate=1e-2), max_completion_length=3,
                          use_sampler_logprobs=True)
        batch = groups(logprob=-3.0, truncated=(False, True, False, True))
        for g in batch:
            g.trajectories[1].logprobs = [garbage] * 3
        metrics = trainer.train_step(batch)
        assert "alerts/nan_loss" not in metrics and metrics["train/skipped_steps"] == 0
        updates.append(adapter(p))
    for a, b in zip(*updates):
        assert torch.equal(a, b)


def test_no_adamw_step_when_every_token_with_signal_is_masked():
    # Step 1 trains (AdamW now has momentum). Step 2: every trajectory is truncated and masked, so no
    # token with a non-zero advantage is left: the adapter must not move (momentum alone would move it).
    p = policy()
    trainer = Trainer(p, algorithms.grpo(mask_truncated=True), OptimConfig(learning_rate=1e-2),
                      max_completion_length=3)
    trainer.train_step(groups())
    before = adapter(p)
    metrics = trainer.train_step(groups(truncated=(True, True, True, True)))
    assert metrics["train/skipped_steps"] == 1.0 and metrics["train/skipped"] == 1.0
    for a, b in zip(before, adapter(p)):
        assert torch.equal(a, b)


def test_minibatches_compute_the_old_policy_once_so_the_clip_acts():
    # minibatches = 2: group 1 then group 2, two AdamW steps. The old logprobs of group 2 are taken
    # before the first step, so after it group 2's ratio is no longer 1 and the tiny clip (1e-6) acts;
    # with one mini-batch the ratio is exactly 1 and nothing is clipped.
    alg = algorithms.grpo(eps_low=1e-6, eps_high=1e-6)
    clipped = {}
    for m in (1, 2):
        p = policy()
        trainer = Trainer(p, alg, OptimConfig(learning_rate=5e-2), max_completion_length=3, minibatches=m)
        batch = groups()
        if m == 2:
            tokens = build_token_batch([t for g in batch for t in g.trajectories])
            before = trainer._forward_no_grad(tokens)  # the policy before any step
            minis = trainer._minibatch_datums([t for g in batch for t in g.trajectories], tokens,
                                              torch.tensor([0.7, -0.7, -0.7, 0.7]), None)
            assert len(minis) == 2 and [len(d) for d in minis] == [2, 2]
            second = minis[1][0]
            assert second.logprobs[second.start:] == pytest.approx(before[2, :3].tolist(), abs=1e-6)
        metrics = trainer.train_step(batch)
        assert metrics["train/skipped_steps"] == 0
        clipped[m] = metrics["clipfrac"]
    assert clipped[1] == 0.0
    assert clipped[2] > 0.0  # only group 2's tokens can clip: at most half
    assert clipped[2] <= 0.5


def test_sampler_kl_and_ratio_quantiles_in_train_step():
    # The sampler's logprobs are the trainer's + 0.5 (a planted offset): every ratio is e^-0.5 = 0.606531
    # and the k3 sampler KL is e^-0.5 + 0.5 - 1 = 0.106531. use_sampler_logprobs turns the correction on
    # ("auto"): no token's weight reaches the cap 3, none is truncated.
    p = policy()
    trainer = Trainer(p, algorithms.grpo(), max_completion_length=3, use_sampler_logprobs=True, minibatches=2)
    batch = groups()
    flat = [t for g in batch for t in g.trajectories]
    own = trainer._forward_no_grad(build_token_batch(flat))
    for row, t in enumerate(flat):
        t.logprobs = (own[row, :3] + 0.5).tolist()
    metrics = trainer.train_step(batch)
    assert metrics["train/is_correction"] == 1.0
    assert metrics["train/sampler_kl"] == pytest.approx(0.106531, abs=1e-5)
    assert metrics["train/is_ratio/p50"] == pytest.approx(0.606531, abs=1e-5)
    assert metrics["train/is_ratio/max"] == pytest.approx(0.606531, abs=1e-5)
    assert metrics["train/is_truncated_frac"] == 0.0 and metrics["train/is_masked_frac"] == 0.0


@pytest.mark.parametrize("section, bad, message", [
    ("algorithm", {"is_cap": 1.0}, "algorithm.is_cap"),
    ("algorithm", {"is_correction": "always"}, "algorithm.is_correction"),
    ("algorithm", {"is_mode": "clip"}, "algorithm.is_mode"),
    ("algorithm", {"preset": "cispo", "dual_clip": 3.0}, "CISPO's weight is already capped"),
    ("algorithm", {"dual_clip": 1.0}, "algorithm.dual_clip"),
    ("train", {"minibatches": 0}, "train.minibatches"),
])
def test_bad_settings_name_their_field(section, bad, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_config({section: bad})
