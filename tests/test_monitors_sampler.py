"""The stale/drifting-sampler detector (issue 16, part 5) on short real runs of the tiny model:
a sampler frozen at version 0, sampler logprobs offset by +0.5, sampler logprobs copied from the
trainer, and a clean synchronous run that must stay quiet."""

from __future__ import annotations

import math

import torch

from grooves import algorithms
from grooves.monitors import Monitors, MonitorsConfig
from grooves.policy import LoRA, Policy
from grooves.policy.logprobs import build_token_batch
from grooves.policy.sampler import Sampling
from grooves.training.config import OptimConfig
from grooves.training.gather import rollout_groups
from grooves.training.trainer import Trainer

TASKS = [{"id": f"t{i}", "prompt": f"count {i}"} for i in range(2)]
PROMPTS = [[{"role": "user", "content": t["prompt"]}] for t in TASKS]
SAMPLING = Sampling(temperature=1.0, max_new_tokens=4)


def even_share(ids: list[int]) -> float:
    """A reward the tiny model can move: the share of even token ids."""
    return sum(i % 2 == 0 for i in ids) / max(1, len(ids))


def run(steps: int, *, frozen: bool = False, plant=None, monitors: Monitors | None = None):
    """Sample (G = 4 for 2 tasks) -> reward -> train_step -> monitors, ``steps`` times.

    ``frozen``: a separate sampler policy that never receives the trainer's adapter (version 0).
    ``plant(step, trainer, groups)`` may corrupt the step's trajectories before training.
    Returns every alert and each step's metrics."""
    trainer_policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    sampler_policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0) if frozen else trainer_policy
    trainer = Trainer(trainer_policy, algorithms.grpo(), OptimConfig(learning_rate=5e-2), max_completion_length=4,
                      use_sampler_logprobs=True, minibatches=2)
    monitors = monitors or Monitors(MonitorsConfig())
    generator = torch.Generator().manual_seed(0)
    alerts, history = [], []
    for step in range(1, steps + 1):
        version = 0 if frozen else trainer.step
        groups = rollout_groups(sampler_policy, TASKS, PROMPTS, 4, SAMPLING, generator, version)
        for g in groups:
            for t in g.trajectories:
                t.reward, t.policy_version = even_share(t.completion_ids), version
        if plant is not None:
            plant(step, trainer, groups)
        metrics = trainer.train_step(groups)
        alerts += [a for a in monitors.observe(step, groups, metrics) if a.detector == "sampler"]
        history.append(metrics)
    return alerts, history


def test_a_clean_synchronous_run_gives_no_alert():
    alerts, history = run(6)
    assert alerts == []
    kls = [m["train/sampler_kl"] for m in history if "train/sampler_kl" in m]
    assert len(kls) >= 4 and max(kls) < 1e-3  # the in-process sampler matches the trainer
    assert all(m["train/is_correction"] == 1.0 for m in history)  # use_sampler_logprobs: "auto" is on


def test_a_frozen_sampler_fires_the_stall_alert():
    alerts, history = run(6, frozen=True)
    stalls = [a for a in alerts if a.key == "stall"]
    assert stalls, alerts
    first = stalls[0]
    # version 0 appears at step 1; 4 steps later (step 5) it has not advanced: warn
    assert first.step == 5 and first.severity == "warn"
    assert first.evidence["policy_version"] == 0 and first.evidence["steps_stuck"] == 4
    assert history[-1]["train/policy_lag"] == 5.0  # the trainer's step 5 trains on version 0


def test_a_logprob_offset_fires_the_mismatch_alert():
    def offset(step, trainer, groups):
        if step >= 5:  # four clean steps, then the sampler's logprobs are the truth + 0.5
            for g in groups:
                for t in g.trajectories:
                    t.logprobs = [lp + 0.5 for lp in t.logprobs]

    alerts, history = run(5, plant=offset)
    jumps = [a for a in alerts if a.key == "jump"]
    assert [a.step for a in jumps] == [5] and jumps[0].severity == "critical"
    # k3 of a constant -0.5 log-ratio: e^-0.5 + 0.5 - 1 = 0.1065 (plus the tiny clean mismatch)
    assert math.isclose(history[-1]["train/sampler_kl"], 0.1065, abs_tol=2e-3)
    assert jumps[0].evidence["value"] >= 0.1


def test_sampler_logprobs_copied_from_the_trainer_fire_the_identical_alert():
    def copy_trainer(step, trainer, groups):
        if step >= 3:  # claim the batch came from an older adapter, but hand in the trainer's own logprobs
            flat = [t for g in groups for t in g.trajectories]
            own = trainer._forward_no_grad(build_token_batch(flat))
            for row, t in enumerate(flat):
                t.logprobs = own[row, : len(t.completion_ids)].tolist()
                t.policy_version = trainer.step - 1

    alerts, history = run(3, plant=copy_trainer)
    assert history[-1]["train/is_ratio_exact_frac"] == 1.0 and history[-1]["train/policy_lag"] == 1.0
    assert [(a.key, a.step, a.severity) for a in alerts] == [("identical", 3, "critical")]


def test_the_version_metric_wins_and_the_state_survives_a_resume():
    monitors = Monitors(MonitorsConfig())
    for step in range(1, 4):
        monitors.observe(step, [], {"rollout/policy_version": 7.0})
    resumed = Monitors(MonitorsConfig())
    resumed.load_state_dict(monitors.state_dict())
    # version 7 since step 1; at step 5 it has been stuck 4 steps
    alerts = resumed.observe(5, [], {"rollout/policy_version": 7.0})
    assert [(a.detector, a.key, a.severity) for a in alerts] == [("sampler", "stall", "warn")]
    assert resumed.observe(6, [], {"rollout/policy_version": 8.0}) == []  # advancing again
