"""grooves' training loop as a client of a Tinker-compatible service (``[backend] url``).

``RemotePolicy`` and ``RemoteTrainer`` stand in for the local ``Policy`` and ``Trainer``: the loop
samples, scores, monitors and logs as before, but sampling and training run on the service
through the official ``tinker`` SDK. Envs, rewards, judges and monitors stay on this machine.

The step is the local one (``grooves.training.step.RLStep``: advantages, skip rule, datums,
mini-batches, off-policy correction, rollback); only the primitives go over the wire:

- ``forward_backward``: Tinker's losses are plain sums with no per-token weights, so each token's
  weight (the aggregation, times the importance weight when the correction is on) is folded into
  its advantage: the clipped ``ppo``/``cispo`` per-token terms are linear in a non-negative
  multiple of the advantage, so ``w_t * loss_t(A)`` equals ``loss_t(w_t * A)``. Where the old
  policy is the current one (one pass, no correction) its log-probs are the sampler's, Tinker's
  own convention (the samples come from the adapter being trained); where the step needs the
  trainer's own log-probs (several passes, the correction) they come from the service's
  ``forward``;
- ``optim_step``: the local trainer's AdamW settings, eps included;
- the rollback of a step with several AdamW steps: ``save_state`` before, ``load_state_with_optimizer``
  after a non-finite one;
- after an update, ``save_weights_and_get_sampling_client`` so the next rollouts sample it.

Not supported (a clear error before the run starts): the ``gspo`` loss (sequence-level ratio), the
dual clip, a KL penalty (``beta > 0``: no reference log-probs over the wire; the logged ``kl`` is
off for the same reason), agent envs (multi-turn decoding is local only), and resuming a run (its
checkpoints name the service's saved states, but ``--resume`` reloads local adapter files).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from grooves.algorithms import k3_kl
from grooves.policy.logprobs import TokenBatch
from grooves.policy.policy import Policy
from grooves.policy.sampler import Completion, Sampling
from grooves.training.datums import AdamParams, Datum, DatumBatch, ForwardBackwardOutput, LossConfig
from grooves.training.step import RLStep, add_metric, correct
from grooves.types import Trajectory

# grooves' loss names -> the Tinker loss that computes the same per-token terms
REMOTE_LOSSES = {"ppo_clip": "ppo", "cispo": "cispo"}
API_KEY_ENV = "TINKER_API_KEY"


class RemoteError(ValueError):
    """A run that cannot go through a service as configured; the message says which setting."""


def check_remote(config) -> None:
    """Refuse, before anything starts, what the remote step cannot do."""
    alg = config.algorithm
    if alg.loss not in REMOTE_LOSSES:
        raise RemoteError(f"algorithm.loss: {alg.loss!r} cannot run through [backend] (Tinker's losses are "
                          f"per token); use one of {', '.join(REMOTE_LOSSES)}")
    if alg.dual_clip is not None:
        raise RemoteError("algorithm.dual_clip: Tinker's ppo loss has no dual clip; leave dual_clip unset "
                          "with [backend]")
    if alg.beta > 0:
        raise RemoteError("algorithm.beta: a KL penalty needs the base model's log-probs, which a Tinker "
                          "service does not return; set beta = 0 with [backend]")
    if config.env is not None:
        raise RemoteError("env: agent environments sample turn by turn on the local model; [backend] runs "
                          "take [tasks] or [[mix]] tasks only")
    if not os.environ.get(API_KEY_ENV):
        raise RemoteError(f"backend.url: set the service's API key in ${API_KEY_ENV}")


class RemotePolicy(Policy):
    """A policy whose adapter lives on a Tinker-compatible service; the tokenizer is local."""

    def __init__(self, url: str, base_model: str, rank: int, seed: int, api_key: str | None = None):
        import tinker

        self.service = tinker.ServiceClient(base_url=url, api_key=api_key or os.environ.get(API_KEY_ENV))
        self.training = self.service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed).result()
        super().__init__(None, self.training.get_tokenizer(), base_model)
        self.url = url
        self.sampling_client = self.training.save_weights_and_get_sampling_client().result()
        self._saves = 0

    @property
    def has_adapter(self) -> bool:
        return True

    def trainable_parameters(self):
        raise RemoteError("a RemotePolicy's adapter lives on the service: train it with RemoteTrainer "
                          "(run_config(..., trainer=RemoteTrainer)), not the local Trainer")

    def sampler(self) -> RemoteSampler:
        return RemoteSampler(self)

    def save_adapter(self, folder: str | Path) -> None:
        """``save_state`` on the service; the folder records where (the weights stay there)."""
        self._saves += 1
        path = self.training.save_state(f"grooves-{self._saves:05d}-{int(time.time())}").result().path
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "remote.json").write_text(json.dumps({"service": self.url, "base_model": self.base_spec,
                                                        "model_id": self.training.model_id, "state": path}))

    def close(self) -> None:
        self.service.close("success").result(timeout=60)


class RemoteSampler:
    """``Sampler.generate`` over the service: one ``sample`` request per prompt, all in flight."""

    def __init__(self, policy: RemotePolicy):
        self.policy = policy

    def generate(self, prompts: list, n: int = 1, sampling: Sampling = Sampling(),
                 generator: torch.Generator | None = None) -> list[list[Completion]]:
        from tinker import types

        encoded = [p if p and isinstance(p[0], int) else self.policy.chat_ids(
            [{"role": "user", "content": p}] if isinstance(p, str) else p) for p in prompts]
        futures = []
        for ids in encoded:
            # a seed per request from the run's generator: a rerun samples the same tokens
            seed = sampling.seed if generator is None else int(torch.randint(2**31 - 1, (1,), generator=generator))
            params = types.SamplingParams(max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                          top_p=sampling.top_p, seed=seed, stop=list(sampling.stop) or None)
            futures.append(self.policy.sampling_client.sample(types.ModelInput.from_ints(ids), n, params))
        results = []
        for ids, future in zip(encoded, futures):
            results.append([Completion(self.policy.decode(list(s.tokens)), list(s.tokens), list(s.logprobs or []),
                                       "length" if s.stop_reason == "length" else "stop", list(ids))
                            for s in future.result().sequences])
        return results


class RemoteTrainer(RLStep):
    """``RLStep`` over the service's primitives (see the module docstring); the local ``Trainer``'s
    constructor."""

    def __init__(self, policy: RemotePolicy, algorithm, optim=None, **settings):
        if settings.get("world") is not None:
            raise RemoteError("a remote trainer runs in one process; torch.distributed is for local trainers")
        super().__init__(algorithm, optim, **{**settings, "kl_every": 0})  # no reference log-probs remotely
        self.policy = policy
        self._states = 0

    def forward_backward(self, datums: list[Datum], loss_fn: str, config: LossConfig | None = None,
                         *, loss_positions_only: bool = False) -> ForwardBackwardOutput:
        """One Tinker ``forward_backward`` with each token's weight folded into its advantage."""
        from tinker import types

        config = config or LossConfig()
        if loss_fn not in REMOTE_LOSSES:
            raise RemoteError(f"loss {loss_fn!r} cannot run through a Tinker service; use one of "
                              f"{', '.join(REMOTE_LOSSES)}")
        batch = DatumBatch.build(datums)
        mask = (batch.weights != 0).float()  # (B, T) tokens in the loss
        out = ForwardBackwardOutput(0.0, [torch.zeros(0)] * len(datums))
        sampler, old = batch.sampler_logprobs, batch.old_logprobs
        if old is None and sampler is not None and config.is_level is None:
            old, sampler = sampler, None  # the sampler is the current adapter: Tinker's own old policy
        elif old is None:  # the old policy is the current one: its log-probs from the service
            old = self._service_logprobs(datums, batch)
        scale = batch.weights
        if sampler is not None:
            weight = correct(out, old, sampler, mask, config)
            if weight is not None:
                scale = scale * weight
        advantages = batch.advantages * scale  # (B, T)
        out.active = float(((scale != 0) & (batch.advantages != 0)).sum().item())
        wire = [types.Datum(model_input=types.ModelInput.from_ints(d.tokens),
                            loss_fn_inputs={"target_tokens": d.target_tokens,
                                            "logprobs": _positions(d, old[row]),
                                            "advantages": _positions(d, advantages[row])})
                for row, d in enumerate(datums)]
        eps_low = 0.2 if config.eps_low is None else config.eps_low
        eps_high = 0.2 if config.eps_high is None else config.eps_high
        result = self.policy.training.forward_backward(
            wire, REMOTE_LOSSES[loss_fn],
            loss_fn_config={"clip_low_threshold": 1.0 - eps_low, "clip_high_threshold": 1.0 + eps_high}).result()
        out.loss = result.metrics.get("loss:sum", float("nan"))
        out.finite = math.isfinite(out.loss)
        logp = _padded(result.loss_fn_outputs, datums, batch)
        add_metric(out, "approx_kl", k3_kl(old, logp), mask)
        if "clipfrac:mean" in result.metrics:
            out.sums["clipfrac"], out.counts["clipfrac"] = result.metrics["clipfrac:mean"] * mask.sum().item(), \
                mask.sum().item()
        for row, d in enumerate(datums):
            out.logprobs[row] = logp[row, : batch.lengths[row]]
        return out

    def optim_step(self, adam: AdamParams) -> float | None:
        """The service's AdamW step; None when it skipped a non-finite gradient."""
        from tinker import types

        stepped = self.policy.training.optim_step(types.AdamParams(
            learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps,
            weight_decay=adam.weight_decay, grad_clip_norm=adam.grad_clip_norm)).result().metrics or {}
        if stepped.get("skipped_nonfinite:sum"):
            return None
        return stepped.get("grad_norm:mean", 0.0)

    def _no_grad_logprobs(self, batch: TokenBatch, trajectories: list[Trajectory]) -> torch.Tensor:
        """The trainer's log-probs of each completion token, from the service's ``forward``."""
        datums = [Datum((t.prompt_ids + t.completion_ids)[:-1], (t.prompt_ids + t.completion_ids)[1:],
                        start=len(t.prompt_ids) - 1) for t in trajectories]
        return self._service_logprobs(datums, DatumBatch.build(datums))

    def _reference_logprobs(self, batch: TokenBatch, trajectories: list[Trajectory]) -> torch.Tensor:
        raise RemoteError("algorithm.beta: a KL penalty needs the base model's log-probs, which a Tinker "
                          "service does not return")

    def _service_logprobs(self, datums: list[Datum], batch: DatumBatch) -> torch.Tensor:
        """``(B, T)`` log-probs over each datum's loss positions, from one forward-only request."""
        from tinker import types

        wire = [types.Datum(model_input=types.ModelInput.from_ints(d.tokens),
                            loss_fn_inputs={"target_tokens": d.target_tokens}) for d in datums]
        result = self.policy.training.forward(wire, "cross_entropy").result()
        return _padded(result.loss_fn_outputs, datums, batch)

    def _snapshot(self) -> str:
        self._states += 1
        return self.policy.training.save_state(f"grooves-step-{self.step}-{self._states}").result().path

    def _restore(self, snapshot: str | None) -> None:
        if snapshot is not None:
            self.policy.training.load_state_with_optimizer(snapshot).result()

    def _published(self) -> None:
        self.policy.sampling_client = self.policy.training.save_weights_and_get_sampling_client().result()

    def state_dict(self) -> dict:
        return {"step": self.step, "remote_model_id": self.policy.training.model_id}

    def load_state_dict(self, state: dict) -> None:
        raise RemoteError("resuming a run trained through [backend] is not supported yet: its adapter and "
                          "optimizer are saved states on the service (see the checkpoint's adapter/remote.json)")


def _positions(datum: Datum, values: torch.Tensor) -> list[float]:
    """A datum's per-position list: zeros before ``start``, then ``values`` over its loss positions."""
    return [0.0] * datum.start + values[: len(datum.tokens) - datum.start].tolist()


def _padded(outputs: list, datums: list[Datum], batch: DatumBatch) -> torch.Tensor:
    """The service's per-position ``logprobs`` as ``(B, T)`` over each datum's loss positions."""
    logp = torch.zeros_like(batch.weights)
    for row, (output, d) in enumerate(zip(outputs, datums, strict=True)):
        values = torch.tensor(output["logprobs"].tolist(), dtype=logp.dtype)[d.start:]
        logp[row, : len(values)] = values
    return logp
