"""grooves' training loop as a client of a Tinker-compatible service (``[backend] url``).

``RemotePolicy`` and ``RemoteTrainer`` stand in for the local ``Policy`` and ``Trainer``: the loop
samples, scores, monitors and logs as before, but sampling and training run on the service
through the official ``tinker`` SDK. Envs, rewards, judges and monitors stay on this machine.

The step is the local ``Trainer.train_step``'s, over the wire:

- advantages from the same ``prepare_batch`` (the algorithm's estimator, overlong shaping);
- one datum per trajectory; the old log-probs are the sampler's (the samples come from the
  adapter being trained, so this is the on-policy ratio of 1 the local trainer uses);
- Tinker's losses are plain sums with no per-token weights, so the algorithm's aggregation
  (token mean, sequence mean of token means) is folded into the advantages: the clipped
  ``ppo``/``cispo`` per-token terms are linear in the advantage, so ``w_t * loss_t(A)`` equals
  ``loss_t(w_t * A)``;
- ``num_iterations`` passes of ``forward_backward`` + ``optim_step``, then
  ``save_weights_and_get_sampling_client`` so the next rollouts sample the new adapter.

Not supported (a clear error before the run starts): the ``gspo`` loss (sequence-level ratio),
a KL penalty (``beta > 0``: no reference log-probs over the wire), agent envs (multi-turn
decoding is local only), and resuming a run (its checkpoints name the service's saved states,
but ``--resume`` reloads local adapter files).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from grooves.algorithms import AGGREGATIONS
from grooves.policy.policy import Policy
from grooves.policy.sampler import Completion, Sampling
from grooves.training.trainer import AdamParams, drop_stale, lr_factor, prepare_batch
from grooves.types import Group

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
        self.trainer_class = RemoteTrainer  # TrainingRun builds this instead of the local Trainer
        self._saves = 0

    @property
    def has_adapter(self) -> bool:
        return True

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


class RemoteTrainer:
    """``Trainer.train_step`` through the service (see the module docstring); same constructor."""

    def __init__(self, policy: RemotePolicy, algorithm, optim, *, temperature: float = 1.0,
                 max_completion_length: int = 64, total_steps: int = 1, use_sampler_logprobs: bool = False,
                 share_prompt: bool = True, kl_every: int = 10, max_staleness: int | None = None):
        self.policy = policy
        self.algorithm = algorithm
        self.optim = optim
        self.max_completion_length = max_completion_length
        self.total_steps = total_steps
        self.max_staleness = max_staleness
        self.step = 0

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        from tinker import types

        start = time.perf_counter()
        alg, optim = self.algorithm, self.optim
        lr = optim.learning_rate * lr_factor(self.step, optim.warmup_steps, self.total_steps, optim.lr_schedule)
        groups, stale = drop_stale(groups, self.step, self.max_staleness)
        prepared = prepare_batch(groups, alg, self.max_completion_length)
        metrics = {**prepared.metrics, "train/trajectories_stale": float(stale), "train/lr": lr}
        if not prepared.trajectories or not bool((prepared.advantages != 0).any()) \
                or prepared.metrics.get("alerts/nonfinite_stats"):
            metrics["train/skipped"] = 1.0
            self.step += 1
            return metrics
        datums = self._datums(prepared.trajectories, prepared.advantages)
        # the local trainer's AdamW settings, eps included (the SDK's default eps is 1e-12)
        adam = types.AdamParams(learning_rate=lr, beta1=optim.betas[0], beta2=optim.betas[1], eps=AdamParams.eps,
                                weight_decay=optim.weight_decay, grad_clip_norm=optim.max_grad_norm)
        config = {"clip_low_threshold": 1.0 - alg.eps_low, "clip_high_threshold": 1.0 + alg.eps_high}
        training = self.policy.training
        for _ in range(alg.num_iterations):
            backward = training.forward_backward(datums, REMOTE_LOSSES[alg.loss], loss_fn_config=config)
            optim_result = training.optim_step(adam)
            out = backward.result()
            metrics["loss/policy"] = out.metrics.get("loss:sum", float("nan"))
            if "clipfrac:mean" in out.metrics:
                metrics["clipfrac"] = out.metrics["clipfrac:mean"]
            stepped = optim_result.result().metrics or {}
            if "grad_norm:mean" in stepped:
                metrics["train/grad_norm"] = stepped["grad_norm:mean"]
            if stepped.get("skipped_nonfinite:sum"):
                metrics.update({"alerts/nan_loss": 1.0, "train/skipped": 1.0})
                break
        self.policy.sampling_client = training.save_weights_and_get_sampling_client().result()
        tokens = sum(len(t.completion_ids) for t in prepared.trajectories)
        elapsed = time.perf_counter() - start
        metrics.update({"train/step_time": elapsed, "train/update_tokens_per_s": tokens / elapsed})
        self.step += 1
        return metrics

    def _datums(self, trajectories, advantages: torch.Tensor) -> list:
        """Per-token datums; the aggregation weight times the advantage is each token's advantage."""
        from tinker import types

        width = max(len(t.completion_ids) for t in trajectories)
        mask = torch.zeros(len(trajectories), width)  # (B, T) model-written completion tokens
        for row, t in enumerate(trajectories):
            mask[row, : len(t.completion_ids)] = torch.tensor(t.completion_mask, dtype=torch.float)
            if self.algorithm.mask_truncated and t.truncated:
                mask[row] = 0.0
        weights = AGGREGATIONS[self.algorithm.aggregation](mask, self.max_completion_length)  # (B, T)
        datums = []
        for row, t in enumerate(trajectories):
            sequence = t.prompt_ids + t.completion_ids
            context, c = len(t.prompt_ids) - 1, len(t.completion_ids)
            datums.append(types.Datum(
                model_input=types.ModelInput.from_ints(sequence[:-1]),
                loss_fn_inputs={"target_tokens": sequence[1:],
                                "logprobs": [0.0] * context + list(t.logprobs),
                                "advantages": [0.0] * context + (weights[row, :c] * advantages[row]).tolist()}))
        return datums

    def state_dict(self) -> dict:
        return {"step": self.step, "remote_model_id": self.policy.training.model_id}

    def load_state_dict(self, state: dict) -> None:
        raise RemoteError("resuming a run trained through [backend] is not supported yet: its adapter and "
                          "optimizer are saved states on the service (see the checkpoint's adapter/remote.json)")
