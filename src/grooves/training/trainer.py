"""One policy update from groups made anywhere: ``Trainer.train_step(groups) -> metrics``.

It is a thin layer over the trainer's primitives, in the shape Tinker made standard:
``forward_backward(datums, loss_fn, config)`` (per-token datums; gradients accumulate across
calls), ``optim_step(adam)`` and ``publish(run_dir)`` (the adapter becomes ``RUN@STEP``).
``train_step`` turns groups into datums whose ``weights`` carry the algorithm's aggregation,
so its loss is the same weighted sum of per-token losses that ``forward_backward`` computes for
Tinker's losses (which are plain sums).

The step: drop trajectories whose reward failed (NaN) and groups left with fewer than 2,
shape rewards (DAPO overlong punishment), compute advantages per group, then
``num_iterations`` passes of micro-batched forward/backward with one AdamW step per pass.

Deviations worth knowing:
- With ``num_iterations == 1`` the old policy *is* the current one, so ``old_logp`` is
  ``logp.detach()`` (ratio 1, as in TRL); with more passes it is recomputed once, without
  gradient, before the first pass (or taken from the sampler when ``use_sampler_logprobs``).
- Training log-probs use the sampling temperature, matching the sampler's logprobs.
- A non-finite loss or gradient norm skips the step: the adapter and optimizer state are
  left as they were before the step (earlier passes are undone) and ``alerts/nan_loss = 1``.
- A batch whose advantages are all zero (and ``beta == 0``) is skipped: it has no gradient,
  but an AdamW step would still move the adapter through its momentum.
- Rewards so large that their group statistics overflow (1e300 squared is inf in float64,
  and an advantage past 3.4e38 is inf in float32) skip the step with
  ``alerts/nonfinite_stats = 1``: a std of inf would otherwise make every advantage 0 and
  the skip look like a batch without signal.
- ``kl`` (to the base model, the adapter disabled) is logged every ``kl_every`` steps even
  when ``beta == 0``; that costs one forward pass without gradient.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from grooves.algorithms import AGGREGATIONS, ESTIMATORS, LOSSES, Algorithm, k3_kl, overlong_penalty
from grooves.algorithms.losses import TINKER_LOSSES
from grooves.policy.logprobs import TokenBatch, build_token_batch, completion_logprobs, shared_prefix_logprobs
from grooves.policy.policy import Policy
from grooves.training.config import OptimConfig
from grooves.training.datums import Datum, DatumBatch, trajectory_datums
from grooves.types import Group, Trajectory


@dataclass
class PreparedBatch:
    trajectories: list[Trajectory]
    advantages: torch.Tensor  # (N,)
    metrics: dict[str, float]


@dataclass
class LossConfig:
    """Settings of one ``forward_backward`` call's loss."""

    eps_low: float | None = None  # None = the loss's default (Tinker's 0.2 for ppo and cispo)
    eps_high: float | None = None
    kl_coef: float = 0.0  # adds kl_coef * k3(logp, ref_logprobs) per token
    entropy: bool = False  # report the token-mean entropy (costs a softmax over the vocabulary)


@dataclass
class ForwardBackwardOutput:
    loss: float  # the summed loss of every datum
    logprobs: list[torch.Tensor]  # per datum, positions start..N-1
    sums: dict[str, float] = field(default_factory=dict)  # diagnostics over the loss's tokens
    counts: dict[str, float] = field(default_factory=dict)
    finite: bool = True  # False: a non-finite loss; every accumulated gradient was dropped

    def metrics(self) -> dict[str, float]:
        """Tinker-style metric names: ``name:reduction``."""
        out = {"loss:sum": self.loss}
        out.update({f"{name}:mean": total / max(self.counts[name], 1.0) for name, total in self.sums.items()})
        return out


@dataclass
class AdamParams:
    """One ``optim_step``'s AdamW settings (decoupled weight decay). The defaults are torch's, as
    ``train_step`` has always used; Tinker's SDK sends its own (beta2 0.95, eps 1e-12)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping


class Trainer:
    """Holds the optimizer of a policy's adapter and performs updates; the LR follows ``step``."""

    def __init__(self, policy: Policy, algorithm: Algorithm, optim: OptimConfig | None = None, *,
                 temperature: float = 1.0, max_completion_length: int = 64, total_steps: int = 1,
                 use_sampler_logprobs: bool = False, share_prompt: bool = True, kl_every: int = 10,
                 max_staleness: int | None = None):
        if not policy.has_adapter:
            raise ValueError("training needs a LoRA adapter: Policy.load(spec, lora=LoRA(rank=8))")
        optim = optim or OptimConfig()
        self.policy = policy
        self.algorithm = algorithm
        self.optim = optim
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.use_sampler_logprobs = use_sampler_logprobs
        self.share_prompt = share_prompt
        self.kl_every = kl_every
        self.max_staleness = max_staleness
        self.params = policy.trainable_parameters()
        self.total_steps = total_steps
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.learning_rate, betas=optim.betas,
                                           weight_decay=optim.weight_decay)
        self.step = 0

    # --- primitives ----------------------------------------------------------------

    def forward_backward(self, datums: list[Datum], loss_fn: str, config: LossConfig | None = None,
                         *, backward: bool = True, loss_positions_only: bool = False) -> ForwardBackwardOutput:
        """Sum of ``weights * loss`` over every token of every datum; its gradient is *added* to the
        adapter's (call ``optim_step`` to apply it). ``loss_fn``: Tinker's ``cross_entropy``,
        ``importance_sampling``, ``ppo``, ``cispo`` or grooves' ``ppo_clip``, ``gspo``.
        ``loss_positions_only``: log-probs only where a weight is non-zero (0 elsewhere in the
        output), which skips the output head on an agent's tool results and env text."""
        loss, eps_low, eps_high = _loss_fn(loss_fn, config := config or LossConfig())
        batch = DatumBatch.build(datums, self.policy.device)
        out = ForwardBackwardOutput(0.0, [torch.zeros(0)] * len(datums))
        self.policy.model.train(backward)
        try:
            for rows in batch.tokens.chunks(self.optim.micro_batch_size):
                micro = batch.select(rows)
                tokens = replace(micro.tokens, mask=(micro.weights != 0).float()) if loss_positions_only else micro.tokens
                with torch.set_grad_enabled(backward):
                    logp, entropy = self._logprobs(tokens, with_entropy=config.entropy, shifted=batch.shifted)
                    mask = (micro.weights != 0).float()  # (b, T) tokens in the loss
                    old = logp.detach() if micro.old_logprobs is None else micro.old_logprobs
                    terms = loss(logp, old, micro.advantages, mask, eps_low, eps_high)
                    per_token = terms.per_token
                    if micro.ref_logprobs is not None:
                        kl = k3_kl(logp, micro.ref_logprobs)
                        if config.kl_coef > 0:
                            per_token = per_token + config.kl_coef * kl
                        _add(out, "kl", kl, mask)
                    chunk_loss = (per_token * micro.weights).sum()
                if not torch.isfinite(chunk_loss):
                    self.optimizer.zero_grad(set_to_none=True)
                    out.finite = False
                    return out
                if backward:
                    chunk_loss.backward()
                out.loss += chunk_loss.item()
                _add(out, "clipfrac", terms.clipped.float(), mask)
                _add(out, "approx_kl", k3_kl(old, logp.detach()), mask)
                if entropy is not None:
                    _add(out, "entropy", entropy, mask)
                for i, row in enumerate(rows.tolist()):
                    out.logprobs[row] = logp[i, : batch.lengths[row]].detach().cpu()
        finally:
            self.policy.model.eval()
        return out

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

    # --- the RL step on top ----------------------------------------------------------

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """Update the adapter once from scored groups; return the step's metrics."""
        start = time.perf_counter()
        lr = self.optim.learning_rate * lr_factor(self.step, self.optim.warmup_steps, self.total_steps,
                                                  self.optim.lr_schedule)
        groups, stale = drop_stale(groups, self.step, self.max_staleness)
        prepared = prepare_batch(groups, self.algorithm, self.max_completion_length)
        prepared.metrics["train/trajectories_stale"] = float(stale)
        metrics = {**prepared.metrics, "train/lr": lr}
        no_signal = self.algorithm.beta == 0 and not bool((prepared.advantages != 0).any())
        if not prepared.trajectories or no_signal or prepared.metrics.get("alerts/nonfinite_stats"):  # nothing to learn: AdamW momentum must not move the adapter
            metrics["train/skipped"] = 1.0
            self.step += 1
            return metrics
        batch = build_token_batch(prepared.trajectories, self.policy.device)
        if self.algorithm.mask_truncated:
            truncated = torch.tensor([t.truncated for t in prepared.trajectories], device=batch.mask.device)
            batch.mask = batch.mask * (~truncated)[:, None]
        metrics.update(self._optimise(prepared.trajectories, batch, prepared.advantages.to(self.policy.device), lr))
        tokens = sum(len(t.completion_ids) for t in prepared.trajectories)
        elapsed = time.perf_counter() - start
        metrics.update({"train/step_time": elapsed, "train/update_tokens_per_s": tokens / elapsed})
        self.step += 1
        return metrics

    def save(self, run_dir: str | Path) -> Path:
        """Write a checkpoint of the current step into ``run_dir`` (servable as ``RUN@STEP``)."""
        from grooves.training.checkpoint import save_checkpoint

        generator = torch.Generator(device=self.policy.device)
        return save_checkpoint(Path(run_dir), self.step, self.policy, self.state_dict(), generator,
                               {"tasks": {"draws": 0, "streams": []}, "run": Path(run_dir).name})

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]

    def _optimise(self, trajectories: list[Trajectory], batch: TokenBatch, advantages: torch.Tensor,
                  lr: float) -> dict[str, float]:
        """``num_iterations`` passes of forward_backward + optim_step over the batch's datums."""
        alg = self.algorithm
        weights = AGGREGATIONS[alg.aggregation](batch.mask, self.max_completion_length)  # (B, T)
        old_logp = self._old_logprobs(batch)
        track_kl = alg.beta > 0 or (self.kl_every > 0 and self.step % self.kl_every == 0)
        ref_logp = self._reference_logprobs(batch) if track_kl else None
        datums = trajectory_datums(trajectories, batch, weights, advantages, old_logp, ref_logp)
        if alg.beta == 0 and not track_kl:
            # A row with advantage 0 adds exactly 0 to the gradient (no KL term): skip its forward
            # and backward. The weights above were normalised over the whole batch, so the update
            # is the same; ``entropy`` and ``clipfrac`` are then means over the rows with a signal.
            datums = [d for d, a in zip(datums, advantages.tolist(), strict=True) if a != 0]
        adam = AdamParams(lr, *self.optim.betas, weight_decay=self.optim.weight_decay,
                          grad_clip_norm=self.optim.max_grad_norm)
        stats = _Stats()
        # A later pass that fails must not leave the earlier passes' updates behind.
        snapshot = self._snapshot() if alg.num_iterations > 1 else None
        self.optimizer.zero_grad(set_to_none=True)
        for iteration in range(alg.num_iterations):
            first = iteration == 0
            config = LossConfig(alg.eps_low, alg.eps_high, kl_coef=alg.beta, entropy=first)
            # the KL is logged from the first pass; later passes need it only as a penalty
            later = datums if alg.beta > 0 else _without_ref(datums)
            out = self.forward_backward(datums if first else later, alg.loss, config, loss_positions_only=True)
            grad_norm = self.optim_step(adam) if out.finite else None
            if grad_norm is None:
                self._restore(snapshot)
                return {"alerts/nan_loss": 1.0, "train/skipped": 1.0}
            stats.merge(out, log_kl=first)
            stats.grad_norm = grad_norm
        return stats.metrics()

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

    @torch.no_grad()
    def _old_logprobs(self, batch: TokenBatch) -> torch.Tensor | None:
        if self.use_sampler_logprobs:
            return batch.sampler_logprobs
        if self.algorithm.num_iterations == 1:
            return None
        return self._forward_no_grad(batch)

    @torch.no_grad()
    def _reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
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


def _add(out: ForwardBackwardOutput, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    with torch.no_grad():
        out.sums[name] = out.sums.get(name, 0.0) + (values * mask).sum().item()
        out.counts[name] = out.counts.get(name, 0.0) + mask.sum().item()


def _without_ref(datums: list[Datum]) -> list[Datum]:
    return [replace(d, ref_logprobs=None) for d in datums]


def drop_stale(groups: list[Group], step: int, max_staleness: int | None) -> tuple[list[Group], int]:
    """Leave out trajectories sampled more than ``max_staleness`` updates ago (``metadata["policy_step"]``)."""
    if max_staleness is None:
        return groups, 0
    kept, dropped = [], 0
    for group in groups:
        fresh = [t for t in group.trajectories if step - t.metadata.get("policy_step", step) <= max_staleness]
        dropped += len(group.trajectories) - len(fresh)
        kept.append(Group(group.task, fresh, group.metadata))
    return kept, dropped


def prepare_batch(groups: list[Group], alg: Algorithm, max_completion_length: int) -> PreparedBatch:
    """Keep scored trajectories, shape rewards, compute advantages (flat, group-indexed)."""
    kept: list[Trajectory] = []
    group_index: list[int] = []
    dropped_trajectories = skipped_groups = 0
    for group in groups:
        scored = [t for t in group.trajectories if not math.isnan(t.reward)]
        dropped_trajectories += len(group.trajectories) - len(scored)
        if len(scored) < 2:
            skipped_groups += 1
            continue
        gid = len(set(group_index))
        kept.extend(scored)
        group_index.extend([gid] * len(scored))
    metrics = {"train/trajectories_unscored": float(dropped_trajectories),
               "train/groups_skipped": float(skipped_groups)}
    if not kept:
        return PreparedBatch([], torch.zeros(0), metrics)
    rewards = torch.tensor([t.reward for t in kept], dtype=torch.float64)
    if alg.overlong_buffer > 0:
        lengths = torch.tensor([sum(t.completion_mask) for t in kept])  # model tokens (env turns excluded)
        buffer = max(1, int(alg.overlong_buffer * max_completion_length))
        penalty = overlong_penalty(lengths, max_completion_length, buffer, alg.overlong_penalty).double()
        rewards = rewards + penalty
        metrics["train/overlong_penalty"] = penalty.mean().item()
    advantages = ESTIMATORS[alg.advantage](rewards, torch.tensor(group_index), alg.adv_eps).float()
    if not (torch.isfinite(rewards.square().sum()) and torch.isfinite(advantages).all()):
        metrics["alerts/nonfinite_stats"] = 1.0
        return PreparedBatch(kept, torch.zeros_like(advantages), metrics)
    metrics["train/advantage_abs"] = advantages.abs().mean().item()
    return PreparedBatch(kept, advantages, metrics)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


class _Stats:
    """Token-weighted means of diagnostics over all micro-batches and passes."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self.losses: list[float] = []
        self.grad_norm = 0.0

    _NAMES = {"approx_kl": "train/approx_kl"}

    def merge(self, out: ForwardBackwardOutput, log_kl: bool) -> None:
        for name, total in out.sums.items():
            if name == "kl" and not log_kl:
                continue
            key = self._NAMES.get(name, name)
            self.sums[key] = self.sums.get(key, 0.0) + total
            self.counts[key] = self.counts.get(key, 0.0) + out.counts[name]
        self.losses.append(out.loss)

    def metrics(self) -> dict[str, float]:
        out = {"loss/policy": sum(self.losses) / max(1, len(self.losses)), "train/grad_norm": self.grad_norm}
        for name, total in self.sums.items():
            out[name] = total / max(self.counts[name], 1.0)
        return out
