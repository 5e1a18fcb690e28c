"""Entry points: ``train(policy, tasks, reward, ...)`` from Python, ``run_config(config)`` for the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from grooves.algorithms.presets import Algorithm, preset
from grooves.policy.checkpoints import runs_root
from grooves.policy.policy import Policy
from grooves.progress import Reporter
from grooves.rewards.compose import Reward, as_reward
from grooves.training.build import build_reward, load_policy, share_backbones, task_sets, task_splits
from grooves.training.config import RewardConfig, RunConfig, TasksConfig, parse_config
from grooves.training.ddp import init_from_env
from grooves.training.loop import StopRule, TrainingRun
from grooves.training.runfolder import Run
from grooves.training.step import RLStep
from grooves.training.tasksets import TaskSet
from grooves.training.trainer import Trainer
from grooves.types import Task


def run_config(config: RunConfig, *, runs: str | Path | None = None, out: str | Path | None = None,
               resume: bool = False, progress: bool = True, acknowledge: tuple[str, ...] = (),
               stop_rule: StopRule | None = None, resume_command: str = "grooves train CONFIG --resume",
               console: Console | None = None, policy: Policy | None = None,
               trainer: type[RLStep] | None = None) -> Run:
    """Run (or resume) the training described by a config, as ``grooves train`` does.

    ``policy``: sample and train this one instead of loading ``config.model``; ``trainer``: the class
    that updates it (for ``[backend]``: ``grooves.backend.client.RemotePolicy`` and ``RemoteTrainer``).

    ``acknowledge``: detectors whose alerts only warn from now on (``--ack`` on resume).
    ``console``: where progress and alerts go (default: stderr); see ``grooves.progress``.
    """
    init_from_env()  # under torchrun: join the group (and pick this rank's GPU) before the model loads
    sets = task_sets(config)
    Reporter(console, enabled=progress).phase("loading", f"model {config.model.spec}")
    policy = policy or load_policy(config, runs)
    share_backbones(sets, policy)
    run_dir = Path(out) if out else runs_root(runs) / config.name
    return TrainingRun(config, policy, sets, run_dir, resume=resume, progress=progress, console=console,
                       acknowledge=acknowledge, stop_rule=stop_rule, resume_command=resume_command,
                       trainer=trainer or Trainer).run()


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
