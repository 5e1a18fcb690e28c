"""The training loop of DESIGN.md: tasks -> G samples each -> rewards -> update -> log -> checkpoint.

``TrainingRun`` owns one run folder. Each step's metrics and trajectories are recorded
before its checkpoint is written, and a resume from the checkpoint at step k first drops
records made after k, so a run killed at any moment resumes to the same result as a run
that never stopped (same seed and config; on CPU the adapters match within 1e-5).

Where the rollouts come from is a pipeline (``grooves.training.pipeline.local``): in this
process or on Ray workers (``[ray]``), synchronously (``train.max_off_policy_steps = 0``) or up
to k updates ahead of the trainer. Every trajectory records the adapter version that sampled it;
each step logs ``rollout/policy_version``, ``rollout/staleness/mean|max`` and
``rollout/dropped_stale``.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from grooves.algorithms import has_signal
from grooves.envs.rollout import env_metrics
from grooves.monitors import Monitors
from grooves.policy.policy import Policy
from grooves.policy.sampler import Sampling
from grooves.progress import Reporter, duration
from grooves.rewards.compose import RewardReport
from grooves.tasks.sources import TaskSourceError
from grooves.training import checkpoint as ckpt
from grooves.training.pipeline.engine import EngineRollouts
from grooves.training.pipeline.process import ProcessRollouts
from grooves.training.pipeline.ray_workers import RayEngineRollouts, RayRollouts
from grooves.training.pipeline.local import (AsyncPipeline, Batch, LocalRollouts, SyncPipeline, drop_after,
                                             scores_with, staleness_metrics)
from grooves.training import ddp
from grooves.training.alerting import AlertHandling
from grooves.training.config import ConfigError, RunConfig
from grooves.training.gather import Evaluation, completion_stats, evaluate, reward_metrics
from grooves.training.runfolder import GracefulStop, Run, begin, resume_point
from grooves.runs.lock import RunLock
from grooves.runs.store import RunStore
from grooves.training.tasksets import TaskMix, TaskSet
from grooves.training.step import RLStep
from grooves.training.trainer import Trainer
from grooves.types import Group, Task


class TrainingRun(AlertHandling):
    def __init__(self, config: RunConfig, policy: Policy, task_sets: list[TaskSet], run_dir: Path, *,
                 resume: bool = False, progress: bool = True, console: Console | None = None,
                 acknowledge: tuple[str, ...] = (), stop_rule: StopRule | None = None,
                 resume_command: str = "grooves train CONFIG --resume", trainer: type[RLStep] = Trainer):
        self.config = config
        self.resume_command = resume_command  # shown when the run pauses or is interrupted
        self.policy = policy
        self.sets = task_sets
        self.heldout = {s.name: s.heldout[: config.log.val_size] for s in task_sets}
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.console = console or Console(stderr=True)
        self.progress = Reporter(self.console, enabled=progress)
        s = config.sampling
        self.sampling = Sampling(temperature=s.temperature, top_p=s.top_p,
                                 max_new_tokens=s.max_completion_length, stop=tuple(s.stop))
        self.val_sampling = Sampling(temperature=s.val_temperature, top_p=s.top_p,
                                     max_new_tokens=s.max_completion_length, stop=tuple(s.stop), seed=config.seed)
        self.mix = TaskMix(task_sets, seed=config.seed, balance_by=config.train.balance_by)
        self.generator = torch.Generator(device=policy.device).manual_seed(config.seed)
        # An agent's rollout spans turns: its length budget is the env's, not one turn's.
        max_length = max([s.max_completion_length] + [t.env.max_tokens for t in task_sets if t.env is not None])
        self.world = ddp.init_from_env()  # under torchrun: rank 0 runs the loop, every rank trains
        self.trainer = trainer(policy, config.algorithm, config.optim, temperature=s.temperature,
                               max_completion_length=max_length, total_steps=config.steps,
                               use_sampler_logprobs=config.train.use_sampler_logprobs,
                               share_prompt=config.train.share_prompt, kl_every=config.log.kl_every,
                               max_staleness=drop_after(config.train), minibatches=config.train.minibatches,
                               world=self.world, remote_sampler=config.sampler is not None)
        self.monitors = Monitors(config.monitors)
        self.acknowledged = set(acknowledge)  # detectors whose alerts only warn from now on
        self.stop_rule = stop_rule
        self._halt: tuple[str, str] | None = None
        self._prompt_lengths: dict[tuple[str, str], int] = {}
        self._reported_errors: set[tuple[str, str]] = set()
        self.evaluations: dict[int, Evaluation] = {}
        self._sampling_lock = threading.Lock()  # validation never overlaps an async batch's sampling
        self._scoring_lock = threading.Lock()  # nor its scoring apart in this process (the same rewards)
        for task_set in task_sets:
            for warning in task_set.check():
                self.console.print(f"[yellow]warning[/]: {escape(warning)}")
            need = getattr(task_set.env, "prompt_budget", None)
            if need and need > s.max_prompt_length:
                raise ConfigError(f"sampling.max_prompt_length: {s.max_prompt_length} tokens is less than the "
                                  f"{need} that env {task_set.env.name!r} declares its prompts need; raise it")

    # --- the loop --------------------------------------------------------------------

    def run(self) -> Run:
        if self.world is not None and not self.world.is_main:  # a DDP rank: train on rank 0's groups only
            return Run(self.run_dir.name, self.run_dir, ddp.follow(self.trainer))
        try:
            with RunLock(self.run_dir):
                return self._run()
        finally:
            if self.world is not None:
                ddp.broadcast(None)  # the other ranks stop, whatever ended the run

    def _run(self) -> Run:
        start = self._open()
        if self.world is not None:
            ddp.send_state(self.trainer)
        step = start
        self.pipeline = None
        try:
            self.pipeline = self._pipeline(start)
            if start == 0 and self._has_heldout:
                self._log(0, self._validate(0))
            with self.progress.counting(self.config.steps, done=start), GracefulStop(self.console) as stop:
                for step in range(start + 1, self.config.steps + 1):
                    metrics = self._step(step)
                    self._log(step, metrics)
                    halting = self._halt is not None or stop.requested
                    if step % self.config.log.save_every == 0 or step == self.config.steps or halting:
                        self._save(step)
                    self.progress.advance(step, self._progress_values(metrics))
                    if stop.requested:
                        self.console.print(f"[yellow]stopped[/] after step {step} (checkpoint saved); "
                                           f"continue with: {self.resume_command}")
                        self._halt = self._halt or ("interrupt", f"interrupted after step {step}")
                        break
                    if self._halt is not None:
                        self._announce_halt(step)
                        break
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
            self.sinks.close()
            self.store.close()
        run = Run(self.run_dir.name, self.run_dir, step, self.store.read_metrics(), self.evaluations)
        if self._halt is not None:
            run.halted_by, run.halt_reason = self._halt
        return run

    def _pipeline(self, start: int):
        """Sync or async, in this process or on Ray workers (see grooves.training.pipeline.local)."""
        k = self.config.train.max_off_policy_steps
        group_size = self.config.train.group_size
        if self.config.sampler is not None and self.config.ray is not None:  # Ray workers sample via the engines
            rollouts = RayEngineRollouts(self.config, self.policy, self.sets, group_size, self.sampling,
                                         self.generator, self.run_dir, version=lambda: self.trainer.step)
        elif self.config.sampler is not None:
            rollouts = EngineRollouts(self.config.sampler, self.policy, self.sets, group_size, self.sampling,
                                      self.generator, self.run_dir, version=lambda: self.trainer.step)
        elif self.config.ray is not None:
            rollouts = RayRollouts(self.config, self.policy, self.sets, group_size, self.sampling, self.config.ray)
        elif k > 0 and self.config.train.async_sampler == "process":
            rollouts = ProcessRollouts(self.config, self.policy, self.sets, group_size, self.sampling,
                                       runs=self.run_dir.parent)
        else:  # async: a scorer thread judges a batch while the sampler thread samples the next one
            defer = k > 0 and not self.config.algorithm.dynamic_sampling and not scores_with(self.sets, self.policy)
            rollouts = LocalRollouts(self.policy, self.sets, group_size, self.sampling, self.generator, copy=k > 0,
                                     defer=defer)
        self.rollouts = rollouts
        if k == 0:
            if isinstance(rollouts, LocalRollouts):
                rollouts.on_phase = lambda phase: self.progress.phase(phase, log=False)
            return SyncPipeline(rollouts, self._produce, start)
        return AsyncPipeline(rollouts, self._produce, start, k=k, first=start + 1, last=self.config.steps,
                             lock=self._sampling_lock,
                             score_lock=self._scoring_lock if isinstance(rollouts, LocalRollouts) else None)

    def _produce(self, step: int) -> Batch:
        """Sample and score the batch of ``step``; note where the task draws stand after it."""
        t0 = time.perf_counter()
        kept, sampled, reports, rounds = self._collect(step)
        position = {"tasks": self.mix.state(), "prompts_skipped": self.prompts_skipped,
                    "generator": self.generator.get_state()}
        return Batch(step, kept, sampled, reports, rounds, time.perf_counter() - t0, position)

    def _step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.progress.phase("sampling", log=False)
        batch = self.pipeline.take(step)
        self.position = batch.position
        kept, sampled, reports, rounds = batch.kept, batch.sampled, batch.reports, batch.rounds
        sample_time = batch.sample_time
        metrics = self._reward_metrics(sampled, reports, "reward")
        metrics["completion_len"], metrics["train/truncated_ratio"] = completion_stats(sampled)
        metrics.update(env_metrics(sampled))
        metrics["frac_reward_zero_std"] = sum(not has_signal(_rewards(g)) for g in sampled) / len(sampled)
        metrics["train/sampling_rounds"] = float(rounds)
        metrics["train/groups_dropped"] = float(len(sampled) - len(kept))
        tokens = sum(len(t.completion_ids) for g in sampled for t in g.trajectories)
        metrics["train/sample_time"] = sample_time
        if batch.generate_time is not None:  # the scoring ran apart: the generation's own share of it
            metrics["train/generate_time"] = batch.generate_time
        metrics["train/tokens_per_s"] = tokens / sample_time
        metrics["train/wait_time"] = time.perf_counter() - t0  # sampling the update waited for
        metrics.update(staleness_metrics(sampled, self.trainer.step))
        metrics["rollout/prefix_breaks"] = float(sum(_prefix_breaks(t) for g in sampled for t in g.trajectories))
        self.progress.phase("updating", log=False)
        if self.world is not None:
            ddp.broadcast(kept)
        metrics.update(self.trainer.train_step(kept))
        self.pipeline.publish(self.trainer.step)
        if isinstance(self.rollouts, EngineRollouts):
            metrics["rollout/engine_logprob_gap"] = self.rollouts.gap  # the version just published
        metrics["rollout/dropped_stale"] = metrics.get("train/trajectories_stale", 0.0)
        if hasattr(self.rollouts, "replaced"):
            metrics["rollout/workers_replaced"] = float(self.rollouts.replaced)
        self.store.record_groups(step, sampled)
        for name, report in reports.items():
            self._report_reward_errors(step, name, report)
        if metrics.get("alerts/nan_loss"):
            self._alert(step, "nan_loss", "Loss or gradient was not finite: the step was skipped and the "
                        "adapter left unchanged.", {"reward/total": metrics.get("reward/total")})
        self._check_failed(step, sampled, reports, metrics)
        if self._has_heldout and (step % self.config.log.val_every == 0 or step == self.config.steps):
            metrics.update(self._validate(step))
        self._watch(step, sampled, metrics)
        metrics["train/total_step_time"] = time.perf_counter() - t0
        return metrics

    def _collect(self, step: int) -> tuple[list[Group], list[Group], dict[str, RewardReport], int]:
        """Sample and score groups; with dynamic sampling keep only groups with reward variance."""
        alg = self.config.algorithm
        target = self.config.train.tasks_per_step
        kept: list[Group] = []
        sampled: list[Group] = []
        reports = {s.name: RewardReport() for s in self.sets}
        rounds = 0
        while True:
            rounds += 1
            drawn = self._take_tasks(target - len(kept) if alg.dynamic_sampling else target)
            groups = self.rollouts.rollout(drawn, step, rounds, reports)  # sampled and scored
            sampled.extend(groups)
            if not alg.dynamic_sampling:
                return groups, sampled, reports, rounds
            kept.extend(g for g in groups if has_signal(_rewards(g)))
            if len(kept) >= target or rounds >= alg.max_sampling_rounds:
                return kept, sampled, reports, rounds

    def _reward_metrics(self, groups: list[Group], reports: dict[str, RewardReport], prefix: str) -> dict:
        """Reward metrics of a single set as they are; of a mix, per set plus the overall total."""
        if len(self.sets) == 1:
            return reward_metrics(groups, self.sets[0].reward, reports[self.sets[0].name], prefix)
        totals = [t.reward for g in groups for t in g.trajectories if t.reward == t.reward]
        metrics = {f"{prefix}/total": statistics.fmean(totals) if totals else math.nan}
        for task_set in self.sets:
            own = [g for g in groups if g.metadata.get("task_set") == task_set.name]
            if own:
                metrics.update(reward_metrics(own, task_set.reward, reports[task_set.name],
                                              task_set.prefix(prefix)))
        return metrics

    def _take_tasks(self, count: int) -> list[tuple[TaskSet, Task]]:
        """Next tasks from the mix, skipping (and counting) prompts over max_prompt_length."""
        out: list[tuple[TaskSet, Task]] = []
        skipped_in_a_row = 0
        while len(out) < count:
            task_set, task = self.mix.take()
            if self._prompt_length(task_set, task) <= self.config.sampling.max_prompt_length:
                out.append((task_set, task))
                skipped_in_a_row = 0
                continue
            if not self.prompts_skipped:
                self.console.print(f"[yellow]warning[/]: task {escape(str(task['id']))!r} has a prompt of "
                                   f"{self._prompt_length(task_set, task)} tokens, over sampling.max_prompt_length="
                                   f"{self.config.sampling.max_prompt_length}: skipped, and so is every such task "
                                   f"(counted in train/prompts_skipped)")
            self.prompts_skipped += 1
            skipped_in_a_row += 1
            if skipped_in_a_row > sum(len(s.train) for s in self.sets) * 4:
                raise TaskSourceError(f"every task's prompt is longer than sampling.max_prompt_length="
                                      f"{self.config.sampling.max_prompt_length} tokens")
        return out

    def _prompt_length(self, task_set: TaskSet, task: Task) -> int:
        key = (task_set.name, task["id"])
        if key not in self._prompt_lengths:
            self._prompt_lengths[key] = len(self.rollouts.policy.chat_ids(task_set.render(task)))
        return self._prompt_lengths[key]

    @property
    def _has_heldout(self) -> bool:
        return any(self.heldout.values())

    def _validate(self, step: int) -> dict[str, float]:
        self.progress.phase("validating", f"{sum(map(len, self.heldout.values()))} held-out tasks (step {step})")
        groups, reports = [], {}
        # an engine samples held-out tasks too, from the newest version it was given
        policy = self.rollouts.latest() if isinstance(self.rollouts, EngineRollouts) else self.policy
        for task_set in self.sets:
            tasks = self.heldout[task_set.name]
            if tasks:
                with self._sampling_lock, self._scoring_lock:
                    evaluation = evaluate(policy, tasks, [task_set.render(t) for t in tasks],
                                          task_set.reward, self.val_sampling, step, task_set.env,
                                          self._round_reporter(task_set.name))
                for group in evaluation.groups:
                    group.metadata["task_set"] = task_set.name
                groups += evaluation.groups
                reports[task_set.name] = evaluation.report
        metrics = self._reward_metrics(groups, reports, "val/reward")
        metrics["val/completion_len"], metrics["val/truncated_ratio"] = completion_stats(groups)
        metrics.update(env_metrics(groups, "val/env"))
        self.evaluations[step] = Evaluation(groups, metrics)
        self.store.record_groups(step, groups, split="val")
        self._raise(step, self.monitors.observe_heldout(step, groups))
        metrics.update(self.monitors.heldout_metrics())
        return metrics

    def _round_reporter(self, name: str) -> Callable[[int, int, int], None]:
        """A line per round of an env's held-out rollouts: minutes of agent turns never go silent."""
        started, label = time.monotonic(), f"{name}: " if name else ""

        def on_round(rounds: int, done: int, total: int) -> None:
            self.progress.phase("validating", f"{label}round {rounds}, {done} of {total} rollouts finished "
                                              f"({duration(time.monotonic() - started)})")
        return on_round

    # --- run folder, checkpoints, logging ------------------------------------------------

    def _open(self) -> int:
        """Create or reopen the run folder; return the step to continue after."""
        latest = resume_point(self.run_dir, self.resume, self.resume_command, self.console)
        self.store = RunStore(self.run_dir)
        self.prompts_skipped = 0
        self.failed_steps = 0
        start = 0
        if latest is not None:
            trainer_state, state = ckpt.load_checkpoint(latest, self.policy, self.generator)
            self.trainer.load_state_dict(trainer_state)
            self.mix.restore(state["tasks"])
            self.prompts_skipped = state.get("prompts_skipped", 0)
            self.monitors.load_state_dict(state.get("monitors", {}))
            self.acknowledged |= set(state.get("acknowledged", []))
            self.failed_steps = state.get("failed_steps", 0)
            start = state["step"]
            self.store.truncate_after(start)
            self.console.print(f"[bold]grooves[/]: resuming {self.run_dir.name} after step {start}")
        elif self.resume:  # nothing was saved yet: start over, step 0 included
            self.console.print(f"[bold]grooves[/]: {self.run_dir.name} has no complete checkpoint: "
                               f"starting it over from step 0")
            self.store.truncate_after(-1)
        self.sinks = begin(self.store, self.config, start)
        self.position = {"tasks": self.mix.state(), "prompts_skipped": self.prompts_skipped,
                         "generator": self.generator.get_state()}
        return start

    def _save(self, step: int) -> None:
        self.progress.phase("saving", log=False)
        # The task draws and sampling RNG as they stood after this step's batch (an async
        # pipeline has drawn further; a resume draws those tasks again).
        generator = torch.Generator(device=self.generator.device)
        generator.set_state(self.position["generator"])
        ckpt.save_checkpoint(self.run_dir, step, self.policy, self.trainer.state_dict(), generator,
                             {"tasks": self.position["tasks"], "prompts_skipped": self.position["prompts_skipped"],
                              "run": self.run_dir.name, "monitors": self.monitors.state_dict(),
                              "acknowledged": sorted(self.acknowledged), "failed_steps": self.failed_steps})
        ckpt.prune(self.run_dir, self.config.log.keep_checkpoints)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        metrics["train/prompts_skipped"] = float(self.position["prompts_skipped"])
        self.store.log_metrics(step, metrics)
        self.sinks.log(step, metrics)

    def _progress_values(self, metrics: dict[str, float]) -> dict[str, str]:
        """What a step's progress line shows: its reward and the latest held-out reward with its step."""
        values = {"reward": _fmt(metrics.get("reward/total"))}
        if self.evaluations:
            at = max(self.evaluations)
            values["heldout"] = f"{_fmt(self.evaluations[at].metrics.get('val/reward/total'))} (step {at})"
        return values


StopRule = Callable[[int, dict[str, float], dict[int, Evaluation]], "str | None"]
"""``rule(step, metrics, evaluations) -> reason`` ends a run early (e.g. a probe whose held-out
reward has clearly risen); None lets it go on."""


def _prefix_breaks(trajectory) -> int:
    """Turns whose prompt the sampler read otherwise than sent (grooves.policy.engine)."""
    state = trajectory.metadata.get("state") or {}
    return int(trajectory.metadata.get("prefix_break", False)) + state.get("counters", {}).get("prefix_breaks", 0)


def _rewards(group: Group) -> torch.Tensor:
    values = [r for r in group.rewards if r == r]  # NaN (failed) rewards carry no signal
    return torch.tensor(values)


def _fmt(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"
