"""grooves' losses against TRL's own loss code, where TRL is installed (the ``bench`` extra).

TRL 1.16's ``GRPOTrainer._compute_loss`` is called on a stand-in for the trainer that holds only
the attributes that method reads, with the log-probs given directly; grooves' loss and
aggregation get the same tensors. Loss and gradient agree to float rounding. TRL is not a
dependency: without it (or with another version, whose attributes may differ) this file skips;
``tests/test_trl_losses.py`` holds the same losses to hand-worked numbers.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"the stand-in trainer follows TRL 1.16, not {trl.__version__}", allow_module_level=True)

from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from grooves.algorithms.losses import AGGREGATIONS, LOSSES, k3_kl, kl_ratio  # noqa: E402
from grooves.algorithms.offpolicy import importance_weights  # noqa: E402

B, T = 4, 6
gen = torch.Generator().manual_seed(0)
MASK = (torch.arange(T)[None] < torch.tensor([6, 4, 5, 2])[:, None]).float()
OLD = -torch.rand(B, T, generator=gen) * 3 - 0.5
LOGP = OLD + torch.randn(B, T, generator=gen) * 0.3
REF = OLD + torch.randn(B, T, generator=gen) * 0.3
SAMPLER = OLD + torch.randn(B, T, generator=gen) * 0.5
ADV = torch.tensor([1.2, -0.7, 0.4, -1.5])


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x


def trl_loss(loss_type: str, level: str, beta: float, bias: bool, eps_high: float, is_ratio=None):
    logp = LOGP.clone().requires_grad_(True)
    args = SimpleNamespace(use_bias_correction_kl=bias, delta=None, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                           vespo_lambda_neg=2.0, steps_per_generation=1)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros(B, T), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, args=args, loss_type=loss_type, epsilon_low=0.2,
        epsilon_high=eps_high, use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=T,
        accelerator=_Accelerator(), _entropy_bonus_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=GRPOTrainer.get_gamma_weights)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": MASK, "advantages": ADV,
              "old_per_token_logps": OLD, "ref_per_token_logps": REF, "num_items_in_batch": MASK.sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.item(), logp.grad * MASK


def grooves_loss(loss: str, aggregation: str, beta: float, kl_level, eps_low: float, eps_high: float, is_weight=None):
    logp = LOGP.clone().requires_grad_(True)
    inside = {"is_weight": is_weight} if is_weight is not None and loss == "vespo" else {}
    per_token = LOSSES[loss](logp, OLD, ADV, MASK, eps_low, eps_high, **inside).per_token
    if is_weight is not None and not inside:
        per_token = per_token * is_weight
    if beta:
        ratio = None if kl_level is None else kl_ratio(logp, OLD, MASK, kl_level)
        per_token = per_token + beta * k3_kl(logp, REF, ratio)
    total = (per_token * AGGREGATIONS[aggregation](MASK, T)).sum()
    total.backward()
    return total.item(), logp.grad * MASK


# (TRL loss_type, importance_sampling_level, beta, use_bias_correction_kl, epsilon_high) ->
# (grooves loss, aggregation, beta, kl ratio level, eps_low, eps_high)
CASES = {
    "grpo": (("grpo", "token", 0.1, False, 0.28), ("ppo_clip", "seq_mean_token_mean", 0.1, None, 0.2, 0.28)),
    "grpo_kl_bias": (("grpo", "token", 0.1, True, 0.28), ("ppo_clip", "seq_mean_token_mean", 0.1, "token", 0.2, 0.28)),
    "dapo_kl_bias": (("dapo", "token", 0.1, True, 0.28), ("ppo_clip", "token_mean", 0.1, "token", 0.2, 0.28)),
    "gspo_kl_bias": (("grpo", "sequence", 0.1, True, 0.28),
                     ("gspo", "seq_mean_token_mean", 0.1, "sequence", 0.2, 0.28)),
    "cispo_cap_5": (("cispo", "token", 0.0, False, 5.0), ("cispo", "token_mean", 0.0, None, 1.0, 4.0)),
    "sapo": (("sapo", "token", 0.1, False, 0.28), ("sapo", "seq_mean_token_mean", 0.1, None, 0.2, 0.28)),
    "vespo_kl_bias": (("vespo", "token", 0.1, True, 0.28), ("vespo", "token_mean", 0.1, "token", 0.2, 0.28)),
    "luspo_kl_bias": (("luspo", "sequence", 0.1, True, 0.28),
                      ("gspo", "seq_mean_token_sum", 0.1, "sequence", 0.2, 0.28)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_equal_trls(name):
    trl_case, grooves_case = CASES[name]
    (a, grad_a), (b, grad_b) = trl_loss(*trl_case), grooves_loss(*grooves_case)
    assert a == pytest.approx(b, abs=1e-6)
    torch.testing.assert_close(grad_a, grad_b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("trl_type, loss, aggregation", [("dapo", "ppo_clip", "token_mean"),
                                                         ("vespo", "vespo", "token_mean")])
def test_token_truncated_sampler_correction_equals_trls(trl_type, loss, aggregation):
    """TRL multiplies the loss by vLLM's truncated weight, except VESPO, which takes it into W."""
    weights = importance_weights(OLD, SAMPLER, MASK, "token", "truncate", 3.0).weights
    trl_ratio = torch.clamp(torch.exp((OLD - SAMPLER) * MASK), max=3.0)  # TRL's: 1 off the mask
    (a, grad_a) = trl_loss(trl_type, "token", 0.0, False, 0.28, is_ratio=trl_ratio)
    (b, grad_b) = grooves_loss(loss, aggregation, 0.0, None, 0.2, 0.28, is_weight=weights)
    assert a == pytest.approx(b, abs=1e-6)
    torch.testing.assert_close(grad_a, grad_b, atol=1e-6, rtol=0)
