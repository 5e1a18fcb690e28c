"""What a run config builds: the policy, the reward, the task sets.

The loop, the SFT run, the sampler process and Ray workers all import these at module level,
so each builds exactly what ``grooves train`` builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from grooves.envs import load_env
from grooves.policy.policy import Policy
from grooves.rewards.compose import EnvScore, Reward, import_object
from grooves.rewards.config import ComponentBuildError, build_components
from grooves.rewards.models import RewardModelComponent
from grooves.serve.local import local_url
from grooves.tasks.sources import BUILTIN, load_tasks, split_tasks
from grooves.training.config import ConfigError, RewardConfig, RunConfig
from grooves.training.tasksets import TaskSet
from grooves.types import Task


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def build_reward(config: RewardConfig) -> Reward:
    """The reward a config names; an unknown builtin, function or file is a ConfigError with its path."""
    components = []
    if config.builtin:
        if config.builtin not in BUILTIN:
            raise ConfigError(f"reward.builtin: unknown {config.builtin!r}; available: {', '.join(BUILTIN)}")
        components.extend(import_object(f"{BUILTIN[config.builtin]}:reward")().components)
    try:
        components.extend(build_components(config, local_url))
    except ComponentBuildError as error:
        raise ConfigError(f"reward.{error}") from None
    try:
        return Reward(components, max_concurrency=config.max_concurrency)
    except ValueError as error:
        raise ConfigError(f"reward.components: {error} (give each component its own name = ...)") from None


def task_splits(source: Any, heldout: Any, fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks: a built-in set's own split, a given held-out source, or a hash split."""
    if isinstance(source, (str, Path)) and str(source).startswith("builtin:") and heldout is None:
        return load_tasks(source, "train"), load_tasks(source, "heldout")
    tasks = load_tasks(source, "train" if str(source).startswith("builtin:") else None)
    if heldout is not None:
        return tasks, load_tasks(heldout)
    return split_tasks(tasks, fraction, seed)


def load_policy(config: RunConfig, runs: str | Path | None = None) -> Policy:
    policy = Policy.load(config.model.spec, lora=config.lora, adapter=config.model.adapter,
                         device=resolve_device(config.model.device), dtype=config.model.dtype,
                         seed=config.seed, runs=runs)
    if config.model.gradient_checkpointing:
        policy.causal_lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    algorithm = getattr(config, "algorithm", None)  # an SFT config has none
    if algorithm is not None and algorithm.reference == "adapter":  # now, before a resume loads later weights
        policy.pin_reference()
    return policy


def share_backbones(sets: list[TaskSet], policy: Policy) -> None:
    """Reward models on the policy's own base score with its weights (adapter off), not a copy."""
    for task_set in sets:
        for component in task_set.reward.components:
            model = getattr(component, "model", None)
            if (isinstance(component, RewardModelComponent) and model.base is None
                    and model.config.get("backbone") == policy.base_spec):
                model.base = (policy.model, policy.tokenizer)


def env_task_set(config: RunConfig) -> TaskSet:
    """The task set of an [env] run: the env's tasks, its scores as reward components."""
    spec = config.env
    try:
        env = load_env(spec.name, user=spec.user, **spec.options)
    except (KeyError, ValueError, TypeError) as error:
        raise ConfigError(f"env: {error.args[0] if error.args else error}") from None
    weights = {**env.weights, **spec.weights}
    unknown = sorted(set(spec.weights) - set(env.weights))
    if unknown:
        raise ConfigError(f"env.weights: {', '.join(unknown)} not scores of {spec.name!r}; "
                          f"allowed: {', '.join(env.weights)}")
    components = [EnvScore(name, weight) for name, weight in weights.items()]
    extra = build_reward(config.reward).components if "reward" in config.model_fields_set else []
    reward = Reward(components + extra, max_concurrency=config.reward.max_concurrency)
    train = env.tasks("train", spec.train_tasks, seed=config.seed)
    heldout = env.tasks("heldout", spec.heldout_tasks, seed=config.seed) if spec.heldout_tasks else []
    return TaskSet("", train, heldout, reward, env=env)


def task_sets(config: RunConfig) -> list[TaskSet]:
    """The run's task sets: one from [tasks] and [reward], one from [env], or one per [[mix]] table."""
    if config.env is not None:
        return [env_task_set(config)]
    entries = [(m.name, m.tasks, m.reward, m.weight) for m in config.mix] or [("", config.tasks, config.reward, 1.0)]
    sets = []
    for name, tasks, reward, weight in entries:
        train, heldout = task_splits(tasks.source, tasks.heldout, tasks.heldout_fraction, config.seed)
        sets.append(TaskSet(name, train, heldout, build_reward(reward), tasks.prompt_template, tasks.system, weight))
    return sets
