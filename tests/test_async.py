"""The asynchronous pipeline (train.max_off_policy_steps = k) on the tiny random-weight model."""

from __future__ import annotations

import json
import time

import pytest

from grooves.training import load_config, run_config
from grooves.training.pipeline.local import AsyncPipeline, Batch, LocalRollouts, staleness_metrics
from grooves.runs.store import RunStore
from grooves.training.trainer import Trainer
from grooves.types import Group, Trajectory
from helpers import FakeRollouts, tiny_config


def async_config(tmp_path, steps: int = 4, k: int = 1, **train):
    """The helpers' tiny run with plain GRPO (no dynamic sampling: every step has 2 x 4 trajectories)."""
    path = tiny_config(tmp_path, steps=steps)
    text = path.read_text().replace('preset = "dapo"\nmax_sampling_rounds = 2', 'preset = "grpo"')
    path.write_text(text)
    config = load_config(path)
    config.train.max_off_policy_steps = k
    for key, value in train.items():
        setattr(config.train, key, value)
    return config


def rows(run):
    return {row["step"]: row for row in run.metrics if row["step"] > 0}


def versions_in_store(run_dir):
    store = RunStore(run_dir)
    try:
        found = store.db.execute("SELECT step, data FROM trajectories WHERE split = 'train'").fetchall()
    finally:
        store.close()
    return [(step, json.loads(data)["policy_version"]) for step, data in found]


# --- the pipeline itself, with a fake backend (no model) ------------------------------------


def test_the_producer_waits_for_version_b_minus_1_minus_k():
    """Batch b starts only once version b-1-k is published, and runs ahead no further."""
    rollouts = FakeRollouts()
    started: dict[int, int] = {}

    def produce(step: int) -> Batch:
        started[step] = rollouts.version
        return Batch(step, [], [], {}, 1, 0.0)

    pipeline = AsyncPipeline(rollouts, produce, 0, k=2, first=1, last=6)
    try:
        assert pipeline.take(1).step == 1
        time.sleep(0.2)  # time to run ahead as far as it may
        assert sorted(started) == [1, 2, 3]  # version 0 allows batches 1..1+k
        for version in range(1, 4):
            pipeline.publish(version)
            assert pipeline.take(version + 1).step == version + 1
        time.sleep(0.2)
        assert sorted(started) == [1, 2, 3, 4, 5, 6]
        assert all(started[b] >= b - 1 - 2 for b in started)  # never more than k behind
        assert rollouts.applied == sorted(set(rollouts.applied))
    finally:
        pipeline.close()


def test_an_error_in_the_producer_reaches_the_loop():
    def produce(step):
        raise RuntimeError("judge exploded")

    pipeline = AsyncPipeline(FakeRollouts(), produce, 0, k=1, first=1, last=3)
    with pytest.raises(RuntimeError, match="judge exploded"):
        pipeline.take(1)
    pipeline.close()


def test_staleness_metrics_by_hand():
    def traj(version):
        return Trajectory([], [1], [2], [1], [0.0], policy_version=version)

    groups = [Group({"id": "a"}, [traj(3), traj(5)]), Group({"id": "b"}, [traj(4)])]
    assert staleness_metrics(groups, trainer_step=5) == {
        "rollout/policy_version": 3.0, "rollout/staleness/mean": 1.0, "rollout/staleness/max": 2.0}


# --- whole runs -------------------------------------------------------------------------------


def test_k0_is_the_synchronous_loop(tmp_path):
    run = run_config(async_config(tmp_path, steps=3, k=0), out=tmp_path / "sync", progress=False)
    for step, row in rows(run).items():
        assert row["rollout/policy_version"] == step - 1
        assert row["rollout/staleness/max"] == 0
        assert row["rollout/dropped_stale"] == 0
    assert sorted(set(versions_in_store(tmp_path / "sync"))) == [(1, 0), (2, 1), (3, 2)]


def test_k1_samples_the_next_step_during_the_update(tmp_path, monkeypatch):
    """A planted slow update (0.6 s): with k = 1 the next batch is sampled meanwhile, from the
    adapter one update behind, so the loop hardly waits for rollouts and nothing is dropped."""
    slow = Trainer.train_step

    def slow_step(self, groups):
        time.sleep(0.6)
        return slow(self, groups)

    monkeypatch.setattr(Trainer, "train_step", slow_step)
    run = run_config(async_config(tmp_path, steps=4, k=1), out=tmp_path / "async", progress=False)
    by_step = rows(run)
    assert by_step[1]["rollout/policy_version"] == 0
    for step in (2, 3, 4):
        assert by_step[step]["rollout/policy_version"] == step - 2  # sampled during update step-1
        assert by_step[step]["rollout/staleness/max"] == 1
        assert by_step[step]["rollout/dropped_stale"] == 0
        # the batch started as the previous update began, so at least the planted 0.6 s is hidden
        assert by_step[step]["train/wait_time"] < max(0.1, by_step[step]["train/sample_time"] - 0.3)
    assert {v for _, v in versions_in_store(tmp_path / "async")} == {0, 1, 2}


def test_trajectories_older_than_k_are_dropped_and_counted(tmp_path, monkeypatch):
    """A planted frozen sampler: its weights stop at version 1, so from step 4 on (trainer at
    version 3) every trajectory is 2 updates old, more than k = 1: all 8 are dropped, counted,
    and the step trains nothing."""
    apply = LocalRollouts.apply

    def frozen(self, version, state):
        if version <= 1:
            apply(self, version, state)

    monkeypatch.setattr(LocalRollouts, "apply", frozen)
    run = run_config(async_config(tmp_path, steps=5, k=1), out=tmp_path / "frozen", progress=False)
    by_step = rows(run)
    for step in (1, 2, 3):
        assert by_step[step]["rollout/dropped_stale"] == 0
    for step in (4, 5):
        assert by_step[step]["rollout/policy_version"] == 1
        assert by_step[step]["rollout/staleness/max"] == step - 2
        assert by_step[step]["rollout/dropped_stale"] == 8
        assert by_step[step]["train/skipped"] == 1


def test_an_async_run_resumes_from_its_checkpoint(tmp_path):
    """A resumed async run continues after its checkpoint and draws the tasks the uninterrupted
    run drew (the checkpoint keeps the draw position after its own step's batch, not the
    pipeline's, which had run ahead)."""
    straight = run_config(async_config(tmp_path, steps=4), out=tmp_path / "straight", progress=False)
    first = run_config(async_config(tmp_path, steps=2), out=tmp_path / "resumed", progress=False)
    assert first.step == 2
    resumed = run_config(async_config(tmp_path, steps=4), out=tmp_path / "resumed", resume=True, progress=False)
    assert resumed.step == 4
    assert [row["step"] for row in resumed.metrics] == [0, 1, 2, 3, 4]
    assert (tmp_path / "resumed" / "checkpoints" / "step-0004").is_dir()

    def task_ids(run_dir, step):
        store = RunStore(run_dir)
        try:
            return sorted(r[0] for r in store.db.execute(
                "SELECT DISTINCT task_id FROM trajectories WHERE split = 'train' AND step = ?", (step,)))
        finally:
            store.close()

    for step in (3, 4):
        assert task_ids(tmp_path / "resumed", step) == task_ids(tmp_path / "straight", step)
    assert rows(resumed)[3]["rollout/policy_version"] == 2  # sampled from the checkpoint's adapter
    assert straight.step == 4


def test_the_sampler_copy_never_shares_weights_with_the_trainer(tiny_policy):
    import torch

    from grooves.policy.sampler import Sampling

    rollouts = LocalRollouts(tiny_policy, [], 2, Sampling(), torch.Generator(), copy=True)
    name, trained = next((n, p) for n, p in tiny_policy.model.named_parameters() if p.requires_grad)
    copied = dict(rollouts.policy.model.named_parameters())[name]
    with torch.no_grad():
        trained.add_(1.0)
    assert not torch.equal(trained, copied)
    rollouts.apply(1, rollouts.snapshot())
    assert torch.equal(trained, copied) and rollouts.version == 1
