"""Algorithm settings and the presets ``grpo``, ``dr_grpo``, ``dapo``, ``gspo``, ``cispo``,
``rloo``, ``ppo``, ``sapo``, ``vespo`` and ``luspo``. Each preset is a function that accepts overrides for any field:
``dapo(eps_high=0.3)``. ``docs/algorithms.md`` gives the formulas and where each default
comes from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grooves.algorithms.losses import SEQUENCE_RATIO_LOSSES


class Algorithm(BaseModel):
    """How advantages and the policy loss are computed for one training step."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("custom", description="Preset this configuration started from (informational).")
    advantage: Literal["group_mean", "group_mean_std", "leave_one_out", "batch_std", "none"] = Field(
        "group_mean_std", description="Advantage estimator (see grooves.algorithms.advantages).")
    adv_eps: float = Field(1e-4, ge=0, description="Epsilon added to the std in std-scaled advantages.")
    loss: Literal["ppo_clip", "gspo", "cispo", "sapo", "vespo"] = Field("ppo_clip", description="Policy loss.")
    eps_low: float = Field(0.2, ge=0, description="Lower clip: the ratio is clipped at 1 - eps_low.")
    eps_high: float = Field(0.2, ge=0, description="Upper clip: the ratio is clipped at 1 + eps_high.")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "constant", "seq_mean_token_sum"] = Field(
        "seq_mean_token_mean", description="How per-token losses become one number.")
    beta: float = Field(0.0, ge=0, description="Coefficient of the k3 KL penalty against the reference.")
    reference: Literal["base", "adapter"] = Field(
        "base", description="The KL penalty's (and the logged `kl`'s) reference: 'base' (the adapter off) or "
        "'adapter' (model.adapter as training found it, frozen: RL from an SFT warm start is held near it).")
    kl_bias_correction: bool = Field(False, description="Multiply the k3 KL by the importance ratio "
                                     "pi/pi_old (with its gradient; the sequence ratio for gspo): the "
                                     "bias-corrected KL of DeepSeek-V3.2, TRL's use_bias_correction_kl.")
    num_iterations: int = Field(1, ge=1, description="Optimisation passes over each batch (mu in GRPO).")
    dynamic_sampling: bool = Field(False, description="Drop groups whose rewards are all equal and "
                                   "sample more tasks to fill the batch (DAPO).")
    max_sampling_rounds: int = Field(3, ge=1, description="Sampling rounds per step when dynamic_sampling "
                                     "is on; the step trains on what it has after the last round.")
    overlong_buffer: float = Field(0.0, ge=0, lt=1, description="Soft overlong punishment: the last "
                                   "fraction of max_completion_length where the reward is lowered (0 = off).")
    overlong_penalty: float = Field(1.0, ge=0, description="Largest overlong punishment (at the limit).")
    mask_truncated: bool = Field(False, description="Exclude truncated completions from the loss (DAPO "
                                 "overlong filtering); they still count in the group's advantage baseline.")
    is_correction: Literal["auto", "token", "sequence", "off"] = Field(
        "auto", description="Truncated importance sampling between the sampler's logprobs and the trainer's "
        "before the update: per token, per sequence, or off. 'auto' = 'token' whenever the two can differ "
        "(train.use_sampler_logprobs, a trajectory whose policy_version is older than the trainer's step, "
        "a remote sampler), else off.")
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="'truncate': cut a weight above is_cap to is_cap (TIS); 'mask': drop the "
        "token or sequence whose weight is above is_cap (MIS).")
    is_cap: float = Field(3.0, gt=1, description="The cap C on the importance weight exp(old - sampler).")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip PPO: for negative advantages the "
                                    "loss is at most -dual_clip * A (Ye et al. 2020; verl's clip_ratio_c, "
                                    "typically 3); None = off. ppo_clip and gspo only.")

    sapo_temperature_pos: float = Field(1.0, gt=0, description="SAPO's gate temperature for tokens with "
                                        "a positive advantage (loss = 'sapo').")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="SAPO's gate temperature for tokens with "
                                        "a zero or negative advantage (loss = 'sapo').")
    vespo_k_pos: float = Field(2.0, ge=0, description="VESPO's power k in phi(W) = W^k exp(lambda (1 - W)) "
                               "for A >= 0 (loss = 'vespo').")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="VESPO's decay lambda for A >= 0.")
    vespo_k_neg: float = Field(3.0, ge=0, description="VESPO's power k for A < 0.")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="VESPO's decay lambda for A < 0.")

    @model_validator(mode="after")
    def _check(self) -> Algorithm:
        if self.eps_low > 1:
            raise ValueError("eps_low must be <= 1 (the clipped ratio cannot go below 0)")
        if self.loss == "vespo" and self.is_correction == "sequence":
            raise ValueError("is_correction = 'sequence' does not apply to vespo: VESPO multiplies the sampler's "
                             "token weights into its own sequence ratio; use 'token' (or 'auto')")
        if self.dual_clip is not None and self.loss not in ("ppo_clip", "gspo"):
            raise ValueError(f"dual_clip applies to ppo_clip and gspo, not {self.loss}: CISPO's weight is "
                             "already capped at 1 + eps_high, SAPO's and VESPO's are bounded by their shape")
        return self

    def loss_options(self) -> dict[str, float]:
        """The keyword arguments of this loss's own settings (SAPO's temperatures, VESPO's k and lambda)."""
        prefix = {"sapo": "sapo_", "vespo": "vespo_"}.get(self.loss)
        if prefix is None:
            return {}
        return {name: getattr(self, name) for name in type(self).model_fields if name.startswith(prefix)}

    def kl_ratio_level(self) -> str | None:
        """None when ``kl_bias_correction`` is off, else the level of the ratio that multiplies the KL."""
        if not self.kl_bias_correction:
            return None
        return "sequence" if self.loss in SEQUENCE_RATIO_LOSSES else "token"


def _preset(name: str, base: dict, overrides: dict) -> Algorithm:
    return Algorithm(**{"name": name, **base, **overrides})


def grpo(**overrides) -> Algorithm:
    """GRPO (DeepSeekMath): group mean/std advantages, token PPO clip 0.2, sequence-then-token mean."""
    return _preset("grpo", {"advantage": "group_mean_std", "loss": "ppo_clip",
                            "aggregation": "seq_mean_token_mean", "eps_low": 0.2, "eps_high": 0.2}, overrides)


def dr_grpo(**overrides) -> Algorithm:
    """Dr. GRPO: no std scaling, no length normalisation (constant normaliser)."""
    return _preset("dr_grpo", {"advantage": "group_mean", "loss": "ppo_clip", "aggregation": "constant",
                               "eps_low": 0.2, "eps_high": 0.2}, overrides)


def dapo(**overrides) -> Algorithm:
    """DAPO: clip-higher (0.2/0.28), token-mean loss, dynamic sampling, soft overlong punishment."""
    return _preset("dapo", {"advantage": "group_mean_std", "loss": "ppo_clip", "aggregation": "token_mean",
                            "eps_low": 0.2, "eps_high": 0.28, "dynamic_sampling": True,
                            "overlong_buffer": 0.2}, overrides)


def gspo(**overrides) -> Algorithm:
    """GSPO: sequence-level length-normalised ratio, clip 3e-4 / 4e-4."""
    return _preset("gspo", {"advantage": "group_mean_std", "loss": "gspo",
                            "aggregation": "seq_mean_token_mean", "eps_low": 3e-4, "eps_high": 4e-4}, overrides)


def cispo(**overrides) -> Algorithm:
    """CISPO: clipped, stop-gradient importance weight times logprob; no lower bound on the weight.
    The cap is 1 + eps_high = 5: TRL's ``loss_type="cispo", epsilon_high=5.0``."""
    return _preset("cispo", {"advantage": "group_mean_std", "loss": "cispo", "aggregation": "token_mean",
                             "eps_low": 1.0, "eps_high": 4.0}, overrides)


def rloo(**overrides) -> Algorithm:
    """RLOO: leave-one-out baseline, no std scaling."""
    return _preset("rloo", {"advantage": "leave_one_out", "loss": "ppo_clip",
                            "aggregation": "seq_mean_token_mean", "eps_low": 0.2, "eps_high": 0.2}, overrides)


def ppo(**overrides) -> Algorithm:
    """PPO-clip with a group-mean baseline instead of a critic (no value model, no GAE), 2 epochs."""
    return _preset("ppo", {"advantage": "group_mean", "loss": "ppo_clip", "aggregation": "token_mean",
                           "eps_low": 0.2, "eps_high": 0.2, "num_iterations": 2}, overrides)


def sapo(**overrides) -> Algorithm:
    """SAPO: a soft sigmoid gate on the token ratio instead of a hard clip, temperatures 1.0 / 1.05.

    ``J = E[1/G sum_i 1/|o_i| sum_t f(r_it) A_i]``, ``f(r) = sigmoid(tau (r - 1)) * 4 / tau``
    (Gao et al. 2025, arXiv:2511.20347): TRL's ``loss_type="sapo"``.
    """
    return _preset("sapo", {"advantage": "group_mean_std", "loss": "sapo",
                            "aggregation": "seq_mean_token_mean"}, overrides)


def vespo(**overrides) -> Algorithm:
    """VESPO: a Gamma-shaped weight on the sequence ratio W, token-mean loss.

    ``L = -E[sg(W^k exp(lambda (1 - W))) * A * log pi(o)]``, k/lambda = 2/3 for A >= 0 and 3/2 for A < 0
    (Shen et al. 2026, arXiv:2602.10693): TRL's ``loss_type="vespo"``.
    """
    return _preset("vespo", {"advantage": "group_mean_std", "loss": "vespo", "aggregation": "token_mean"},
                   overrides)


def luspo(**overrides) -> Algorithm:
    """LUSPO: GSPO with each sequence's loss scaled by its length, clip 2e-3 / 2.5e-3.

    ``J = E[1/G sum_i |o_i| min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)]``
    (Liu et al. 2026, arXiv:2602.05261): TRL's ``loss_type="luspo", importance_sampling_level="sequence"``.
    """
    return _preset("luspo", {"advantage": "group_mean_std", "loss": "gspo", "aggregation": "seq_mean_token_sum",
                             "eps_low": 2e-3, "eps_high": 2.5e-3}, overrides)


PRESETS = {"grpo": grpo, "dr_grpo": dr_grpo, "dapo": dapo, "gspo": gspo, "cispo": cispo, "rloo": rloo, "ppo": ppo,
           "sapo": sapo, "vespo": vespo, "luspo": luspo}


def preset(name: str, **overrides) -> Algorithm:
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name](**overrides)
