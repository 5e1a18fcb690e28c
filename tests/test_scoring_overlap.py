"""The async pipeline scores a batch beside the next generation (issue 30, part 2.2).

Tiny random-weight model; the judge is a real chat-completions server on 127.0.0.1 that holds
every request until the test releases it, and fails the tasks the test names (HTTP 422).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import threading
import time

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grooves.rewards.compose import RewardReport
from grooves.serve.app import ServerThread
from grooves.runs.store import RunStore
from grooves.training import run_config
from grooves.training.build import load_policy, task_sets
from grooves.training.config import RunConfig
from grooves.training.pipeline.local import AsyncPipeline, Batch, LocalRollouts
from grooves.training.pipeline.process import ProcessRollouts
from test_async import async_config, rows
from test_sampler_process import sampling

G = 2  # completions per task


class Judge:
    """Answers a score of 7 of 10 (0.7) once ``release`` is set; HTTP 422 for the task ids in ``fail``."""

    def __init__(self):
        self.release = threading.Event()
        self.fail: set[str] = set()
        self.fail_all = False
        self.seen: list[str] = []  # task ids, as requests arrive
        self.answered = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def grade(request: Request):
            body = await request.json()
            task = re.search(r"marker-(\w+)-marker", json.dumps(body)).group(1)
            self.seen.append(task)
            await asyncio.to_thread(self.release.wait, 60)
            self.answered += 1
            if self.fail_all or task in self.fail:
                return JSONResponse({"error": {"message": "planted failure"}}, status_code=422)
            return {"id": "judge", "object": "chat.completion", "created": int(time.time()), "model": "judge",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": '{"reason": "ok", "score": 7}'}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

        self.app = app


@pytest.fixture
def judge():
    held = Judge()
    with ServerThread(held.app) as server:
        held.url = server.base_url
        yield held
        held.release.set()  # no request left hanging when the server stops


def judged_config(tmp_path, url: str, sampler: str = "process") -> RunConfig:
    """The tiny async run (plain GRPO, k = 1) with the judge as a third, required component."""
    data = async_config(tmp_path, k=1, async_sampler=sampler).model_dump()
    data["reward"]["endpoints"] = {"held": {"base_url": url, "model": "judge", "api_key_env": None,
                                            "timeout": 30.0, "max_retries": 0}}
    data["reward"]["components"].append({"kind": "judge", "name": "judge", "endpoint": "held", "weight": 0.1,
                                         "rubric": "Any reply.", "high": 10.0, "input": "marker-{id}-marker"})
    return RunConfig.model_validate(data)


def pipeline_over(rollouts, sets, last: int):
    """An async pipeline (k = 1) whose batch s is the s-th pair of training tasks; ``started`` and
    ``sampled`` say when each batch's generation began and ended."""
    started = {s: threading.Event() for s in range(1, last + 1)}
    sampled = {s: threading.Event() for s in range(1, last + 1)}

    def produce(step: int) -> Batch:
        started[step].set()
        t0 = time.perf_counter()
        drawn = [(sets[0], task) for task in sets[0].train[2 * step - 2: 2 * step]]
        reports = {s.name: RewardReport() for s in sets}
        groups = rollouts.rollout(drawn, step, 1, reports)
        sampled[step].set()
        return Batch(step, groups, list(groups), reports, 1, time.perf_counter() - t0)  # as the loop's

    return AsyncPipeline(rollouts, produce, 0, k=1, first=1, last=last), started, sampled


def wait_for_calls(judge: Judge, count: int = 1) -> None:
    deadline = time.monotonic() + 30
    while len(judge.seen) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def ids(batch: Batch) -> list[str]:
    return [g.task["id"] for g in batch.sampled]


def versions(batch: Batch) -> set[int]:
    return {t.policy_version for g in batch.sampled for t in g.trajectories}


def judged(batch: Batch) -> list[float]:
    return [t.components["judge"] for g in batch.sampled for t in g.trajectories]


def test_the_sampler_process_samples_the_next_batch_while_the_judge_holds_this_one(tmp_path, judge):
    config = judged_config(tmp_path, judge.url)
    policy, sets = load_policy(config), task_sets(config)
    tasks = sets[0].train
    judge.fail = {tasks[2]["id"], tasks[3]["id"]}  # batch 2's judge calls fail
    rollouts = ProcessRollouts(config, policy, sets, G, sampling(config))
    pipeline, started, sampled = pipeline_over(rollouts, sets, last=3)
    try:
        assert sampled[2].wait(120), "batch 2 was not sampled while the judge held batch 1"
        assert judge.answered == 0  # batch 1 was not scored when batch 2's generation ended
        # each completion was asked for as its row finished: batch 2's too, while batch 1's are held
        wait_for_calls(judge, count=2 * 2 * G)
        assert sorted(judge.seen) == sorted(t["id"] for t in tasks[:4] for _ in range(G))
        time.sleep(0.3)
        assert not started[3].is_set()  # batch 3 needs version 1: at most k = 1 batch scored beside a generation
        judge.release.set()
        one, two = pipeline.take(1), pipeline.take(2)
        assert ids(one) == [tasks[0]["id"], tasks[1]["id"]] and ids(two) == [tasks[2]["id"], tasks[3]["id"]]
        assert versions(one) == versions(two) == {0}  # the version that sampled them
        assert judged(one) == pytest.approx([0.7] * 2 * G)
        assert all(math.isfinite(t.reward) for g in one.sampled for t in g)
        assert one.reports[""].calls["judge"] == 2 * G and not one.reports[""].errors
        # each request once, its call counted in the step that used it
        assert one.reports[""].counters["judge"]["calls"] == two.reports[""].counters["judge"]["calls"] == 2 * G
        assert len(judge.seen) == 2 * 2 * G
        # a judge that failed is a recorded failure: NaN (a required component) and counted, never 0
        assert all(math.isnan(v) for v in judged(two)) and all(math.isnan(t.reward) for g in two.sampled for t in g)
        assert two.reports[""].errors["judge"] == 2 * G and "422" in two.reports[""].first_error["judge"]
        with torch.no_grad():
            for p in policy.model.parameters():
                if p.requires_grad:
                    p.add_(0.05)
        pipeline.publish(1)
        assert versions(pipeline.take(3)) == {1}
        assert rollouts.replaced == 0
    finally:
        judge.release.set()
        pipeline.close()


def test_a_sampler_process_killed_while_its_batch_is_judged_loses_nothing(tmp_path, judge):
    config = judged_config(tmp_path, judge.url)
    policy, sets = load_policy(config), task_sets(config)
    rollouts = ProcessRollouts(config, policy, sets, G, sampling(config))
    pipeline, _, sampled = pipeline_over(rollouts, sets, last=2)
    try:
        assert sampled[2].wait(120)
        wait_for_calls(judge)
        os.kill(rollouts._process.pid, signal.SIGKILL)  # batch 1 is being judged, batch 2 waits its turn
        judge.release.set()
        one, two = pipeline.take(1), pipeline.take(2)
        assert rollouts.replaced == 1
        for batch in (one, two):  # scored again by the new child, from the groups this process kept
            assert judged(batch) == pytest.approx([0.7] * 2 * G) and versions(batch) == {0}
            assert batch.reports[""].calls["judge"] == 2 * G
    finally:
        judge.release.set()
        pipeline.close()


def test_a_sampler_thread_with_defer_samples_the_next_batch_while_the_judge_holds_this_one(tmp_path, judge):
    config = judged_config(tmp_path, judge.url)
    policy, sets = load_policy(config), task_sets(config)
    assert not LocalRollouts(policy, sets, G, sampling(config), torch.Generator()).defer_scoring()  # off by default
    rollouts = LocalRollouts(policy, sets, G, sampling(config), torch.Generator().manual_seed(0), copy=True,
                             defer=True)
    pipeline, _, sampled = pipeline_over(rollouts, sets, last=2)
    try:
        assert sampled[2].wait(60)
        assert judge.answered == 0
        judge.release.set()
        one, two = pipeline.take(1), pipeline.take(2)
        assert judged(one) == judged(two) == pytest.approx([0.7] * 2 * G)
        assert one.sample_time > 0 and versions(one) == versions(two) == {0}
        assert 0 < one.generate_time < one.sample_time  # its sampling alone, then the judge held it
    finally:
        judge.release.set()
        pipeline.close()


def test_a_judge_that_fails_in_a_run_with_a_sampler_process_is_an_alert_and_nan_not_0(tmp_path, judge):
    judge.fail_all = True
    judge.release.set()
    config = judged_config(tmp_path, judge.url)
    config.steps = 2
    run = run_config(config, out=tmp_path / "run", progress=False)
    by_step = rows(run)
    assert sorted(by_step) == [1, 2]
    for row in by_step.values():
        assert row["reward/judge/error_rate"] == 1.0 and row["reward/judge"] is None  # NaN, written as null
    store = RunStore(tmp_path / "run")
    try:
        alerts = [a for a in store.read_alerts() if a["detector"] == "reward_error"]
        stored = store.db.execute("SELECT data FROM trajectories WHERE split = 'train'").fetchall()
    finally:
        store.close()
    assert len(alerts) == 1 and "422" in alerts[0]["evidence"]["first_error"]
    assert len(stored) == 2 * 2 * 4  # 2 steps of 2 tasks x 4 (the run's group size), scored in the child
    assert all(json.loads(d)["metadata"]["reasons"]["judge"].startswith("failed: ") for (d,) in stored)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_run_with_a_sampler_thread_scores_apart_unless_the_draw_reads_the_rewards(tmp_path, judge, dynamic):
    judge.release.set()
    config = judged_config(tmp_path, judge.url, sampler="thread")
    config.steps = 2
    config.algorithm.dynamic_sampling = dynamic
    by_step = rows(run_config(config, out=tmp_path / "run", progress=False))
    assert sorted(by_step) == [1, 2]
    for row in by_step.values():
        assert row["reward/judge"] == pytest.approx(0.7)
        # train/generate_time: the batch's sampling alone, recorded where its scoring ran apart
        assert ("train/generate_time" in row) is not dynamic
        if not dynamic:
            assert 0 < row["train/generate_time"] <= row["train/sample_time"]
