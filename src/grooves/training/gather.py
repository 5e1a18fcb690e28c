"""Rollouts: prompts -> G sampled completions each -> Groups of Trajectories; for an agent env,
G multi-turn rollouts per task (``grooves.envs.rollout``), every turn batched across them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grooves.envs.base import Env
from grooves.envs.rollout import env_groups, sampler_generate
from grooves.policy.policy import Policy
from grooves.policy.sampler import Completion, Sampler, Sampling
from grooves.rewards.compose import Reward, RewardReport
from grooves.types import Group, Message, Task, Trajectory


def rollout_groups(policy: Policy, tasks: list[Task], prompts: list[list[Message]], n: int,
                   sampling: Sampling, generator: torch.Generator | None, policy_step: int,
                   env: Env | None = None, on_round: Callable[[int, int, int], None] | None = None,
                   wave: int | None = None,
                   on_trajectory: Callable[[Task, Trajectory], None] | None = None) -> list[Group]:
    """``n`` rollouts of each task; every trajectory records ``policy_step`` as its ``policy_version``
    (the number of updates behind the adapter that sampled it) and in ``metadata["policy_step"]``.
    An env's rollouts run ``wave`` tasks at a time (``env_groups``; None: all together).

    ``on_trajectory(task, trajectory)`` hears of each single-turn trajectory as it is made: as its
    row finishes, while the others generate, where this process decodes; after the batch with an
    engine's or a service's sampler. The trajectory handed over is the one the groups hold."""
    if env is not None:
        generate = sampler_generate(policy, sampling.temperature, sampling.top_p, generator)
        groups = env_groups(policy, env, tasks, n, generate, sampling.max_new_tokens, policy_step,
                            on_round=on_round, wave=wave)
        for trajectory in (t for g in groups for t in g.trajectories):
            trajectory.policy_version = policy_step
        return groups
    made: dict[tuple[int, int], Trajectory] = {}

    def finished(i: int, k: int, completion: Completion) -> None:
        made[i, k] = _trajectory(tasks[i], prompts[i], completion, policy_step)
        if on_trajectory is not None:
            on_trajectory(tasks[i], made[i, k])

    sampler = policy.sampler()
    if on_trajectory is not None and isinstance(sampler, Sampler):
        completions = sampler.generate(prompts, n=n, sampling=sampling, generator=generator, on_completion=finished)
    else:
        completions = sampler.generate(prompts, n=n, sampling=sampling, generator=generator)
        for i, samples in enumerate(completions):
            for k, completion in enumerate(samples):
                finished(i, k, completion)
    return [Group(task=task, trajectories=[made[i, k] for k in range(len(samples))])
            for i, (task, samples) in enumerate(zip(tasks, completions))]


def _trajectory(task: Task, prompt: list[Message], c: Completion, policy_step: int) -> Trajectory:
    return Trajectory(
        messages=[*prompt, {"role": "assistant", "content": c.text}],
        prompt_ids=c.prompt_ids, completion_ids=c.token_ids,
        completion_mask=[1] * len(c.token_ids), logprobs=c.logprobs,
        finish_reason=c.finish_reason,
        metadata={"task_id": task["id"], "policy_step": policy_step,
                  **({"prefix_break": True} if c.prefix_break else {})}, policy_version=policy_step,
    )


def reward_metrics(groups: list[Group], reward: Reward, report: RewardReport, prefix: str = "reward") -> dict[str, float]:
    """Mean/std of the total and of each component (NaN left out), plus error rates."""
    trajectories = [t for g in groups for t in g.trajectories]
    metrics: dict[str, float] = {}
    totals = [t.reward for t in trajectories if not math.isnan(t.reward)]
    metrics[f"{prefix}/total"] = statistics.fmean(totals) if totals else math.nan
    metrics[f"{prefix}/total/std"] = statistics.pstdev(totals) if len(totals) > 1 else 0.0
    for component in reward.components:
        values = [t.components.get(component.name, math.nan) for t in trajectories]
        values = [v for v in values if not math.isnan(v)]
        metrics[f"{prefix}/{component.name}"] = statistics.fmean(values) if values else math.nan
        metrics[f"{prefix}/{component.name}/std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
        calls = report.calls.get(component.name, 0)
        metrics[f"{prefix}/{component.name}/error_rate"] = report.errors.get(component.name, 0) / calls if calls else 0.0
        if component.veto:
            metrics[f"{prefix}/{component.name}/veto_rate"] = (report.vetoes.get(component.name, 0) / calls
                                                               if calls else 0.0)
        for key, value in counter_metrics(report.counters.get(component.name, {})).items():
            metrics[f"{prefix}/{component.name}/{key}"] = value
    if any(c.veto for c in reward.components) and trajectories:
        metrics[f"{prefix}/vetoed"] = sum(bool(t.metadata.get("vetoes")) for t in trajectories) / len(trajectories)
    return metrics


def counter_metrics(counters: dict[str, float]) -> dict[str, float]:
    """A judge's counters for one step: calls and tokens as counts, the rest per call."""
    calls = counters.get("calls", 0.0)
    out = dict(counters)
    if "latency_s" in counters:
        out["latency_s"] = counters["latency_s"] / calls if calls else 0.0
    if "unparseable" in counters:
        out["unparseable_rate"] = counters["unparseable"] / calls if calls else 0.0
        del out["unparseable"]
    return out


def completion_stats(groups: list[Group]) -> tuple[float, float]:
    """Mean completion length in tokens and the share of completions cut at the limit."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return math.nan, math.nan
    mean_len = statistics.fmean(sum(t.completion_mask) for t in trajectories)  # model tokens only
    return mean_len, sum(t.truncated for t in trajectories) / len(trajectories)


@dataclass
class Evaluation:
    """Validation on held-out tasks: one completion per task."""

    groups: list[Group]
    metrics: dict[str, float]
    report: RewardReport | None = None

    @property
    def rewards(self) -> list[float]:
        return [g.trajectories[0].reward for g in self.groups]


def evaluate(policy: Policy, tasks: list[Task], prompts: list[list[Message]], reward: Reward,
             sampling: Sampling, policy_step: int, env: Env | None = None,
             on_round: Callable[[int, int, int], None] | None = None) -> Evaluation:
    """One rollout of each task, scored; ``on_round`` follows an env's rounds (see ``run_states``)."""
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=policy.device).manual_seed(sampling.seed or 0)
    # An env's held-out rollouts keep their KV caches in this process: one decode batch of tasks at a
    # time (an engine's sampler keeps its caches on its server and has no such batch).
    wave = getattr(policy.sampler(), "max_batch_rows", None)
    groups = rollout_groups(policy, tasks, prompts, 1, sampling, generator, policy_step, env, on_round, wave=wave)
    report = reward.score(groups)
    metrics = reward_metrics(groups, reward, report, prefix="val/reward")
    metrics["val/completion_len"], metrics["val/truncated_ratio"] = completion_stats(groups)
    return Evaluation(groups, metrics, report)
