"""Entry points: ``train(policy, tasks, reward, ...)`` from Python, ``run_config(config)`` for the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from grooves.algorithms.presets import Algorithm, preset
from grooves.policy.checkpoints import runs_root
from grooves.policy.policy import Policy
from grooves.progress import Reporter
from grooves.rewards.compose import Reward, as_reward, import_object
from grooves.tasks.sources import load_tasks, split_tasks
from grooves.training.config import ConfigError, RewardConfig, RunConfig, TasksConfig, parse_config
from grooves.training.loop import StopRule, TrainingRun
from grooves.training.runfolder import Run
from grooves.training.reward_config import ComponentBuildError, build_components
from grooves.training.tasksets import TaskSet
from grooves.types import Task


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def build_reward(config: RewardConfig) -> Reward:
    """The reward a config names; an unknown builtin, function or file is a ConfigError with its path."""
    from grooves.tasks.sources import BUILTIN

    components = []
    if config.builtin:
        if config.builtin not in BUILTIN:
            raise ConfigError(f"reward.builtin: unknown {config.builtin!r}; available: {', '.join(BUILTIN)}")
        components.extend(import_object(f"{BUILTIN[config.builtin]}:reward")().components)
    try:
        components.extend(build_components(config))
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
    return policy


def share_backbones(sets: list[TaskSet], policy: Policy) -> None:
    """Reward models on the policy's own base score with its weights (adapter off), not a copy."""
    from grooves.rewards.models import RewardModelComponent

    for task_set in sets:
        for component in task_set.reward.components:
            model = getattr(component, "model", None)
            if (isinstance(component, RewardModelComponent) and model.base is None
                    and model.config.get("backbone") == policy.base_spec):
                model.base = (policy.model, policy.tokenizer)


def env_task_set(config: RunConfig) -> TaskSet:
    """The task set of an [env] run: the env's tasks, its scores as reward components."""
    from grooves.envs import load_env
    from grooves.rewards.compose import EnvScore

    spec = config.env
    try:
        env = load_env(spec.name, **spec.options)
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


def run_config(config: RunConfig, *, runs: str | Path | None = None, out: str | Path | None = None,
               resume: bool = False, progress: bool = True, acknowledge: tuple[str, ...] = (),
               stop_rule: StopRule | None = None, resume_command: str = "grooves train CONFIG --resume",
               console: Console | None = None, policy: Policy | None = None) -> Run:
    """Run (or resume) the training described by a config, as ``grooves train`` does.

    ``policy``: sample and train this one instead of loading ``config.model`` (a remote policy,
    ``grooves.backend.client.RemotePolicy``, for ``[backend]``).

    ``acknowledge``: detectors whose alerts only warn from now on (``--ack`` on resume).
    ``console``: where progress and alerts go (default: stderr); see ``grooves.progress``.
    """
    from grooves.training.ddp import init_from_env

    init_from_env()  # under torchrun: join the group (and pick this rank's GPU) before the model loads
    sets = task_sets(config)
    Reporter(console, enabled=progress).phase("loading", f"model {config.model.spec}")
    policy = policy or load_policy(config, runs)
    share_backbones(sets, policy)
    run_dir = Path(out) if out else runs_root(runs) / config.name
    return TrainingRun(config, policy, sets, run_dir, resume=resume, progress=progress, console=console,
                       acknowledge=acknowledge, stop_rule=stop_rule, resume_command=resume_command).run()


def train(
    policy: Policy,
    tasks: str | Path | list[Task] | Any,
    reward: Reward | Any,
    algorithm: Algorithm | str | None = None,
    *,
    steps: int = 30,
    group_size: int = 8,
    tasks_per_step: int = 1,
    heldout: str | Path | list[Task] | None = None,
    name: str | None = None,
    runs: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    config: RunConfig | dict | None = None,
) -> Run:
    """RL-train ``policy`` (which needs a LoRA adapter) on ``tasks`` scored by ``reward``.

    ``tasks``: ``"builtin:titles"``, a .jsonl/.csv path, a list of dicts or a ``datasets``
    object. ``reward``: a function, a list of functions, ``{name: fn}`` or a ``Reward``.
    ``algorithm``: a preset name or ``grooves.algorithms.<preset>(...)``. Any other setting
    goes in ``config`` (a ``RunConfig`` or a dict shaped like the TOML file).
    """
    base = config if isinstance(config, RunConfig) else parse_config(config or {})
    reward = as_reward(reward)
    algorithm = preset(algorithm) if isinstance(algorithm, str) else (algorithm or base.algorithm)
    updates = {
        "name": name or base.name, "steps": steps, "algorithm": algorithm,
        "model": base.model.model_copy(update={"spec": policy.base_spec, "device": str(policy.device)}),
        "train": base.train.model_copy(update={"group_size": group_size, "tasks_per_step": tasks_per_step}),
        "tasks": TasksConfig(**{**base.tasks.model_dump(), "source": _describe(tasks),
                                "heldout": None if heldout is None else _describe(heldout)}),
        "reward": RewardConfig(components=[{"function": _qualname(getattr(c, "fn", type(c))), "name": c.name,
                                            "weight": c.weight, "required": c.required}
                                           for c in reward.components]),
    }
    config = RunConfig.model_validate({**base.model_dump(), **{k: v for k, v in updates.items()}})
    _check_rebuildable(config, tasks, heldout)
    t = config.tasks
    train_tasks, heldout_tasks = task_splits(tasks, heldout, t.heldout_fraction, config.seed)
    sets = [TaskSet("", train_tasks, heldout_tasks, reward, t.prompt_template, t.system)]
    share_backbones(sets, policy)
    return TrainingRun(config, policy, sets, runs_root(runs) / config.name, resume=resume, progress=progress,
                       resume_command=f"gr.train(..., name={config.name!r}, resume=True)").run()


def _check_rebuildable(config: RunConfig, tasks: Any, heldout: Any) -> None:
    """Ray workers and a sampler process build the tasks and the reward from the config alone:
    say so before training when what was passed from Python cannot be rebuilt that way."""
    where = ("[ray] rollout workers" if config.ray is not None else
             "the sampler process (train.async_sampler = 'process')"
             if config.train.max_off_policy_steps > 0 and config.train.async_sampler == "process" else None)
    if where is None:
        return
    problems = [f"{name} is a {type(value).__name__}" for name, value in (("tasks", tasks), ("heldout", heldout))
                if value is not None and not isinstance(value, (str, Path))]
    try:
        build_reward(config.reward)
    except Exception as error:  # noqa: BLE001 - reported below
        problems.append(f"the reward cannot be imported by name ({error})")
    if problems:
        raise ValueError(f"{where} build the tasks and the reward from the config in another process, so "
                         f"tasks must be a builtin name or a file path and reward functions importable "
                         f"module-level functions: {'; '.join(problems)}")


def _describe(source: Any) -> str:
    return str(source) if isinstance(source, (str, Path)) else f"<{type(source).__name__} from Python>"


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
