"""One RL step, planned once for every trainer: ``train_step(groups) -> metrics``.

``RLStep`` is the step over the trainer primitives (``forward_backward``, ``optim_step``) and a
few hooks. The local ``Trainer`` (``grooves.training.trainer``) answers them with the policy in
this process, ``RemoteTrainer`` (``grooves.backend.client``) through a Tinker-compatible service,
so both share the advantages, the skip rule, the datums, the mini-batches, the off-policy
correction and the rollback after a non-finite loss.

The step: drop trajectories whose reward failed (NaN) and groups left with fewer than 2,
shape rewards (DAPO overlong punishment), compute advantages per group, then
``num_iterations`` passes of micro-batched forward/backward with one AdamW step per pass.

Deviations worth knowing:
- With ``num_iterations == 1`` the old policy *is* the current one, so ``old_logp`` is
  ``logp.detach()`` (ratio 1, as in TRL); with more passes it is recomputed once, without
  gradient, before the first pass (or taken from the sampler when ``use_sampler_logprobs``).
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
- Off-policy correction (``grooves.algorithms.offpolicy``): when the sampler and the trainer
  can differ (``use_sampler_logprobs``, a trajectory whose ``policy_version`` is older than
  ``step``, ``remote_sampler``) each token's policy loss is multiplied by the truncated (or
  masked) weight ``exp(old - sampler)``, and the old policy is the trainer's, not the sampler's.
  ``train/sampler_kl`` and the ratio quantiles are logged whenever the old policy is the trainer's.
- ``minibatches = m`` splits the batch (in order) into m parts, each one AdamW step with its own
  aggregation; the old logprobs of every part are computed before the first step.
- A mini-batch in which no token with a non-zero advantage (or a KL penalty) keeps a non-zero
  weight (``mask_truncated``, the IS mask) takes no AdamW step; ``train/skipped_steps`` counts them.
- Under ``torch.distributed`` (``grooves.training.ddp``) every rank gets the same groups, trains
  on its contiguous shard of each mini-batch with weights normalised over the whole mini-batch,
  and the gradients are summed across ranks before the step: the 1-process update.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from grooves.algorithms import AGGREGATIONS, ESTIMATORS, Algorithm, overlong_penalty
from grooves.algorithms.offpolicy import importance_weights, sampler_kl
from grooves.policy.logprobs import TokenBatch, build_token_batch
from grooves.training.config import OptimConfig
from grooves.training.datums import AdamParams, Datum, ForwardBackwardOutput, LossConfig, trajectory_datums
from grooves.types import Group, Trajectory


class RLStep:
    """``train_step`` over a trainer's primitives. A subclass provides ``forward_backward``,
    ``optim_step``, ``_no_grad_logprobs``, ``_reference_logprobs``, ``_snapshot``/``_restore``
    and ``policy`` (for its device); ``_published`` runs after an update (a remote trainer hands
    the new weights to its sampler there)."""

    def __init__(self, algorithm: Algorithm, optim: OptimConfig | None = None, *, temperature: float = 1.0,
                 max_completion_length: int = 64, total_steps: int = 1, use_sampler_logprobs: bool = False,
                 share_prompt: bool = True, kl_every: int = 10, max_staleness: int | None = None,
                 minibatches: int = 1, remote_sampler: bool = False, world=None):
        self.algorithm = algorithm
        self.optim = optim or OptimConfig()
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.total_steps = total_steps
        self.use_sampler_logprobs = use_sampler_logprobs
        self.share_prompt = share_prompt
        self.kl_every = kl_every
        self.max_staleness = max_staleness
        self.minibatches = minibatches
        self.remote_sampler = remote_sampler  # the sampler is a service whose numerics differ from ours
        self.world = world  # a grooves.training.ddp.World under torch.distributed, else None
        self.step = 0

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """Update the adapter once from scored groups; return the step's metrics."""
        start = time.perf_counter()
        lr = self.optim.learning_rate * lr_factor(self.step, self.optim.warmup_steps, self.total_steps,
                                                  self.optim.lr_schedule)
        groups, stale = drop_stale(groups, self.step, self.max_staleness)
        prepared = prepare_batch(groups, self.algorithm, self.max_completion_length)
        metrics = {**prepared.metrics, "train/trajectories_stale": float(stale), "train/lr": lr}
        no_signal = self.algorithm.beta == 0 and not bool((prepared.advantages != 0).any())
        if not prepared.trajectories or no_signal or prepared.metrics.get("alerts/nonfinite_stats"):
            # nothing to learn: AdamW momentum must not move the adapter
            metrics["train/skipped"] = 1.0
            self.step += 1
            return metrics
        batch = build_token_batch(prepared.trajectories, self.policy.device)
        if self.algorithm.mask_truncated:
            truncated = torch.tensor([t.truncated for t in prepared.trajectories], device=batch.mask.device)
            batch.mask = batch.mask * (~truncated)[:, None]
        level = self.correction_level(prepared.trajectories)
        metrics["train/is_correction"] = float(level is not None)
        versions = [t.policy_version for t in prepared.trajectories if t.policy_version is not None]
        if versions:
            metrics["train/policy_lag"] = float(self.step - min(versions))
        metrics.update(self._optimise(prepared.trajectories, batch, prepared.advantages.to(self.policy.device), lr,
                                      level))
        if "train/skipped" not in metrics:
            self._published()
        tokens = sum(len(t.completion_ids) for t in prepared.trajectories)
        elapsed = time.perf_counter() - start
        metrics.update({"train/step_time": elapsed, "train/update_tokens_per_s": tokens / elapsed})
        self.step += 1
        return metrics

    def correction_level(self, trajectories: list[Trajectory]) -> str | None:
        """``"token"``/``"sequence"`` when the off-policy correction is on for this batch, else None."""
        choice = self.algorithm.is_correction
        if choice != "auto":
            return None if choice == "off" else choice
        stale = any(t.policy_version is not None and t.policy_version < self.step for t in trajectories)
        return "token" if self.use_sampler_logprobs or self.remote_sampler or stale else None

    def _published(self) -> None:
        """After an update: nothing here; a remote trainer makes the new weights sampleable."""

    def _optimise(self, trajectories: list[Trajectory], batch: TokenBatch, advantages: torch.Tensor,
                  lr: float, level: str | None = None) -> dict[str, float]:
        """``num_iterations`` passes over the batch's ``minibatches``: forward_backward + optim_step each."""
        alg = self.algorithm
        minis = self._minibatch_datums(trajectories, batch, advantages, level)
        adam = AdamParams(lr, *self.optim.betas, weight_decay=self.optim.weight_decay,
                          grad_clip_norm=self.optim.max_grad_norm)
        stats = StepStats()
        # A later step that fails must not leave the earlier steps' updates behind.
        snapshot = self._snapshot() if alg.num_iterations * len(minis) > 1 else None
        self._discard_gradient()
        for iteration in range(alg.num_iterations):
            first = iteration == 0
            config = LossConfig(alg.eps_low, alg.eps_high, kl_coef=alg.beta, entropy=first, is_level=level,
                                is_mode=alg.is_mode, is_cap=alg.is_cap, dual_clip=alg.dual_clip,
                                kl_ratio=alg.kl_ratio_level(), loss_options=alg.loss_options())
            for datums in minis:
                # the KL is logged from the first pass; later passes need it only as a penalty
                later = datums if alg.beta > 0 else [replace(d, ref_logprobs=None) for d in datums]
                out = self._forward_backward_shard(datums if first else later, alg.loss, config)
                if out.finite and out.active == 0:  # no gradient: AdamW momentum must not move the adapter
                    self._discard_gradient()
                    stats.skipped_steps += 1
                    stats.merge(out, log_kl=first)
                    continue
                grad_norm = self.optim_step(adam) if out.finite else None
                if grad_norm is None:
                    self._restore(snapshot)
                    return {"alerts/nan_loss": 1.0, "train/skipped": 1.0}
                stats.merge(out, log_kl=first)
                stats.grad_norm = grad_norm
                stats.steps += 1
        return stats.metrics()

    def _minibatch_datums(self, trajectories: list[Trajectory], batch: TokenBatch, advantages: torch.Tensor,
                          level: str | None) -> list[list[Datum]]:
        """Each mini-batch's datums (this rank's shard of it), old and reference logprobs included:
        all computed before the first update, so every mini-batch's old policy is the same."""
        alg = self.algorithm
        track_kl = alg.beta > 0 or (self.kl_every > 0 and self.step % self.kl_every == 0)
        many = alg.num_iterations > 1 or self.minibatches > 1
        sampler_is_old = self.use_sampler_logprobs and level is None
        minis = []
        for part in torch.arange(len(batch)).tensor_split(min(self.minibatches, len(batch))):
            weights = AGGREGATIONS[alg.aggregation](batch.mask[part], self.max_completion_length)  # (b, T)
            local = part if self.world is None else self.world.shard(part)
            if len(local) == 0:
                minis.append([])
                continue
            sub = batch.select(local.to(batch.mask.device))
            rows = local - part[0]  # the shard's rows within the mini-batch
            chosen = [trajectories[i] for i in local.tolist()]
            if sampler_is_old:
                old_logp = sub.sampler_logprobs
            else:
                old_logp = self._no_grad_logprobs(sub, chosen) if many else None
            ref_logp = self._reference_logprobs(sub, chosen) if track_kl else None
            datums = trajectory_datums(chosen, sub, weights[rows.to(weights.device)],
                                       advantages[local.to(advantages.device)], old_logp, ref_logp,
                                       None if sampler_is_old else sub.sampler_logprobs)
            if alg.beta == 0 and not track_kl:
                # A row with advantage 0 adds exactly 0 to the gradient (no KL term): skip its forward
                # and backward. The weights above were normalised over the whole mini-batch, so the
                # update is the same; ``entropy`` and ``clipfrac`` are then means over the rows with a signal.
                signal = advantages[local.to(advantages.device)].tolist()
                datums = [d for d, a in zip(datums, signal, strict=True) if a != 0]
            minis.append(datums)
        return minis

    def _forward_backward_shard(self, datums: list[Datum], loss_fn: str, config: LossConfig) -> ForwardBackwardOutput:
        """``forward_backward`` on this rank's datums; under DDP the gradients and diagnostics are
        summed over the ranks (a rank with no datums adds zeros)."""
        out = (self.forward_backward(datums, loss_fn, config, loss_positions_only=True) if datums
               else ForwardBackwardOutput(0.0, []))
        if self.world is not None:
            self.world.reduce(out, self.params)
        return out

    def _discard_gradient(self) -> None:
        """Drop an accumulated gradient that must not be applied (a remote one lives on the service)."""


def correct(out: ForwardBackwardOutput, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor,
            config: LossConfig) -> torch.Tensor | None:
    """Log the sampler/trainer gap into ``out``; with ``config.is_level``, return the truncated (or
    masked) importance weight ``exp(old - sampler)`` per token that multiplies the policy loss."""
    old = old.detach()
    add_metric(out, "sampler_kl", sampler_kl(old, sampler, mask), mask)
    add_metric(out, "is_exact", (old == sampler).float(), mask)
    correction = importance_weights(old, sampler, mask, config.is_level or "token", config.is_mode, config.is_cap)
    out.ratios.append(correction.ratios.cpu())
    if config.is_level is None:
        return None
    add_metric(out, "is_masked", correction.masked.float(), mask)
    add_metric(out, "is_truncated", correction.truncated.float(), mask)
    return correction.weights


def add_metric(out: ForwardBackwardOutput, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
    """Add a diagnostic's sum and token count over ``mask`` to ``out``."""
    with torch.no_grad():
        # where, not a product: a value off the mask may be inf (a garbage old logprob there)
        out.sums[name] = out.sums.get(name, 0.0) + torch.where(mask > 0, values, 0.0).sum().item()
        out.counts[name] = out.counts.get(name, 0.0) + mask.sum().item()


@dataclass
class PreparedBatch:
    trajectories: list[Trajectory]
    advantages: torch.Tensor  # (N,)
    metrics: dict[str, float]


def drop_stale(groups: list[Group], step: int, max_staleness: int | None) -> tuple[list[Group], int]:
    """Leave out trajectories sampled more than ``max_staleness`` updates ago (``metadata["policy_step"]``)."""
    if max_staleness is None:
        return groups, 0
    kept, dropped = [], 0
    for group in groups:
        fresh = [t for t in group.trajectories if step - _version(t, step) <= max_staleness]
        dropped += len(group.trajectories) - len(fresh)
        kept.append(Group(group.task, fresh, group.metadata))
    return kept, dropped


def _version(trajectory: Trajectory, default: int) -> int:
    """The step whose adapter sampled it: ``policy_version``, else ``metadata["policy_step"]``."""
    if trajectory.policy_version is not None:
        return trajectory.policy_version
    return trajectory.metadata.get("policy_step", default)


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


class StepStats:
    """Token-weighted means of diagnostics over all micro-batches and passes."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self.losses: list[float] = []
        self.grad_norm = 0.0
        self.steps = 0  # AdamW steps taken
        self.skipped_steps = 0  # mini-batches without a gradient (no AdamW step)
        self.ratios: list[torch.Tensor] = []

    _NAMES = {"approx_kl": "train/approx_kl", "sampler_kl": "train/sampler_kl", "is_exact": "train/is_ratio_exact_frac",
              "is_masked": "train/is_masked_frac", "is_truncated": "train/is_truncated_frac"}
    _FIRST_PASS = {"kl", "sampler_kl", "is_exact", "is_masked", "is_truncated"}

    def merge(self, out: ForwardBackwardOutput, log_kl: bool) -> None:
        if log_kl:
            self.ratios.extend(out.ratios)
        for name, total in out.sums.items():
            if name in self._FIRST_PASS and not log_kl:
                continue
            key = self._NAMES.get(name, name)
            self.sums[key] = self.sums.get(key, 0.0) + total
            self.counts[key] = self.counts.get(key, 0.0) + out.counts[name]
        self.losses.append(out.loss)

    def metrics(self) -> dict[str, float]:
        out = {"loss/policy": sum(self.losses) / max(1, len(self.losses)), "train/grad_norm": self.grad_norm,
               "train/skipped_steps": float(self.skipped_steps)}
        if self.steps == 0:
            out["train/skipped"] = 1.0
        for name, total in self.sums.items():
            out[name] = total / max(self.counts[name], 1.0)
        ratios = torch.cat(self.ratios) if self.ratios else torch.zeros(0)
        if ratios.numel():
            p50, p95 = torch.quantile(ratios.double(), torch.tensor([0.5, 0.95], dtype=torch.float64)).tolist()
            out.update({"train/is_ratio/p50": p50, "train/is_ratio/p95": p95,
                        "train/is_ratio/max": ratios.max().item(), "train/is_ratio/min": ratios.min().item()})
        return out
