"""``grooves learn``: continuous learning from the traffic a server answered (docs/learn.md).

::

    users ──chat──▶ grooves serve --capture DIR ──▶ DIR/capture.sqlite
                         ▲   ▲                                │ new prompts (cursor)
     alias "prod" moves ─┘   │ /v1/completions, G per prompt  ▼
                         │   └──────────────────────── grooves learn: sample, score, train_step
                         │                                    │ checkpoint RUN@STEP
                         └──── gate: held-out not worse by > 2 stderr, no alert ◀┘

A step is taken when ``every_prompts`` new prompts wait, or ``every_minutes`` have passed and
at least one waits; at most ``max_prompts_per_step`` are taken. Each prompt is sampled ``G``
times through the engine (``EngineSampler``: exact token ids and logprobs) under the trainer's
newest checkpoint, the groups are scored by the config's reward, and ``TrainingSession.train``
makes the update, records the groups, runs the detectors and writes ``RUN@STEP``.

The gate then scores the candidate greedily on the held-out tasks and pairs each reward with
the current alias's (measured when it became current): the alias moves only when the mean
paired difference is not below ``-stderr_margin`` standard errors and no detector raised an
alert at that step. A refused candidate stays on disk as ``RUN@STEP`` and the reason is logged;
training goes on from it (the next candidate is again compared with the alias's checkpoint).

A captured prompt equal to a held-out task's prompt is never trained on (it would flatter the
gate). One equal to a training task's prompt is scored as that task, so a verifier gets its
columns; any other is the task ``{"id": "capture-N", "prompt": messages}``.

Restarts (kill -9 included) go through ``Ledger``: prompts and their scored groups are written
in one transaction before the update, so nothing is scored twice and nothing taken is lost.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from rich.console import Console
from rich.markup import escape

from grooves.config_base import Section
from grooves.policy.checkpoints import runs_root
from grooves.policy.engine import EnginePolicy, EngineSampler
from grooves.policy.sampler import Sampling
from grooves.rewards.config import RewardConfig
from grooves.runs.store import write_atomic
from grooves.serve.capture_store import CaptureStore, Captured
from grooves.training.build import build_reward, task_sets
from grooves.training.checkpoint import latest_checkpoint
from grooves.training.config import ConfigError, RunConfig, dump_config
from grooves.training.gather import evaluate, rollout_groups
from grooves.training.session import TrainingSession
from grooves.types import Group
from grooves.workflows.learn_state import AliasRow, Ledger, Publisher


class LearnSection(Section):
    capture: str = Field(description="The folder given to `grooves serve --capture` (it holds capture.sqlite).")
    alias: str = Field("prod", description="The served name the gate moves to a better checkpoint.")
    route: Literal["alias", "lora"] = Field("alias", description="How checkpoints reach the server: 'alias', a "
                                            "`grooves serve` reading this runs root (POST /v1/adapters moves the "
                                            "alias); 'lora', vLLM's /v1/load_lora_adapter (the alias is a LoRA "
                                            "name reloaded in place; the server must read the runs root's paths).")
    every_prompts: int = Field(8, ge=1, description="Take a step once this many new prompts wait (N).")
    every_minutes: float = Field(10.0, gt=0, description="... or once this long has passed since the last step "
                                 "and at least one new prompt waits (T).")
    max_prompts_per_step: int = Field(16, ge=1, description="Most prompts one step takes (bounds its memory).")
    heldout_size: int = Field(16, ge=2, description="Held-out tasks the gate scores each candidate on.")
    heldout_reward: RewardConfig | None = Field(None, description="The reward the gate scores held-out tasks "
                                                "with (as [reward]; default: [reward]). Give a trusted verifier here "
                                                "when [reward] is a judge the policy could learn to game.")
    stderr_margin: float = Field(2.0, ge=0, description="Refuse a candidate whose held-out reward is below the "
                                 "current alias's by more than this many standard errors of the paired difference.")
    poll_seconds: float = Field(2.0, gt=0, description="Seconds between looks at the capture store.")
    max_steps: int | None = Field(None, ge=1, description="Stop once the run has this many steps (None: run until "
                                  "stopped).")

    @model_validator(mode="after")
    def _fits(self) -> LearnSection:
        if self.every_prompts > self.max_prompts_per_step:
            raise ValueError(f"every_prompts = {self.every_prompts} is more than max_prompts_per_step = "
                             f"{self.max_prompts_per_step}")
        return self


class LearnConfig(RunConfig):
    """A run config ([model], [lora], [tasks], [reward], [algorithm], [sampling], [optim], [train],
    [monitors]) plus [sampler] url (the server) and [learn]. [tasks] gives the held-out tasks of the
    gate and the training tasks whose columns a matching captured prompt gets."""

    learn: LearnSection

    @model_validator(mode="after")
    def _needs_engine(self) -> LearnConfig:
        if self.sampler is None:
            raise ValueError("grooves learn samples through the server: give [sampler] url = \"http://HOST:PORT/v1\"")
        if self.env is not None or self.mix:
            raise ValueError("grooves learn trains on single-turn captured prompts: leave out [env] and [[mix]]")
        return self


class Learner:
    """The loop of one ``grooves learn`` run; ``run()`` is the daemon, ``step(new)`` one step."""

    def __init__(self, config: LearnConfig, runs: str | Path | None = None, console: Console | None = None):
        self.config, c = config, config
        self.console = console or Console(stderr=True)
        (tasks,) = task_sets(c)
        self.tasks, self.reward = tasks, tasks.reward
        self.gate_reward = build_reward(c.learn.heldout_reward) if c.learn.heldout_reward else tasks.reward
        self.heldout = tasks.heldout[: c.learn.heldout_size]
        if len(self.heldout) < 2:
            raise ConfigError("tasks: the gate needs at least 2 held-out tasks (tasks.heldout or heldout_fraction)")
        self.known = {_key(tasks.render(t)): t for t in tasks.train}
        self.held_keys = {_key(tasks.render(t)) for t in tasks.heldout}
        self.capture = CaptureStore(c.learn.capture, readonly=True)
        run_dir = runs_root(runs) / c.name
        resume = (run_dir / "metrics.jsonl").exists() or latest_checkpoint(run_dir) is not None
        key = os.environ.get(c.sampler.api_key_env, "") if c.sampler.api_key_env else ""
        # alerts hold a rollout back instead of pausing the daemon
        plain = {**c.model_dump(exclude={"learn"}), "alerts": {"policy": "warn"}}
        self.session = TrainingSession(c.name, config=RunConfig.model_validate(plain), runs=runs, resume=resume,
                                       server_url=c.sampler.url, api_key=key or None, console=self.console)
        write_atomic(self.session.run_dir / "learn.toml", dump_config(c))
        self.ledger = Ledger(self.session.run_dir)
        self.publisher = Publisher(c.sampler.url, c.learn.route, self.session.run_dir, key, c.sampler.timeout)
        import openai

        client = openai.OpenAI(base_url=c.sampler.url, api_key=key or "none", timeout=c.sampler.timeout,
                               max_retries=0)
        self.sampler = EngineSampler(self.session.policy, client, "", max_concurrency=c.sampler.max_concurrency,
                                     max_wait=c.sampler.max_wait)
        self.view = EnginePolicy(self.session.policy, self.sampler)
        stop = tuple(c.sampling.stop)
        self.sampling = Sampling(c.sampling.temperature, c.sampling.top_p, c.sampling.max_completion_length, stop)
        self.greedy = Sampling(c.sampling.val_temperature, 1.0, c.sampling.max_completion_length, stop)
        if not self.ledger.history():  # a restart leaves the alias where it is (an operator may have moved it)
            self.ledger.point(0, self._heldout(0)[0], "start")
            self.publisher.point(c.learn.alias, 0)
        self._recover()

    # --- the loop ------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Take steps as prompts arrive until ``stop`` is set or ``learn.max_steps`` is reached."""
        learn, last = self.config.learn, time.monotonic()
        while not (stop is not None and stop.is_set()):
            if learn.max_steps is not None and self.session.step >= learn.max_steps:
                return
            new = self.capture.after(self.ledger.cursor(), learn.max_prompts_per_step)
            waited = time.monotonic() - last >= learn.every_minutes * 60
            if len(new) >= learn.every_prompts or (new and waited):
                self.step(new)
                last = time.monotonic()
            elif stop is not None:
                stop.wait(learn.poll_seconds)
            else:
                time.sleep(learn.poll_seconds)

    def step(self, captured: list[Captured]) -> int | None:
        """One step on ``captured``: sample, score, record, train, gate. Returns the step (None: nothing
        to train on, every prompt was a held-out one)."""
        step = self.session.step + 1
        used, skipped, tasks = [], [], []
        for row in captured:
            key = _key(row.messages)
            if key in self.held_keys or row.tools:  # held out; or tool schemas, which this loop does not send
                skipped.append(row.id)
                continue
            task = self.known.get(key) or {"id": f"capture-{row.id}", "prompt": row.messages}
            tasks.append({**task, "capture_id": row.id})
            used.append(row.id)
        groups: list[Group] = []
        if tasks:
            self.sampler.model = self.publisher.servable(self.session.step)
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
            groups = rollout_groups(self.view, tasks, [r.messages for r in captured if r.id in used],
                                    self.config.train.group_size, self.sampling, generator, self.session.step)
            for trajectory in (t for g in groups for t in g.trajectories):
                trajectory.metadata["sampler_model"] = self.sampler.model
            self.reward.score(groups)
        self.ledger.take(step, used, skipped, groups)
        if skipped:
            self.console.print(f"{len(skipped)} captured prompt(s) are held-out tasks or came with tools: not "
                               f"trained on")
        if not groups:
            return None
        self._train(step, groups)
        return step

    def _recover(self) -> None:
        """After a restart: gate a saved step the gate never saw; train a scored step never trained."""
        step = self.session.step
        if step > 0 and self.ledger.pending(step) is not None:
            self._gate(step)
        groups = self.ledger.pending(step + 1)
        if groups is not None:
            self.console.print(f"resuming: step {step + 1}'s {len(groups)} groups were scored before the stop; "
                               f"training on them (not scoring again)")
            self._train(step + 1, groups)

    def _train(self, step: int, groups: list[Group]) -> None:
        self.session.train(groups)
        self._gate(step)

    # --- the gate ------------------------------------------------------------------------

    def _heldout(self, step: int) -> tuple[list[float], dict[str, float]]:
        """Greedy held-out rewards of checkpoint ``step`` (one per task) and their metrics."""
        self.sampler.model = self.publisher.servable(step)
        prompts = [self.tasks.render(t) for t in self.heldout]
        evaluation = evaluate(self.view, self.heldout, prompts, self.gate_reward, self.greedy, step)
        return evaluation.rewards, evaluation.metrics

    def _gate(self, step: int) -> None:
        learn, current = self.config.learn, self.ledger.history()[-1]
        after, metrics = self._heldout(step)
        alerts = self.session.store.read_alerts(steps=[step])
        decision, reason, (mean, se, before_mean, after_mean) = gate(current.heldout, after, alerts,
                                                                     learn.stderr_margin, current.step)
        if decision == "in":
            self.publisher.point(learn.alias, step)
            self.ledger.point(step, after, "gated in")
        self.ledger.record_gate(step, decision, reason, before_mean, after_mean, se)
        row = {**metrics, "learn/gated_in": float(decision == "in"), "learn/gated_out": float(decision == "out"),
               "learn/reward_before": before_mean, "learn/reward_after": after_mean, "learn/reward_diff": mean,
               "learn/reward_diff_stderr": se, "learn/alias_step": float(self.ledger.history()[-1].step)}
        self.session.store.log_metrics(step, row)
        self.session.sinks.log(step, row)
        word = "[green]rolled out[/]" if decision == "in" else "[yellow]kept aside[/]"
        self.console.print(f"step {step}: {word} as {escape(learn.alias)}: {escape(reason)}" if decision == "in" else
                           f"step {step}: {word} ({self.session.name}@{step}), {escape(learn.alias)} stays at step "
                           f"{current.step}: {escape(reason)}", highlight=False)

    def close(self) -> None:
        self.publisher.close()
        self.ledger.close()
        self.capture.close()
        self.session.close()


def gate(before: list[float], after: list[float], alerts: list[dict], margin: float,
         current: int) -> tuple[str, str, tuple[float, float, float, float]]:
    """("in" or "out", the reason, ``paired(before, after)``): out when an alert fired, when no task
    was scored by both, or when mean(d) < -margin * SE(d); in otherwise. ``current``: the alias's step."""
    stats = mean, se, before_mean, after_mean = paired(before, after)
    versus = f"held-out reward {after_mean:.3f} against {before_mean:.3f} (step {current})"
    if alerts:
        return "out", "; ".join(f"alert {a['detector']} ({a['severity']}): {a['message']}" for a in alerts), stats
    if not math.isfinite(mean):
        return "out", "no held-out task was scored by both checkpoints", stats
    if mean < -margin * se:
        return "out", (f"{versus}: worse by {-mean:.3f}, more than {margin:g} standard errors "
                       f"({margin * se:.3f})"), stats
    return "in", f"{versus}, difference {mean:+.3f} ± {se:.3f}; no alert", stats


def paired(before: list[float], after: list[float]) -> tuple[float, float, float, float]:
    """(mean of after - before, its standard error, mean before, mean after) over tasks scored by both.

    SE = stdev(d) / sqrt(n) with d_i = after_i - before_i; one pair gives SE 0, none gives NaN."""
    pairs = [(b, a) for b, a in zip(before, after) if math.isfinite(b) and math.isfinite(a)]
    if not pairs:
        return math.nan, math.nan, math.nan, math.nan
    diffs = [a - b for b, a in pairs]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return (statistics.fmean(diffs), se, statistics.fmean(b for b, _ in pairs),
            statistics.fmean(a for _, a in pairs))


def alias_stack(history: list[AliasRow]) -> list[AliasRow]:
    """The checkpoints the alias was moved to, oldest first, less those rolled back."""
    stack: list[AliasRow] = []
    for row in history:
        if row.reason.startswith("rollback"):
            stack.pop()
        else:
            stack.append(row)
    return stack


def rollback(config: LearnConfig, runs: str | Path | None = None) -> tuple[int, int]:
    """Point the alias back at the checkpoint it served before the current one; (from step, to step).
    Needs no model: the ledger says where the alias was, the server loads the checkpoint."""
    run_dir = runs_root(runs) / config.name
    if not (run_dir / "learn.sqlite").is_file():
        raise ConfigError(f"{run_dir} holds no grooves learn run (no learn.sqlite)")
    ledger = Ledger(run_dir)
    try:
        stack = alias_stack(ledger.history())
        if len(stack) < 2:
            raise ConfigError(f"nothing to roll back to: {config.learn.alias} has served only "
                              f"{config.name}@{stack[-1].step if stack else 0}")
        current, previous = stack[-1], stack[-2]
        key = os.environ.get(config.sampler.api_key_env, "") if config.sampler.api_key_env else ""
        publisher = Publisher(config.sampler.url, config.learn.route, run_dir, key, config.sampler.timeout)
        try:
            publisher.point(config.learn.alias, previous.step)
        finally:
            publisher.close()
        ledger.point(previous.step, previous.heldout, f"rollback from step {current.step}")
        return current.step, previous.step
    finally:
        ledger.close()


def _key(messages: list[dict]) -> str:
    """Messages compared by role and text only (a client may add fields such as name=None)."""
    return json.dumps([(m.get("role"), m.get("content")) for m in messages])
