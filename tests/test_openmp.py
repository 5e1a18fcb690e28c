"""Handing torch's OpenMP threads to a worker thread (grooves.policy.openmp): the pool the loading
thread made is freed, results do not change, and the server's and the service's workers give
theirs back when idle. Speed is measured in benchmarks/serve_latency.py, not here."""

import os
import sys
import threading
import time

import pytest
import torch
from helpers import FakeRollouts

from grooves.backend.queue import WorkQueue
from grooves.policy import Policy
from grooves.policy.openmp import release_pool
from grooves.rewards.runner import run_coroutine
from grooves.serve import engine as engine_module
from grooves.serve.adapters import AdapterRegistry
from grooves.serve.engine import Engine, Finished, GenerationRequest

needs_libgomp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info()
    or torch.get_num_threads() < 2, reason="torch on GNU OpenMP with two or more threads")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@needs_libgomp
def test_release_pool_frees_the_calling_threads_openmp_workers_and_results_stay():
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    before = x @ x  # a parallel product: this thread's pool exists now
    with_pool = os_threads()
    assert release_pool() is True
    assert os_threads() == with_pool - (torch.get_num_threads() - 1)  # its workers are gone
    assert torch.equal(x @ x, before)  # a new pool, the same numbers
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("y", x @ x))
    worker.start()
    worker.join()
    assert torch.equal(got["y"], before)


@needs_libgomp
def test_a_caller_waiting_for_its_rewards_gives_back_its_openmp_threads():
    """A judge served in this process decodes while the trainer waits in ``run_coroutine``."""
    async def nothing():
        return 7

    assert run_coroutine(nothing()) == 7  # the rewards' loop thread exists from here on
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    x @ x  # the trainer's own work: this thread's pool
    with_pool = os_threads()
    assert run_coroutine(nothing()) == 7
    assert os_threads() == with_pool - (torch.get_num_threads() - 1)


def test_release_pool_says_whether_a_libgomp_freed_and_needs_no_pool():
    on_libgomp = sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info()
    assert release_pool() is on_libgomp
    assert release_pool() is on_libgomp  # twice in a row: nothing left to free, still no error


def test_the_service_worker_gives_its_threads_back_when_idle():
    idle = threading.Event()
    work = WorkQueue(8, on_idle=idle.set)
    try:
        assert idle.wait(5)  # nothing queued: the worker is idle at once
    finally:
        work.close()


def test_the_engine_frees_the_loading_threads_pool_and_its_own_after_a_batch(monkeypatch):
    calls = []
    monkeypatch.setattr(engine_module, "release_pool", lambda: calls.append(threading.current_thread().name))
    policy = Policy.load("tiny")
    engine = Engine(policy, AdapterRegistry(policy, None)).start()
    try:
        assert calls == [threading.current_thread().name]  # the caller, which loaded the model
        done = threading.Event()
        events = []
        engine.submit(GenerationRequest("tiny", [5, 6, 7], lambda e: (events.append(e), done.set()), max_tokens=2,
                                        temperature=0))
        assert done.wait(30) and isinstance(events[-1], Finished)
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls[1:] == ["grooves-engine"]  # idle after its batch
    finally:
        engine.stop()


@needs_libgomp
def test_an_async_pipelines_sampler_thread_gives_back_its_threads_while_it_waits():
    """With ``train.async_sampler = "thread"`` the sampler thread and the trainer compute in one
    process: the sampler frees its pool whenever it waits for the trainer (and the trainer its own
    whenever it waits for a batch), so the one computing alone is not throttled."""
    from grooves.training.pipeline.local import AsyncPipeline, Batch

    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    during = {}

    def produce(step):
        x @ x  # sampling: the sampler thread's pool
        during[step] = os_threads()
        return Batch(step, [], [], {}, 1, 0.0)

    pipeline = AsyncPipeline(FakeRollouts(), produce, 0, k=1, first=1, last=3)
    try:
        pipeline.take(1)
        pipeline.take(2)  # batch 3 waits for version 1, which is never published here
        deadline = time.monotonic() + 5
        while os_threads() > during[2] - (torch.get_num_threads() - 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os_threads() == during[2] - (torch.get_num_threads() - 1)
    finally:
        pipeline.close()
