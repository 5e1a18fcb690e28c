"""The local trainer: the primitives in this process, and ``train_step`` on top of them.

The primitives are in the shape Tinker made standard: ``forward_backward(datums, loss_fn,
config)`` (per-token datums; gradients accumulate across calls), ``optim_step(adam)`` and
``publish(run_dir)`` (the adapter becomes ``RUN@STEP``). ``train_step`` (``grooves.training.step``,
shared with the remote trainer) turns groups into datums whose ``weights`` carry the algorithm's
aggregation, so its loss is the same weighted sum of per-token losses that ``forward_backward``
computes for Tinker's losses (which are plain sums).

Training log-probs use the sampling temperature, matching the sampler's logprobs.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from grooves.algorithms import LOSSES, Algorithm, k3_kl, kl_ratio
from grooves.algorithms.losses import IS_WEIGHT_LOSSES, TINKER_LOSSES
from grooves.policy.logprobs import TokenBatch, completion_logprobs, shared_prefix_logprobs
from grooves.policy.packed_update import packed_update
from grooves.policy.policy import Policy
from grooves.training.checkpoint import save_checkpoint
from grooves.training.config import OptimConfig
from grooves.training.datums import AdamParams, Datum, DatumBatch, ForwardBackwardOutput, LossConfig
from grooves.training.step import RLStep, add_metric, correct
from grooves.types import Trajectory


FORWARD_TOKENS = 2048
"""At most this many tokens (rows x the longest row's length) in one forward that keeps its
activations for backward. A micro-batch holds ~1.5-2.5 MB of activations per token on the bundled
135M model (fp32, LoRA on every linear: 30 layers of MLP and attention inputs): 4 agent rollouts
of 1,200 tokens held ~10 GB. Longer micro-batches run in parts; the gradient is the same sum."""


class Trainer(RLStep):
    """Holds the optimizer of a policy's adapter and performs updates; the LR follows ``step``."""

    def __init__(self, policy: Policy, algorithm: Algorithm, optim: OptimConfig | None = None, *,
                 forward_tokens: int = FORWARD_TOKENS, **settings):
        """``settings``: those of ``RLStep`` (temperature, max_completion_length, total_steps, ...);
        ``forward_tokens``: the activation budget of one forward (``FORWARD_TOKENS``)."""
        if not policy.has_adapter:
            raise ValueError("training needs a LoRA adapter: Policy.load(spec, lora=LoRA(rank=8))")
        super().__init__(algorithm, optim, **settings)
        self.forward_tokens = forward_tokens
        self.policy = policy
        self.params = policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=self.optim.learning_rate, betas=self.optim.betas,
                                           weight_decay=self.optim.weight_decay)

    # --- primitives ----------------------------------------------------------------

    def forward_backward(self, datums: list[Datum], loss_fn: str, config: LossConfig | None = None,
                         *, backward: bool = True, loss_positions_only: bool = False) -> ForwardBackwardOutput:
        """Sum of ``weights * loss`` over every token of every datum; its gradient is *added* to the
        adapter's (call ``optim_step`` to apply it). ``loss_fn``: Tinker's ``cross_entropy``,
        ``importance_sampling``, ``ppo``, ``cispo`` or grooves' ``ppo_clip``, ``gspo``, ``sapo``, ``vespo``.
        ``loss_positions_only``: log-probs only where a weight is non-zero (0 elsewhere in the
        output), which skips the output head on an agent's tool results and env text."""
        loss, eps_low, eps_high = _loss_fn(loss_fn, config := config or LossConfig())
        batch = DatumBatch.build(datums, self.policy.device)
        out = ForwardBackwardOutput(0.0, [torch.zeros(0)] * len(datums))
        self.policy.model.train(backward)
        try:
            for rows in self._forward_chunks(batch.tokens, batch.weights != 0 if loss_positions_only else None):
                micro = batch.select(rows)
                tokens = replace(micro.tokens, mask=(micro.weights != 0).float()) if loss_positions_only else micro.tokens
                with torch.set_grad_enabled(backward):
                    logp, entropy = self._logprobs(tokens, with_entropy=config.entropy, shifted=batch.shifted)
                    mask = (micro.weights != 0).float()  # (b, T) tokens in the loss
                    old = logp.detach() if micro.old_logprobs is None else micro.old_logprobs
                    weight = None if micro.sampler_logprobs is None else correct(out, old, micro.sampler_logprobs,
                                                                                 mask, config)
                    inside = weight is not None and loss_fn in IS_WEIGHT_LOSSES  # VESPO puts it in its W
                    terms = loss(logp, old, micro.advantages, mask, eps_low, eps_high, dual_clip=config.dual_clip,
                                 **config.loss_options, **({"is_weight": weight} if inside else {}))
                    per_token, effective = terms.per_token, micro.weights
                    if weight is not None and not inside:
                        per_token, effective = per_token * weight, micro.weights * weight
                    if micro.ref_logprobs is not None:
                        ratio = None if config.kl_ratio is None else kl_ratio(logp, old, mask, config.kl_ratio)
                        kl = k3_kl(logp, micro.ref_logprobs, ratio)
                        if config.kl_coef > 0:
                            per_token = per_token + config.kl_coef * kl
                        add_metric(out, "kl", kl, mask)
                    chunk_loss = (per_token * micro.weights).sum()
                if not torch.isfinite(chunk_loss):
                    self.optimizer.zero_grad(set_to_none=True)
                    out.finite = False
                    return out
                if backward:
                    chunk_loss.backward()
                out.loss += chunk_loss.item()
                with torch.no_grad():
                    moves = (micro.advantages != 0) | (config.kl_coef > 0 and micro.ref_logprobs is not None)
                    out.active += ((effective != 0) & moves).sum().item()
                add_metric(out, "clipfrac", terms.clipped.float(), mask)
                add_metric(out, "approx_kl", k3_kl(old, logp.detach()), mask)
                if entropy is not None:
                    add_metric(out, "entropy", entropy, mask)
                for i, row in enumerate(rows.tolist()):
                    out.logprobs[row] = logp[i, : batch.lengths[row]].detach().cpu()
        finally:
            self.policy.model.eval()
        return out

    def _forward_chunks(self, tokens: TokenBatch, trained: torch.Tensor | None) -> list[torch.Tensor]:
        """The micro-batches (rows sharing a prompt), each cut into parts of at most ``forward_tokens``
        tokens: rows x the longest row up to its last ``trained`` position (the forward's length)."""
        trained = tokens.mask > 0 if trained is None else trained  # (B, T)
        width = torch.where(trained.any(1), trained.shape[1] - trained.flip(1).int().argmax(1), 0)  # (B,)
        ends = (tokens.starts + width).tolist()
        parts = []
        for rows in tokens.chunks(self.optim.micro_batch_size):
            part: list[int] = []
            for row in rows.tolist():
                if part and (len(part) + 1) * max(ends[r] for r in (*part, row)) > self.forward_tokens:
                    parts.append(part)
                    part = []
                part.append(row)
            parts.append(part)
        return [torch.tensor(part, device=tokens.input_ids.device) for part in parts]

    def optim_step(self, adam: AdamParams) -> float | None:
        """One AdamW step on the accumulated gradient (clipped to ``grad_clip_norm``), then clear it.

        Returns the gradient norm before clipping, or None when it is not finite (no step is taken).
        """
        for group in self.optimizer.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        clip = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.item()

    def publish(self, run_dir: str | Path) -> str:
        """Save a checkpoint of the current step; return its name ``RUN@STEP`` (servable at once)."""
        self.save(run_dir)
        return f"{Path(run_dir).name}@{self.step}"

    def save(self, run_dir: str | Path) -> Path:
        """Write a checkpoint of the current step into ``run_dir`` (servable as ``RUN@STEP``)."""
        generator = torch.Generator(device=self.policy.device)
        return save_checkpoint(Path(run_dir), self.step, self.policy, self.state_dict(), generator,
                               {"tasks": {"draws": 0, "streams": []}, "run": Path(run_dir).name})

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]

    def _snapshot(self) -> dict:
        return {"params": [p.detach().clone() for p in self.params],
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    @torch.no_grad()
    def _restore(self, snapshot: dict | None) -> None:
        if snapshot is None:
            return
        for param, saved in zip(self.params, snapshot["params"]):
            param.copy_(saved)
        self.optimizer.load_state_dict(snapshot["optimizer"])

    def _discard_gradient(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _no_grad_logprobs(self, batch: TokenBatch, trajectories: list[Trajectory]) -> torch.Tensor:
        return self._forward_no_grad(batch)

    @torch.no_grad()
    def _reference_logprobs(self, batch: TokenBatch, trajectories: list[Trajectory]) -> torch.Tensor:
        with self.policy.reference():
            return self._forward_no_grad(batch)

    def _forward_no_grad(self, batch: TokenBatch) -> torch.Tensor:
        logp = torch.zeros_like(batch.mask)
        for rows in batch.chunks(self.optim.micro_batch_size):
            logp[rows] = self._logprobs(batch.select(rows))[0]
        return logp

    def _logprobs(self, micro: TokenBatch, with_entropy: bool = False, shifted: bool = True):
        """Log-probs of one chunk (its rows share a prompt): the prompt runs once when enabled.

        Activation checkpointing makes transformers drop the KV cache in training mode, which
        the shared-prompt path needs, so it falls back to the plain path then; so do datums whose
        targets are not the next input tokens.
        """
        lm = self.policy.causal_lm
        checkpointing = getattr(lm, "is_activation_checkpointing", False)
        shared = self.share_prompt and shifted and not checkpointing
        forward = shared_prefix_logprobs if shared else completion_logprobs
        width = micro.targets.shape[1]
        with packed_update(self.policy):  # the decode's packed weights in the forward
            logp, entropy = forward(lm, micro.trimmed(), self.temperature, with_entropy)
        pad = lambda t: None if t is None else F.pad(t, (0, width - t.shape[1]))  # noqa: E731
        return pad(logp), pad(entropy)


def _loss_fn(name: str, config: LossConfig):
    """(loss function, eps_low, eps_high) for a Tinker or grooves loss name."""
    if name in TINKER_LOSSES:
        loss, eps_low, eps_high = TINKER_LOSSES[name]
    elif name in LOSSES:
        loss, eps_low, eps_high = LOSSES[name], 0.2, 0.2
    else:
        known = ", ".join(sorted({*TINKER_LOSSES, *LOSSES}))
        raise ValueError(f"unknown loss_fn {name!r}; available: {known}")
    return (loss, eps_low if config.eps_low is None else config.eps_low,
            eps_high if config.eps_high is None else config.eps_high)
