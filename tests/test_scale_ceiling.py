"""``benchmarks/scale.py``'s ceiling: the fastest a k = 1 step can be on two cores, from measured costs.

The floor is a small schedule: the generation and the update side by side for a while, each at one
thread's speed, then each job's rest alone at the speedup ``s`` every thread gives one job; while
the batch's judge tail is out (the calls of the rows that end on the decode's last step), only the
update can run. These tests hold it to that schedule found by brute force, to the cases whose answer
is known by hand, and the tail to the rows a run's own samples cut at the length limit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCALE = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("scale_benchmark", SCALE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def two_cores(scale, monkeypatch):
    monkeypatch.setattr(scale.os, "sched_getaffinity", lambda _: {0, 1})


def runs(generate1, update1, speedup=1.4, judge=2.0, call=0.3, sync_step=12.0):
    """The synchronous loop's figures on every thread and on one, as ``train`` returns them."""
    sync = {"spm": 60.0 / sync_step, "sample": generate1 / speedup + judge, "judge": judge,
            "update": update1 / speedup}
    one = {"sample": generate1 + judge, "judge": judge, "update": update1, "latency": call}
    return sync, one


def step(scale, sync, one, tail=None) -> float:
    """The floor's step time: the synchronous step over the ceiling's gain."""
    return 60.0 / sync["spm"] / scale.ceiling(sync, one, tail)[0]


def brute_force(generate1, update1, after, speedup) -> float:
    """The shortest step over a fine grid of side-by-side times (two cores, one thread each)."""
    best = float("inf")
    for i in range(20001):
        a = min(generate1, update1) * i / 20000
        best = min(best, a + (generate1 - a) / speedup + max(after, (update1 - a) / speedup))
    return best


@pytest.mark.parametrize("generate1,update1,tail", [(6.41, 7.66, 0.31), (8.0, 5.0, 0.3), (6.0, 6.2, 0.5),
                                                    (3.0, 9.0, 0.2), (7.0, 7.0, 0.3), (6.41, 7.66, 2.4)])
def test_the_floor_is_the_best_schedule_of_the_two_jobs(scale, generate1, update1, tail):
    sync, one = runs(generate1, update1, call=0.3)
    least = step(scale, sync, one, tail)
    chain = (generate1 / 1.4 + max(tail, 0.3) + update1 / 1.4) / 2
    assert least == pytest.approx(max(brute_force(generate1, update1, max(tail, 0.3), 1.4), chain, 2.0), abs=2e-3)
    # never below the floor of before: one call after the generation, the cores shared to the end
    before = 60.0 / sync["spm"] / scale.ceiling(sync, one, tail)[2]
    assert before == pytest.approx(max(0.3 + (generate1 + update1 - 1.4 * 0.3) / 2, 2.0,
                                       (generate1 / 1.4 + 0.3 + update1 / 1.4) / 2))
    assert least >= before - 1e-9


def test_equal_jobs_run_side_by_side_and_a_longer_one_finishes_alone(scale):
    sync, one = runs(5.0, 5.0, judge=1.0, call=0.0)
    assert step(scale, sync, one) == pytest.approx(5.0)
    # an update 2 s of one thread longer: that part runs alone, at 1.4x
    sync, one = runs(5.0, 7.0, judge=1.0, call=0.0)
    assert step(scale, sync, one) == pytest.approx(5.0 + 2.0 / 1.4)
    # a judge tail longer than that rest: the update waits out the tail on its own
    assert step(scale, sync, one, tail=3.0) == pytest.approx(7.0 - 1.4 * 3.0 + (5.0 - 2.8) / 1.4 + 3.0)


def test_the_tail_is_the_cut_rows_calls_in_rounds_of_the_judges_concurrency(scale):
    rows = [{"train/truncated_ratio": 15 / 16, "reward/judge/latency_s": 0.3},   # 15 cut: 8 rounds
            {"train/truncated_ratio": 0.0, "reward/judge/latency_s": 0.3},       # none: the last call
            {"train/truncated_ratio": 4 / 16, "reward/judge/latency_s": 0.5}]    # 4 cut: 2 rounds
    assert scale.judge_tail(rows, 16, 2) == pytest.approx((8 * 0.3 + 0.3 + 2 * 0.5) / 3)
    assert scale.judge_tail(rows[:1], 16, 1) == pytest.approx(15 * 0.3)
