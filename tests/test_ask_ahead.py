"""Judges asked ahead (``Reward.ask_ahead``) while a batch is still being sampled, against a real
chat-completions server on 127.0.0.1: the scoring that follows takes their answers over, sends
nothing twice, counts the calls in its own report, and shares the reward's concurrency limit."""

from __future__ import annotations

import asyncio
import math
import threading
import time

from fastapi import FastAPI, Request

from fault_server import FaultServer, completion
from grooves.policy.sampler import Sampling
from grooves.rewards import Component, PointwiseJudge, Reward, YesNoCheck
from grooves.serve.app import ServerThread
from grooves.training.gather import rollout_groups
from test_judges import endpoint, group_of, verdict


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_a_judge_asked_ahead_is_asked_once_and_its_calls_count_in_the_scoring_that_uses_them():
    with FaultServer() as fault:
        fault.play(("reply", verdict(8)))
        judge = PointwiseJudge("q", "Short titles.", endpoint(fault))
        reward = Reward([judge, Component("length", lambda completion: 1.0)])
        group = group_of("A cat", "A dog", "A cat")  # the same output twice: one request
        for trajectory in group.trajectories:
            reward.ask_ahead(group.task, trajectory)
        wait_until(lambda: len(fault.requests) == 2)
        other = reward.score([group_of("A bird")])  # another batch scored meanwhile counts only its own call
        assert other.counters["q"]["calls"] == 1
        report = reward.score([group])
        assert len(fault.requests) == 3  # nothing asked again
        assert [t.components["q"] for t in group.trajectories] == [0.8, 0.8, 0.8]
        assert all(t.reward == 1.8 for t in group.trajectories)
        assert report.counters["q"]["calls"] == 2 and report.counters["q"]["cache_hits"] == 1
        assert report.calls["q"] == 3 and not report.errors


def test_a_judge_that_failed_when_asked_ahead_is_a_failure_recorded_where_it_is_scored_never_0():
    with FaultServer() as fault:
        fault.play(("status", 500))
        judge = PointwiseJudge("q", "r", endpoint(fault, max_retries=1))
        reward = Reward([judge])
        group = group_of("x")
        reward.ask_ahead(group.task, group.trajectories[0])
        wait_until(lambda: len(fault.requests) == 2)
        time.sleep(0.1)  # the failure settles in the client
        report = reward.score([group])
        assert math.isnan(group.trajectories[0].components["q"]) and math.isnan(group.trajectories[0].reward)
        assert report.errors["q"] == 1 and "failed 2 times" in report.first_error["q"]
        assert report.counters["q"]["calls"] == 2 and report.counters["q"]["failures"] == 1
        assert len(fault.requests) == 2  # the outcome asked ahead is the outcome: not asked again
        fault.play(("reply", verdict(6)))
        reward.score([group])  # a later scoring asks anew: failures are never cached
        assert group.trajectories[0].components["q"] == 0.6


class Held:
    """A judge server that answers yes once ``release`` is set; ``peak`` requests were in flight at once."""

    def __init__(self):
        self.release = threading.Event()
        self.in_flight = self.peak = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def answer(request: Request):
            await request.json()
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            await asyncio.to_thread(self.release.wait, 30)
            self.in_flight -= 1
            return completion('{"reason": "fine", "answer": "yes"}')

        self.app = app


def test_asking_ahead_and_scoring_share_the_rewards_concurrency_limit():
    held = Held()
    with ServerThread(held.app) as server:
        try:
            check = YesNoCheck("ok", "Is it fine?", endpoint(server, timeout=30.0))
            reward = Reward([check], max_concurrency=1)
            ahead = group_of("one", "two")
            for trajectory in ahead.trajectories:
                reward.ask_ahead(ahead.task, trajectory)
            scored = group_of("three")
            scoring = threading.Thread(target=reward.score, args=([scored],))
            scoring.start()
            wait_until(lambda: held.in_flight == 1)
            time.sleep(0.3)
            assert held.peak == 1  # one slot for everything this reward asks
            held.release.set()
            scoring.join(30)
            assert scored.trajectories[0].components["ok"] == 1.0
            report = reward.score([ahead])
            assert [t.components["ok"] for t in ahead.trajectories] == [1.0, 1.0]
            assert report.counters["ok"]["calls"] == 2 and held.peak == 1
        finally:
            held.release.set()


def test_rollouts_hand_over_each_trajectory_the_groups_hold(tiny_policy):
    tasks = [{"id": "a", "text": "one"}, {"id": "b", "text": "two"}]
    prompts = [[{"role": "user", "content": t["text"]}] for t in tasks]
    told = []
    groups = rollout_groups(tiny_policy, tasks, prompts, 3, Sampling(max_new_tokens=4, seed=1), None, 7,
                            on_trajectory=lambda task, trajectory: told.append((task["id"], trajectory)))
    held = [(g.task["id"], t) for g in groups for t in g.trajectories]
    assert len(told) == 6 and {id(t) for _, t in told} == {id(t) for _, t in held}
    assert sorted((i, id(t)) for i, t in told) == sorted((i, id(t)) for i, t in held)  # each with its own task
    assert all(t.policy_version == 7 and t.completion == t.messages[-1]["content"] for _, t in told)
