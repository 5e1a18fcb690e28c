"""Supervised fine-tuning of a LoRA adapter: the warm start that lets RL reinforce a behaviour
(a tool call) the base model never samples.

The loss is the token-mean cross-entropy of the assistant turns' tokens (mask 1 in
``sft_data.render_transcript``), averaged over every token of the optimizer step, so micro-
batches (``optim.micro_batch_size``) and gradient accumulation give the gradient of the whole
batch, as in RL. Each step's examples are sorted by length before they are cut into
micro-batches (length bucketing: padding costs little CPU); the prompt prefix a step's examples
share runs once for all its micro-batches, and each stops at its last trained token.
``data.max_seq_length`` cuts long transcripts (``sft_data.fit_examples``), counted and said
before the first step. A run folder is a ``grooves train`` run folder: ``config.toml``,
``metrics.jsonl``, TensorBoard, ``checkpoints/step-000N`` (adapter, optimizer, random states,
data position), one trainer at a time, ``--resume``, Ctrl-C saves; RL continues from it with
``[model] adapter = "RUN@STEP"``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from pydantic import Field, field_validator
from rich.console import Console
from rich.markup import escape

from grooves.policy.lora import LoRA
from grooves.progress import Reporter
from grooves.policy.context import model_context
from grooves.policy.logprobs import SharedPrefix, build_token_batch, completion_logprobs
from grooves.policy.policy import Policy
from grooves.tasks.sources import TaskStream
from grooves.training import checkpoint as ckpt
from grooves.config_base import Section
from grooves.training.config import ModelConfig, OptimConfig, RunLogConfig, plain_folder_name
from grooves.training.runfolder import GracefulStop, Run, begin, resume_point
from grooves.runs.lock import RunLock
from grooves.runs.store import RunStore
from grooves.training.step import lr_factor
from grooves.types import Trajectory


class SFTDataConfig(Section):
    source: str = Field(description="A chat JSONL file (OpenAI messages), 'env:NAME' (the env's demonstrations "
                        "of its training tasks) or 'run:NAME' (a finished run's trajectories).")
    heldout: str | None = Field(None, description="A held-out chat JSONL file (default: split off `source`).")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="Share of `source` held out, by a hash of "
                                    "each example's task id.")
    min_reward: float | None = Field(None, description="With 'run:NAME': keep trajectories whose reward is at "
                                     "least this (rejection-sampling fine-tuning).")
    limit: int | None = Field(None, ge=1, description="Use at most this many training examples.")
    env_options: dict = Field(default_factory=dict, description="With 'env:NAME': the env's options.")
    max_seq_length: int | None = Field(None, ge=2, description="Most tokens of an example (prompt + transcript): "
                                       "a longer one keeps its first max_seq_length tokens, one whose prompt "
                                       "alone reaches it or that keeps no trained token is skipped; both are "
                                       "counted (train/examples_cut, train/examples_skipped, "
                                       "train/loss_tokens_cut). Unset: every example whole, and those over the "
                                       "model's context are said before the first step.")


class SFTConfig(Section):
    """`grooves sft CONFIG.toml`: supervised fine-tuning of a LoRA adapter on transcripts."""

    name: str = Field("sft", description="Run folder name under the runs root.")
    seed: int = Field(0, description="Seeds LoRA init and the data order.")
    steps: int = Field(50, ge=1, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Examples per optimizer step.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoRA = Field(default_factory=LoRA)
    data: SFTDataConfig
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(learning_rate=2e-4, micro_batch_size=4))
    log: RunLogConfig = Field(default_factory=lambda: RunLogConfig(val_size=32))
    heldout_tasks: int = Field(0, ge=0, description="With 'env:NAME': also roll out this many held-out env tasks "
                               "greedily at each validation (val/env/*, val/reward/total, val/success).")
    turn_tokens: int = Field(96, ge=1, description="New tokens per assistant turn in those rollouts.")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        return plain_folder_name(value)


class SFTRun:
    """One SFT run folder: examples in, checkpoints and metrics out."""

    def __init__(self, config: SFTConfig, policy: Policy, train: list[Trajectory], heldout: list[Trajectory],
                 run_dir: Path, *, resume: bool = False, console: Console | None = None, progress: bool = True,
                 env_eval=None, resume_command: str = "grooves sft CONFIG --resume"):
        self.config, self.policy = config, policy
        self.console = console or Console(stderr=True)
        self.fit_metrics: dict[str, float] = {}  # what max_seq_length cut, logged at step 0
        self.train = self._fit(train, "train", "training examples")
        if not self.train:
            raise ValueError("SFT needs at least one training example" + (
                f" (every one was skipped by data.max_seq_length = {config.data.max_seq_length})" if train else ""))
        self.heldout = self._fit(heldout[: config.log.val_size], "val", "held-out examples")
        self.run_dir, self.resume, self.resume_command = Path(run_dir), resume, resume_command
        self.progress = Reporter(self.console, enabled=progress)
        self.env_eval = env_eval  # step -> metrics of held-out env rollouts, or None
        self.params = policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=config.optim.learning_rate, betas=config.optim.betas,
                                           weight_decay=config.optim.weight_decay)
        self.stream = TaskStream(list(range(len(train))), seed=config.seed)
        self.generator = torch.Generator(device=policy.device).manual_seed(config.seed)

    def run(self) -> Run:
        with RunLock(self.run_dir):
            start = self._open()
            step, halted = start, None
            try:
                if start == 0:
                    self._log(0, {**self.fit_metrics, **self._validate()})
                with self.progress.counting(self.config.steps, done=start), GracefulStop(self.console) as stop:
                    for step in range(start + 1, self.config.steps + 1):
                        metrics = self._step(step)
                        if step % self.config.log.val_every == 0 or step == self.config.steps:
                            metrics.update(self._validate())
                        self._log(step, metrics)
                        if step % self.config.log.save_every == 0 or step == self.config.steps or stop.requested:
                            self.progress.phase("saving", log=False)
                            self._save(step)
                        self.progress.advance(step, _values(metrics))
                        if stop.requested:
                            self.console.print(f"stopped after step {step} (checkpoint saved); continue with: "
                                               f"{self.resume_command}")
                            halted = "interrupt"
                            break
            finally:
                self.sinks.close()
                self.store.close()
        return Run(self.run_dir.name, self.run_dir, step, self.store.read_metrics(), halted_by=halted)

    def _fit(self, examples: list[Trajectory], prefix: str, what: str) -> list[Trajectory]:
        """``examples`` within ``data.max_seq_length`` (``sft_data.fit_examples``); what was cut is
        said now, before the first step, and kept for step 0's metrics."""
        from grooves.training.sft_data import fit_examples

        limit = self.config.data.max_seq_length
        kept, fit = fit_examples(examples, limit, model_context(self.policy))
        if limit is not None:
            self.fit_metrics.update(fit.metrics(prefix))
        said = fit.sentence(what, limit)
        if said:
            self.console.print(f"[yellow]{'warning' if limit is None else 'note'}[/]: {escape(said)}",
                               highlight=False, soft_wrap=True)
        return kept

    def _step(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        lr = self.config.optim.learning_rate * lr_factor(step - 1, self.config.optim.warmup_steps,
                                                         self.config.steps, self.config.optim.lr_schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        examples = [self.train[i] for i in self.stream.take(self.config.batch_size)]
        self.progress.phase("updating", log=False)
        self.policy.model.train()
        try:
            self.optimizer.zero_grad(set_to_none=True)
            loss, tokens = self._loss(examples, backward=True)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.optim.max_grad_norm)
            if math.isfinite(loss) and torch.isfinite(grad_norm):
                self.optimizer.step()
        finally:
            self.policy.model.eval()
        return {"loss/sft": loss, "train/grad_norm": grad_norm.item(), "train/lr": lr, "train/tokens": float(tokens),
                "train/step_time": time.perf_counter() - start}

    def _loss(self, examples: list[Trajectory], backward: bool) -> tuple[float, int]:
        """Token-mean NLL of the examples' trained tokens; with ``backward``, its gradient too.

        The prompt prefix every example of the call shares (an env's system prompt and tools) runs
        once for all micro-batches (``SharedPrefix``); each micro-batch stops at its last trained
        token, and the output head runs only on trained tokens."""
        ordered = sorted(examples, key=lambda t: len(t.prompt_ids) + len(t.completion_ids))
        tokens = sum(sum(t.completion_mask) for t in ordered)
        if tokens == 0:
            return math.nan, 0
        total = 0.0
        size = self.config.optim.micro_batch_size
        with torch.set_grad_enabled(backward):
            prefix = self._shared_prefix(ordered, detached=backward)
            for i in range(0, len(ordered), size):
                batch = build_token_batch(ordered[i: i + size], self.policy.device).trimmed()  # similar lengths
                logp, _ = (prefix.logprobs(batch) if prefix is not None
                           else completion_logprobs(self.policy.causal_lm, batch))
                nll = -(logp * batch.mask).sum() / tokens
                if backward:
                    nll.backward()
                total += nll.item()
            if backward and prefix is not None:
                prefix.backward()
        return total, tokens

    def _shared_prefix(self, examples: list[Trajectory], detached: bool) -> SharedPrefix | None:
        """The examples' common prompt prefix, run once (None: no common prefix, or activation
        checkpointing, which drops the cache a prefix needs)."""
        lm = self.policy.causal_lm
        if getattr(lm, "is_activation_checkpointing", False):
            return None
        first, shared = examples[0].prompt_ids, min(len(t.prompt_ids) for t in examples)
        for t in examples[1:]:
            shared = next((k for k in range(shared) if t.prompt_ids[k] != first[k]), shared)
        if shared == 0:
            return None
        try:
            return SharedPrefix(lm, torch.tensor(first[:shared], device=self.policy.device), detached=detached)
        except ValueError:  # a cache that does not keep every position
            return None

    def _validate(self) -> dict[str, float]:
        self.progress.phase("validating", f"{len(self.heldout)} held-out examples"
                            + (" and env tasks" if self.env_eval is not None else ""))
        metrics = {}
        if self.heldout:
            metrics["val/loss/sft"] = self._loss(self.heldout, backward=False)[0]
        if self.env_eval is not None:
            metrics.update(self.env_eval(self.policy))
        return metrics

    # --- run folder -------------------------------------------------------------------

    def _open(self) -> int:
        latest = resume_point(self.run_dir, self.resume, self.resume_command, self.console)
        self.store = RunStore(self.run_dir)
        start = 0
        if latest is not None:
            state, saved = ckpt.load_checkpoint(latest, self.policy, self.generator)
            self.optimizer.load_state_dict(state["optimizer"])
            self.stream.restore(saved["data"])
            start = saved["step"]
            self.store.truncate_after(start)
            self.console.print(f"[bold]grooves[/]: resuming {self.run_dir.name} after step {start}")
        elif self.resume:
            self.store.truncate_after(-1)
        self.sinks = begin(self.store, self.config, start)
        return start

    def _save(self, step: int) -> None:
        ckpt.save_checkpoint(self.run_dir, step, self.policy, {"optimizer": self.optimizer.state_dict(), "step": step},
                             self.generator, {"data": self.stream.state(), "run": self.run_dir.name, "kind": "sft"})
        ckpt.prune(self.run_dir, self.config.log.keep_checkpoints)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self.store.log_metrics(step, metrics)
        self.sinks.log(step, metrics)


def _values(metrics: dict[str, float]) -> dict[str, str]:
    """What a step's progress line shows: its loss, and the held-out loss and success when measured."""
    values = {"loss": f"{metrics['loss/sft']:.4f}"}
    for key, name in (("val/loss/sft", "heldout loss"), ("val/success", "heldout success")):
        if key in metrics:
            values[name] = f"{metrics[key]:.4f}"
    return values


def run_sft_config(config: SFTConfig, *, runs: str | Path | None = None, out: str | Path | None = None,
                   resume: bool = False, console: Console | None = None, progress: bool = True,
                   resume_command: str = "grooves sft CONFIG --resume") -> Run:
    """Run (or resume) the SFT a config describes, as ``grooves sft`` does."""
    from grooves.policy.checkpoints import runs_root
    from grooves.training.build import load_policy

    reporter = Reporter(console, enabled=progress)
    reporter.phase("loading", f"model {config.model.spec}")
    policy = load_policy(config, runs)
    reporter.phase("loading", f"examples from {config.data.source}")
    d = config.data
    train, heldout = config_examples(policy, config, runs)
    env_eval = None
    if config.heldout_tasks and d.source.startswith("env:"):
        env_eval = env_evaluator(d.source[4:], d.env_options, config.heldout_tasks, config.seed, config.turn_tokens)
    run_dir = Path(out) if out else runs_root(runs) / config.name
    return SFTRun(config, policy, train, heldout, run_dir, resume=resume, console=console, progress=progress,
                  env_eval=env_eval, resume_command=resume_command).run()


def config_examples(policy: Policy, config: SFTConfig, runs: str | Path | None = None):
    """The (train, held-out) examples ``config.data`` names, as ``grooves sft`` loads them."""
    from grooves.training.sft_data import load_examples

    d = config.data
    return load_examples(policy, d.source, heldout=d.heldout, heldout_fraction=d.heldout_fraction,
                         min_reward=d.min_reward, limit=d.limit, seed=config.seed, runs=runs,
                         env_options=d.env_options)


def env_evaluator(name: str, options: dict, n: int, seed: int, turn_tokens: int):
    """``evaluate(policy) -> metrics``: greedy rollouts of ``n`` held-out tasks of an env, scored by it."""
    from grooves.envs import load_env
    from grooves.envs.rollout import env_metrics
    from grooves.policy.sampler import Sampling
    from grooves.rewards.compose import EnvScore, Reward
    from grooves.training.gather import evaluate

    env = load_env(name, **options)
    tasks = env.tasks("heldout", n, seed=seed)
    reward = Reward([EnvScore(key, weight) for key, weight in env.weights.items()])
    sampling = Sampling(temperature=0.0, max_new_tokens=turn_tokens, seed=seed)

    def run(policy: Policy) -> dict[str, float]:
        result = evaluate(policy, tasks, [env.prompt(t) for t in tasks], reward, sampling, 0, env)
        trajectories = [g.trajectories[0] for g in result.groups]
        solved = [env.solved(t.metadata["env_scores"]) for t in trajectories]
        return {**result.metrics, **env_metrics(result.groups, "val/env"), "val/success": sum(solved) / len(solved)}

    return run


def sft(policy: Policy, data: str | list[dict], *, steps: int = 50, batch_size: int = 8, name: str = "sft",
        runs: str | Path | None = None, resume: bool = False, heldout: list[dict] | None = None,
        config: SFTConfig | dict | None = None) -> Run:
    """Fine-tune ``policy``'s adapter on transcripts: a source (``"chats.jsonl"``, ``"env:helpdesk"``,
    ``"run:NAME"``) or a list of ``{"messages": [...], "tools": [...]}``. Other settings go in
    ``config`` (an ``SFTConfig`` or a dict shaped like its TOML)."""
    from grooves.policy.checkpoints import runs_root
    from grooves.training.config import parse_config
    from grooves.training.sft_data import load_examples, render_transcript

    source = data if isinstance(data, str) else "<list from Python>"
    base = config.model_dump() if isinstance(config, SFTConfig) else dict(config or {})
    base.update(name=name, steps=steps, batch_size=batch_size, data={**base.get("data", {}), "source": source},
                model={**base.get("model", {}), "spec": policy.base_spec, "device": str(policy.device)})
    config = parse_config(base, SFTConfig)
    if isinstance(data, str):
        d = config.data
        train, held = load_examples(policy, data, heldout=d.heldout, heldout_fraction=d.heldout_fraction,
                                    min_reward=d.min_reward, limit=d.limit, seed=config.seed, runs=runs)
    else:
        train = [render_transcript(policy, row["messages"], row.get("tools")) for row in data]
        held = [render_transcript(policy, row["messages"], row.get("tools")) for row in heldout or []]
    return SFTRun(config, policy, train, held, runs_root(runs) / config.name, resume=resume,
                  resume_command=f"gr.sft(..., name={config.name!r}, resume=True)").run()
