"""The run configuration: one pydantic model, read from TOML, every field described.

Unknown keys are rejected with their path (``train.lerning_rate: Extra inputs are not
permitted``); ``grooves train`` prints such errors and exits with code 2. The resolved
configuration is written to each run folder as ``config.toml``. ``docs/config.md`` is
generated from these descriptions.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticUndefined

from grooves.algorithms.presets import PRESETS, Algorithm
from grooves.config_base import Section
from grooves.monitors.config import MonitorsConfig
from grooves.policy.checkpoints import is_checkpoint_name
from grooves.policy.lora import LoRA
from grooves.policy.models import BUNDLED_DEFAULT
from grooves.rewards.config import COMPONENT_KINDS, EndpointConfig, RewardConfig
from grooves.training.placement import BackendConfig, EngineConfig, RayConfig


class ModelConfig(Section):
    spec: str = Field(BUNDLED_DEFAULT, description="Base model: 'bundled:smollm2-135m-instruct', "
                      "'tiny', a local Hugging Face folder, a hub id, or a checkpoint RUN@STEP.")
    adapter: str | None = Field(None, description="Start from this adapter instead of a fresh LoRA: a PEFT "
                                "folder or a checkpoint RUN@STEP (e.g. an SFT run's); it is trained further, with "
                                "its own LoRA settings.")
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and compute dtype. Keep float32 on CPU (bf16 matmul is very slow there).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")


class TasksConfig(Section):
    source: str = Field("builtin:titles", description="'builtin:titles', or a .jsonl / .csv file of tasks.")
    heldout: str | None = Field(None, description="Held-out tasks: a file, or None to split them off "
                                "`source` (built-in sets bring their own split).")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of `source` held out when "
                                    "`heldout` is not given (split by a seeded hash of each task id).")
    prompt_template: str | None = Field(None, description="Python format string over the task's columns "
                                        "that builds the user message, e.g. 'Summarise: {text}'. Without "
                                        "it each task needs a 'prompt' column.")
    system: str | None = Field(None, description="System message put before each prompt.")


class EnvConfig(Section):
    """An agent environment (`grooves env list`): it brings its own tasks, tools and scores."""

    name: str = Field(description="A registered env: 'helpdesk', 'search', one a package registers "
                      "(entry-point group 'grooves.envs'), or a class in a file: 'my_env.py:Shop'.")
    options: dict[str, Any] = Field(default_factory=dict, description="Env settings, e.g. max_turns, "
                                    "max_tokens (generated tokens per rollout, all turns), tool_timeout_s, "
                                    "db_seed.")
    train_tasks: int = Field(200, ge=1, description="Tasks generated for training.")
    heldout_tasks: int = Field(40, ge=0, description="Held-out tasks generated for validation.")
    weights: dict[str, float] = Field(default_factory=dict, description="Weight of each env score in the "
                                      "total (default: the env's own weights); 0 logs a score only.")
    user: str | dict[str, Any] | None = Field(None, description="Who answers the agent's text turns: "
                                              "'scripted' (each task's user_turns), or a table {kind = 'llm', "
                                              "base_url, model, ...} (grooves.envs.users); default: the env's own.")


class MixConfig(Section):
    """One task set of a multi-task run: its tasks, its reward and its share of the batches."""

    name: str = Field(description="Short name; metrics go under task/<name>/.")
    weight: float = Field(1.0, gt=0, description="Relative share of the tasks drawn from this set.")
    tasks: TasksConfig = Field(description="Where this set's tasks come from (as [tasks]).")
    reward: RewardConfig = Field(description="How this set's completions are scored (as [reward]).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", value):
            raise ValueError("must be 1-40 letters, digits, '_' or '-'")
        return value


class SamplingConfig(Section):
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for training rollouts (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_prompt_length: int = Field(1024, ge=1, description="Tasks whose prompt is longer (tokens) are "
                                   "skipped and counted (train/prompts_skipped).")
    max_completion_length: int = Field(64, ge=1, description="New tokens per completion.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (the EOS token always stops).")
    val_temperature: float = Field(0.0, ge=0, description="Temperature for validation (0 = greedy).")


class OptimConfig(Section):
    learning_rate: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward; gradients "
                                  "accumulate over micro-batches into one optimizer step.")


class TrainConfig(Section):
    group_size: int = Field(8, ge=2, description="Completions sampled per task (G).")
    tasks_per_step: int = Field(1, ge=1, description="Tasks (groups) per training step.")
    balance_by: str | None = Field(None, description="A task column (e.g. 'kind') whose values take turns "
                                   "in the draw: each round one task of every value, so a rare kind is trained as "
                                   "often as a common one and a batch of at least as many tasks holds each. "
                                   "None = one seeded order over all tasks.")
    use_sampler_logprobs: bool = Field(False, description="Use the sampler's logprobs as the old policy "
                                       "(for rollouts made elsewhere); otherwise they are recomputed.")
    share_prompt: bool = Field(True, description="Run each group's shared prompt once in the training "
                               "forward (same numbers as the plain path, fewer tokens).")
    max_staleness: int | None = Field(None, ge=0, description="Leave out (and count) trajectories sampled "
                                      "more than this many updates ago (metadata policy_step); None = keep all.")
    max_off_policy_steps: int = Field(0, ge=0, description="Asynchronous pipeline: sampling runs up to this "
                                      "many updates ahead of training (k), so the rollouts of the next step overlap "
                                      "the current update; each trajectory records the adapter version that sampled "
                                      "it, and ones more than k updates old are left out and counted "
                                      "(rollout/dropped_stale). 0 = the synchronous loop. See docs/scale.md.")
    async_sampler: Literal["thread", "process"] = Field("thread", description="Where the async pipeline "
                                                         "(max_off_policy_steps >= 1) samples in a run without "
                                                         "[ray]: 'thread', a sampler copy of the policy in this "
                                                         "process; 'process', a child process with its own copy "
                                                         "and half the torch threads, so decoding does not wait "
                                                         "for the trainer's interpreter (what it gains on a CPU "
                                                         "depends on how much the synchronous step leaves the "
                                                         "cores idle; a Python script using it needs the "
                                                         "`if __name__ == \"__main__\":` guard). See docs/scale.md.")
    minibatches: int = Field(1, ge=1, description="Optimizer steps per rollout batch: the batch is split "
                             "in order into this many near-equal mini-batches, each its own "
                             "AdamW step, so the PPO/GSPO/CISPO clip acts after the first; the old logprobs are "
                             "computed once before the first. 1 = one step per batch.")
    max_failed_steps: int = Field(3, ge=0, description="End the run (exit code 1) after this many steps in a "
                                  "row that trained nothing because every reward failed or the reward statistics "
                                  "were not finite; 0 = never.")


class RunLogConfig(Section):
    """What every run folder logs and keeps (``grooves train`` and ``grooves sft``)."""

    save_every: int = Field(10, ge=1, description="Checkpoint every N steps (and at the end).")
    val_every: int = Field(10, ge=1, description="Validate every N steps (and at step 0 and the end).")
    val_size: int = Field(64, ge=0, description="Held-out tasks per validation (0 = no validation).")
    tensorboard: bool = Field(True, description="Write TensorBoard events to <run>/tensorboard.")
    wandb_project: str | None = Field(None, description="Also log to this W&B project (needs grooves[wandb]).")
    keep_checkpoints: int = Field(0, ge=0, description="Keep only the newest N checkpoints (0 = keep all).")


class LogConfig(RunLogConfig):
    kl_every: int = Field(10, ge=0, description="Log `kl` to the base model every N steps even when beta = 0 "
                          "(one extra forward pass without gradient, about a tenth of a CPU step); 0 = only "
                          "when beta > 0.")


Action = Literal["warn", "pause", "stop"]


class AlertsConfig(Section):
    """What the run does when a reward-hacking detector ([monitors]) fires."""

    policy: Action = Field("warn", description="'warn': show and log the alert, go on; 'pause': checkpoint, "
                           "print the evidence and the command to resume, stop; 'stop': checkpoint and end the run.")
    detectors: dict[str, Action] = Field(default_factory=dict, description="Per-detector policy overriding "
                                         "`policy`, e.g. {collapse = \"pause\"}.")
    act_on: Literal["warn", "critical"] = Field("warn", description="Pause or stop only for alerts at least "
                                                "this severe; milder ones are shown as warnings.")

    @field_validator("detectors")
    @classmethod
    def _known(cls, value: dict[str, str]) -> dict[str, str]:
        known = set(MonitorsConfig.model_fields) - {"enabled", "cooldown_steps"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown detector(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        return value


class RunConfig(Section):
    """Everything one training run needs; `grooves train CONFIG.toml` reads this."""

    name: str = Field("run", description="Run folder name under the runs root.")
    seed: int = Field(0, description="Seeds LoRA init, task order and sampling.")
    steps: int = Field(30, ge=1, description="Training steps.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoRA = Field(default_factory=LoRA)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    reward: RewardConfig = Field(default_factory=lambda: RewardConfig(builtin="titles"))
    env: EnvConfig | None = Field(None, description="Train an agent in an environment ([env]); replaces "
                                  "[tasks]. The reward is the env's scores, plus any [[reward.components]].")
    mix: list[MixConfig] = Field(default_factory=list, description="Several task sets for one adapter, "
                                 "each with its own reward and weight ([[mix]] tables); replaces [tasks] and "
                                 "[reward].")
    algorithm: Algorithm = Field(default_factory=lambda: PRESETS["grpo"]())
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    monitors: MonitorsConfig = Field(default_factory=MonitorsConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    backend: BackendConfig | None = Field(None, description="Sample and train on a Tinker-compatible service "
                                          "([backend]); rewards, judges and monitors stay local.")
    ray: RayConfig | None = Field(None, description="Sample on Ray workers ([ray]; or `grooves train --ray`); "
                                  "None = in this process.")
    sampler: EngineConfig | None = Field(None, description="Sample rollouts (training and held-out) through an "
                                         "inference engine ([sampler] url = ...); the trainer stays here and "
                                         "loads each new adapter into the engine. None = the trainer's own decoder.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return plain_folder_name(value)

    @model_validator(mode="after")
    def _mix_or_single(self) -> RunConfig:
        if self.mix and {"tasks", "reward"} & self.model_fields_set:
            raise ValueError("give either [tasks] and [reward], or [[mix]] task sets, not both")
        if self.env is not None and {"tasks", "mix"} & self.model_fields_set:
            raise ValueError("an [env] brings its own tasks: leave out [tasks] and [[mix]]")
        names = [m.name for m in self.mix]
        if len(set(names)) != len(names):
            raise ValueError(f"[[mix]] names must be unique: {names}")
        if self.algorithm.reference == "adapter" and self.model.adapter is None and not is_checkpoint_name(self.model.spec):
            raise ValueError("algorithm.reference = 'adapter' keeps RL near the adapter it starts from: "
                             "set model.adapter (e.g. an SFT run's 'NAME@latest'), or use 'base'")
        if self.sampler is not None:
            self._check_engine()
        if self.backend is not None and self.train.async_sampler == "process":
            raise ValueError("train.async_sampler = 'process' loads the model in a child process, but with "
                             "[backend] the service samples: leave it at 'thread'")
        return self

    def _check_engine(self) -> None:
        if self.backend is not None:  # with [ray], the Ray workers sample through the engines
            raise ValueError("[sampler] samples through an engine: leave out [backend]")
        if self.train.async_sampler == "process":
            raise ValueError("train.async_sampler = 'process': with [sampler] the engine samples; leave it at "
                             "'thread'")
        if self.sampler.keep < self.train.max_off_policy_steps + 1:
            raise ValueError(f"sampler.keep = {self.sampler.keep}: the async pipeline samples versions up to "
                             f"train.max_off_policy_steps = {self.train.max_off_policy_steps} behind, so keep at "
                             f"least {self.train.max_off_policy_steps + 1} loaded")
        if self.sampling.top_p < 1:
            raise ValueError(f"sampling.top_p = {self.sampling.top_p}: an engine reports each token's logprob "
                             "under the full distribution, not the top-p truncation it sampled from, so the "
                             "importance ratio would be wrong; set top_p = 1 with [sampler]")

    @field_validator("algorithm", mode="before")
    @classmethod
    def _preset(cls, value):
        """``[algorithm] preset = "dapo"`` starts from a preset; other keys override it."""
        if isinstance(value, dict) and "preset" in value:
            value = dict(value)
            name = value.pop("preset")
            if name not in PRESETS:
                raise ValueError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
            return PRESETS[name](**value)
        return value


def plain_folder_name(value: str) -> str:
    """A run name: one folder under the runs root, and the RUN of ``RUN@STEP``."""
    if not value or "/" in value or "\\" in value or "@" in value or value in {".", ".."}:
        raise ValueError("must be a plain folder name without '/', '\\' or '@'")
    return value


class ConfigError(ValueError):
    """An invalid configuration; ``str()`` lists each bad field's path and what is allowed."""


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"{path}: {item['msg']}")
    return "\n".join(lines)


def parse_config(data: dict, model: type[BaseModel] = RunConfig) -> Any:
    """``data`` validated as ``model`` (a RunConfig, or another entry point's config)."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def load_config(path: str | Path, model: type[BaseModel] = RunConfig) -> Any:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML ({error})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    return parse_config(data, model)


def dump_config(config: BaseModel) -> str:
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


def config_reference() -> str:
    """Markdown reference of every config field (``docs/config.md`` is this text)."""
    lines = ["# Config reference", "",
             "`grooves train CONFIG.toml` reads a TOML file with these sections; every key is optional.",
             "Unknown keys are errors. `[algorithm] preset = \"dapo\"` starts from a preset (see",
             "docs/algorithms.md) and the other keys of the section override it. Generated from the",
             "config models by `python scripts/gen_config_docs.py`.", ""]
    base = RunConfig()
    sections = [("(top level)", RunConfig, base)] + [
        (f"[{name}]", field.annotation, getattr(base, name)) for name, field in RunConfig.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)]
    sections.insert(len(sections) - 4, ("[env] (an agent environment instead of [tasks])", EnvConfig, None))
    sections.append(("[ray] (rollouts on Ray workers; see docs/scale.md)", RayConfig, None))
    for name, field in MonitorsConfig.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            sections.append((f"[monitors.{name}]", field.annotation, getattr(base.monitors, name)))
    for kind, model in COMPONENT_KINDS.items():
        sections.append((f"[[reward.components]] with kind = \"{kind}\"", model, None))
    sections.append(("[reward.endpoints.NAME] (one table per judge endpoint)", EndpointConfig, None))
    sections.append(("[[mix]] (one table per task set; with [mix.tasks] and [mix.reward] as above)",
                     MixConfig, None))
    sections.append(("[backend] (sampling and training on a Tinker-compatible service)", BackendConfig, None))
    sections.append(("[sampler] (an inference engine samples the rollouts; see docs/engine.md)", EngineConfig, None))
    for title, model, defaults in sections:
        lines += [f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if _is_section(annotation):
                continue
            kind = _type_name(annotation)
            default = getattr(defaults, name) if defaults is not None else field.get_default(call_default_factory=True)
            default = "required" if default is PydanticUndefined else f"`{default!r}`"
            description = field.description or ""
            lines.append(f"| `{name}` | {kind} | {default} | {description} |")
        lines.append("")
    return "\n".join(lines)


def _is_section(annotation) -> bool:
    """A nested table (a model, or an optional model) that gets its own section."""
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in options)


def _type_name(annotation) -> str:
    if get_origin(annotation) is list and get_origin(get_args(annotation)[0]) is Annotated:
        return "list of tables (see below)"
    if get_origin(annotation) is dict:
        value = get_args(annotation)[1] if get_args(annotation) else Any
        if isinstance(value, type) and issubclass(value, BaseModel):
            return "tables by name (see below)"
        return "table of KEY = value" if value is Any else f"table of KEY = {_type_name(value)}"
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{value!r}`" for value in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        return " or ".join(_type_name(arg) for arg in get_args(annotation))
    if get_origin(annotation) is not None:
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", str(annotation))
