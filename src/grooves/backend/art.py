"""OpenPipe ART's ``Backend`` over grooves: an ART program trains on grooves by changing one line.

    backend = GroovesBackend()            # instead of art.LocalBackend()
    await model.register(backend)         # the rest of the program as it was

Each registered ``art.TrainableModel`` gets a ``TrainingSession`` (``grooves.training.session``):
the run folder ``RUNS/<model.name>`` (resumed when it holds a checkpoint, as ART's own backends
continue a model), the in-process OpenAI-compatible server that ``model.openai_client()`` talks
to, and grooves' trainer. ``backend.train(model, groups)`` trains with grooves' advantages and
loss on the exact token ids the server sampled: the server puts the prompt's and the
completion's ids on every ``Choice`` (``TokenIdsByDefault``), and an episode of several choices
is merged as ``Recorder.episode`` merges it (trained up to a prefix break, never dropped). A
``Choice`` without grooves' ids (made by another server, or built by hand) is rendered with the
chat template instead, like ART's own backends do, and counted in ``train/retokenized_turns``.

Written against ``openpipe-art`` 0.5.18 (``art/backend.py``, ``art/local/backend.py``,
``art/serverless/backend.py``); docs/art.md maps the names.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from grooves.policy.checkpoints import list_checkpoints, runs_root
from grooves.serve.capture import merge_turns
from grooves.training.datums import AdamParams, Datum
from grooves.training.session import TrainingSession
from grooves.training.sft_data import assistant_text, render_transcript
from grooves.types import Group, Trajectory

# ART's keyword arguments of train() that grooves accepts only at ART's default (LocalBackend 0.5.18)
_ART_DEFAULTS: dict[str, Any] = {
    "loss_fn_config": None, "normalize_advantages": True, "adam_params": None, "kl_penalty_coef": 0.0,
    "kl_penalty_reference_step": None, "kl_ref_adapter_path": None, "advantage_balance": 0.0,
    "scale_rewards": True, "importance_sampling_level": "token",
    "max_negative_advantage_importance_sampling_weight": None, "mask_prob_ratio": False, "kimi_k2_tau": None,
    "precalculate_logprobs": False, "allow_training_without_logprobs": False, "plot_tensors": False,
    "truncated_importance_sampling": None, "scale_learning_rate_by_reward_std_dev": False,
    "logprob_calculation_chunk_size": 1024, "packed_sequence_length": None,
    "num_trajectories_learning_rate_multiplier_power": 0.0, "save_checkpoint": True, "verbose": False,
}


class GroovesBackend:
    """ART's ``Backend`` protocol: ``register``, ``_prepare_backend_for_training``, ``train``,
    ``_train_sft``, ``_get_step``, ``_model_inference_name``, ``_delete_checkpoint_files``, ``close``."""

    def __init__(self, *, runs: str | Path | None = None, config: dict | None = None, algorithm: str | None = None,
                 api_key: str | None = None):
        """``runs``: the runs root (default ``$GROOVES_RUNS`` or ``./runs``); ``config``: a dict shaped
        like a run's TOML (lora, optim, monitors, alerts, sampling.temperature ...) for every model;
        ``algorithm``: a grooves preset (default: the config's, GRPO)."""
        restore_transformers()
        self.runs = runs_root(runs)
        self.config = config or {}
        self.algorithm = algorithm
        self.api_key = api_key
        self.sessions: dict[str, TrainingSession] = {}

    # --- the model and where it is served ----------------------------------------------

    async def register(self, model) -> None:
        """Open (or resume) the model's run folder and serve it; a prompted model needs nothing."""
        if not getattr(model, "trainable", False) or model.name in self.sessions:
            return
        restore_transformers()
        resume = bool(list_checkpoints(self.runs / model.name))
        session = TrainingSession(model.name, model.base_model, config=self.config, algorithm=self.algorithm,
                                  runs=self.runs, resume=resume, api_key=self.api_key, token_ids_by_default=True)
        session.add_alias(model.name)  # `model=model.name` answers from the newest adapter too
        self.sessions[model.name] = session
        model.base_path = str(session.run_dir / "art")  # ART's own logs (model.log) inside the run folder

    async def _prepare_backend_for_training(self, model, config=None) -> tuple[str, str]:
        """The in-process server's base URL and key (``config``, ART's vLLM settings, has no use here)."""
        session = self._session(model)
        _compatible_client(model, session)
        return session.base_url, session.api_key

    def _model_inference_name(self, model, step: int | None = None) -> str:
        """``NAME@STEP`` (the newest step when None), as ART's LocalBackend names its adapters."""
        return f"{model.name}@{self._newest_step(model) if step is None else step}"

    async def _get_step(self, model) -> int:
        return self._newest_step(model) if model.trainable else 0

    def _newest_step(self, model) -> int:
        """The session's step; for a model not open here, its newest checkpoint on disk (0 if none)."""
        session = self.sessions.get(model.name)
        if session is not None:
            return session.step
        found = list_checkpoints(self.runs / model.name)
        return found[-1][0] if found else 0

    async def _delete_checkpoint_files(self, model, steps_to_keep: list[int]) -> None:
        """Delete the model's checkpoints except ``steps_to_keep`` and the newest (which is served)."""
        session = self._session(model)
        keep = {*steps_to_keep, session.step}
        for step, folder in list_checkpoints(session.run_dir):
            if step not in keep:
                shutil.rmtree(folder)

    async def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()

    # --- training ------------------------------------------------------------------------

    async def train(self, model, trajectory_groups: Iterable, *, learning_rate: float | None = None,
                    loss_fn: str | None = None, epsilon: float | None = None, epsilon_high: float | None = None,
                    **options: Any):
        """One grooves step on ART's groups; returns ``art.types.LocalTrainResult(step, metrics)``.

        ``learning_rate``: this step's (default: the config's); ``loss_fn``, ``epsilon`` and
        ``epsilon_high`` must agree with the session's algorithm (choose it with
        ``GroovesBackend(algorithm=...)``); ART's other options are accepted at their defaults only."""
        from art.types import LocalTrainResult

        session = self._session(model)
        _check_options(session, loss_fn, epsilon, epsilon_high, options)
        groups, counts = to_groups(session, list(trajectory_groups))
        if not groups:
            raise ValueError("no trajectory to train on: every group was empty or had no assistant Choice")
        metrics = session.train(groups, learning_rate=learning_rate)
        metrics.update(counts)
        checkpoint = dict(list_checkpoints(session.run_dir)).get(session.step)
        return LocalTrainResult(step=session.step, metrics=_finite(metrics),
                                checkpoint_path=None if checkpoint is None else str(checkpoint))

    async def _train_sft(self, model, trajectories: Iterable, config, dev_config=None,
                         verbose: bool = False) -> AsyncIterator[dict[str, float]]:
        """Cross-entropy on the assistant turns (rendered as rollouts render them), one AdamW step per
        batch of ``config.batch_size`` ("auto": 8); the whole call is one grooves step and checkpoint."""
        session = self._session(model)
        examples = [render_transcript(session.policy, t.messages(), t.tools) for t in trajectories]
        size = 8 if config.batch_size == "auto" else int(config.batch_size)
        batches = [examples[i: i + size] for i in range(0, len(examples), size)]
        rates = config.learning_rate if isinstance(config.learning_rate, list) else [config.learning_rate] * len(batches)
        if len(rates) < len(batches):
            raise ValueError(f"learning_rate: {len(rates)} values for {len(batches)} batches")
        losses = []
        for batch, rate in zip(batches, rates):
            loss = session.on_model(lambda b=batch, r=rate: _sft_batch(session, b, r))
            losses.append(loss)
            yield {"loss/train": loss, "learning_rate": rate}
        session.end_step({"loss/sft": sum(losses) / max(1, len(losses)), "train/sft_examples": float(len(examples))})

    def _session(self, model) -> TrainingSession:
        session = self.sessions.get(model.name)
        if session is None:
            raise ValueError(f"model {model.name!r} is not registered with this GroovesBackend: "
                             f"await model.register(backend) first")
        return session


def restore_transformers() -> None:
    """``import art`` (0.5.18) replaces transformers' ``masking_utils._preprocess_mask_arguments``
    with a wrapper written for an older transformers (it takes ``cache_position``, which
    transformers 5 no longer passes), so every forward pass in the process fails. The wrapper
    exists for 3-D position ids, which grooves never passes: the original goes back."""
    from art.transformers import patches
    from transformers import masking_utils

    if masking_utils._preprocess_mask_arguments is patches._patched_preprocess_mask_arguments:
        masking_utils._preprocess_mask_arguments = patches._preprocess_mask_arguments


def _compatible_client(model, session: TrainingSession) -> None:
    """ART 0.5.18's ``model.openai_client()`` hands ``openai`` an ``httpx.Timeout``, which openai 3
    (built on ``httpx2``) refuses; with openai 3 the model gets ART's own client wrapper around a
    plain ``AsyncOpenAI`` instead (same URL, key, timeout and cost hook). Nothing else is changed."""
    import openai

    if int(openai.__version__.split(".")[0]) < 3:
        return
    from art.model import _OpenAIClientProxy

    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, timeout=1200)
    model._openai_client = _OpenAIClientProxy(client, model._record_openai_completion_costs,
                                              model._default_chat_completion_extra_body())


def to_groups(session: TrainingSession, art_groups: list) -> tuple[list[Group], dict[str, float]]:
    """ART's ``TrajectoryGroup`` objects as grooves groups, with counts of what could not be exact."""
    counts = {"train/retokenized_turns": 0.0, "train/trajectories_untrainable": 0.0}
    groups = []
    for index, art_group in enumerate(art_groups):
        trajectories = []
        for art_trajectory in art_group.trajectories:
            if art_trajectory.additional_histories:
                raise ValueError("additional_histories are not supported by GroovesBackend: give each history "
                                 "its own Trajectory")
            trajectory, rendered = to_trajectory(session, art_trajectory)
            if trajectory is None:
                counts["train/trajectories_untrainable"] += 1
                continue
            counts["train/retokenized_turns"] += rendered
            trajectories.append(trajectory)
        task = {"id": str(art_group.metadata.get("id", f"group-{index}")), **art_group.metadata}
        groups.append(Group(task=task, trajectories=trajectories))
    return [g for g in groups if g.trajectories], counts


def to_trajectory(session: TrainingSession, art_trajectory) -> tuple[Trajectory | None, int]:
    """One grooves trajectory from an ART one (its Choices are the model's turns), and how many turns
    had to be rendered; None when it has no Choice (ART trains nothing there either)."""
    from openai.types.chat.chat_completion import Choice

    messages: list[dict] = []
    turns, rendered = [], 0
    tools = art_trajectory.tools
    for item in art_trajectory.messages_and_choices:
        if not isinstance(item, Choice):  # a message dict (or an openai message object the agent kept)
            messages.append(item.model_dump(exclude_none=True) if hasattr(item, "model_dump") else dict(item))
            continue
        message = item.message.model_dump(exclude_none=True)
        turn = _choice_turn(messages, message, item)
        if turn is None:
            turn = _rendered_turn(session, messages, message, item.finish_reason, tools)
            rendered += 1
        turns.append(turn)
        messages.append(message)
    if not turns:
        return None, 0
    trajectory = merge_turns(turns, on_break="cut")
    trajectory.reward = math.nan if art_trajectory.reward is None else float(art_trajectory.reward)
    trajectory.metrics = {k: float(v) for k, v in art_trajectory.metrics.items() if isinstance(v, (int, float))}
    trajectory.metadata.update({k: v for k, v in art_trajectory.metadata.items() if k not in trajectory.metadata})
    return trajectory, rendered


def _choice_turn(messages: list[dict], message: dict, choice) -> Trajectory | None:
    """A turn from a Choice that carries the server's ids (``TokenIdsByDefault``), else None."""
    ids = (choice.model_extra or {}).get("grooves") or {}
    if "completion_token_ids" not in ids or "prompt_token_ids" not in ids:
        return None
    return Trajectory(messages=[*messages, message], prompt_ids=list(ids["prompt_token_ids"]),
                      completion_ids=list(ids["completion_token_ids"]),
                      completion_mask=[1] * len(ids["completion_token_ids"]),
                      logprobs=list(ids["completion_logprobs"]), finish_reason=choice.finish_reason or "stop",
                      metadata={"policy_step": ids.get("adapter_step") or 0})


def _rendered_turn(session: TrainingSession, messages: list[dict], message: dict, finish: str | None,
                   tools) -> Trajectory:
    """A turn without the server's ids: the prompt through the chat template, the reply's text
    tokenised (plus the end-of-turn token); no sampler logprobs, so the current policy's stand in."""
    policy = session.policy
    completion = policy.tokenizer.encode(assistant_text(message), add_special_tokens=False)
    completion.append(policy.end_of_turn_id)
    return Trajectory(messages=[*messages, message], prompt_ids=policy.chat_ids(messages, tools),
                      completion_ids=completion, completion_mask=[1] * len(completion),
                      logprobs=[0.0] * len(completion), finish_reason=finish or "stop",
                      metadata={"retokenized": True})


def _sft_batch(session: TrainingSession, examples: list[Trajectory], learning_rate: float) -> float:
    """Token-mean cross-entropy of one batch's assistant tokens, and one AdamW step on it."""
    trainer = session.trainer
    tokens = sum(sum(t.completion_mask) for t in examples)
    if tokens == 0:
        return math.nan
    datums = []
    for t in examples:
        sequence, start = t.prompt_ids + t.completion_ids, len(t.prompt_ids) - 1
        weights = [0.0] * start + [m / tokens for m in t.completion_mask]
        datums.append(Datum(tokens=sequence[:-1], target_tokens=sequence[1:], weights=weights, start=start))
    out = trainer.forward_backward(datums, "cross_entropy")
    optim = trainer.optim
    trainer.optim_step(AdamParams(learning_rate, *optim.betas, weight_decay=optim.weight_decay,
                                  grad_clip_norm=optim.max_grad_norm))
    return out.loss


def _check_options(session: TrainingSession, loss_fn: str | None, epsilon: float | None,
                   epsilon_high: float | None, options: dict[str, Any]) -> None:
    """Refuse, naming it, any ART option that would change the training but that grooves would ignore."""
    for name, value in options.items():
        if name not in _ART_DEFAULTS:
            raise TypeError(f"GroovesBackend.train() got an unexpected keyword argument {name!r}")
        if value != _ART_DEFAULTS[name]:
            raise ValueError(f"{name}={value!r}: not supported by GroovesBackend (only ART's default, "
                             f"{_ART_DEFAULTS[name]!r}); grooves' own settings go in GroovesBackend(config=...)")
    algorithm = session.trainer.algorithm
    if loss_fn is not None and loss_fn != algorithm.name:
        raise ValueError(f"loss_fn={loss_fn!r}: this GroovesBackend trains with {algorithm.name!r}; "
                         f"choose the preset with GroovesBackend(algorithm={loss_fn!r})")
    for name, value, own in (("epsilon", epsilon, algorithm.eps_low), ("epsilon_high", epsilon_high,
                                                                        algorithm.eps_high)):
        if value is not None and value != own:
            raise ValueError(f"{name}={value}: the session's algorithm clips at {own}; set it with "
                             f"GroovesBackend(config={{'algorithm': {{...}}}})")


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    """ART's metric log rejects nothing, but NaN plots badly in its W&B charts: leave NaN out."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v == v}
