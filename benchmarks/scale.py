"""Throughput of the synchronous loop, the async pipeline (k = 1) and Ray with 2 workers, in one run.

The async mode measured (``async_spm``) samples in a child process (``train.async_sampler =
"process"``); async k = 1 with a sampler thread in the trainer's process is run as well and
printed beside it (``--no-thread`` leaves it out).

The task is the demo's (titles, the bundled SmolLM2-135M-Instruct, LoRA rank 8); the reward is
the demo's title verifier plus a pointwise LLM judge served on 127.0.0.1 that answers every
request after a fixed 300 ms (its score: how close the title is to 6 words), with at most
``--judge-concurrency`` requests in flight (``reward.max_concurrency``, default 2: a
rate-limited judge). That wait is what the async pipeline hides: the sampler process asks the
judge for each completion as its row finishes, hands the batch to a scorer thread that collects
the answers, and samples the next one meanwhile, and all of it runs beside the update. The
synchronous loop asks the judge once a batch is sampled.

Each mode trains the same config from the same seed for ``--steps`` steps; steps per minute
come from the loop's own step times (``train/total_step_time``) of steps 2..N (step 1 fills
the pipeline). After training, the policies of the synchronous and the async run are scored
greedily on the same held-out tasks; the standard error is that of the mean per-task
difference. The last line is machine-readable:

    scale sync_spm=X async_spm=Y ray2_spm=Z heldout_sync=A heldout_async=B stderr=S async_ceiling=C thread_ceiling=D

``async_ceiling`` is the async run's share of the ceiling (below): ``async_spm`` over the steps
per minute of a k = 1 step at its floor, the most async k = 1 can reach on this machine's cores
with the completions it sampled (goal 0.90 on the recorded setting; nan with ``--no-ceiling``);
``thread_ceiling`` the same for the run with a sampler thread (nan with ``--no-thread``). The
floor counts what must follow a batch's generation from the run's own rows: those cut at the
length limit end together, and their judge calls go at the judge's concurrency (see ``ceiling``;
the share under the floor of before is printed beside it).

    pip install -e '.[ray]'
    python benchmarks/scale.py                # the recorded setting (docs/benchmarks.md)
    python benchmarks/scale.py --judge-concurrency 1 --no-ray --no-thread   # the judge one request at a time
    python benchmarks/scale.py --quick        # a smoke check on the tiny random-weight model

With the judge answering one request at a time, a step's rollouts wait twice as long for it and
the overlap has more to hide: there the goal is async at least 1.5x the synchronous loop.

The judge runs in a process of its own, as a judge service would: served from a thread of the
trainer's process, it would share the trainer's interpreter lock with the update.

Each mode trains in a fresh process with this one's environment: OpenMP's default wait policy
unless ``OMP_WAIT_POLICY`` is set. Until 2026-12-07 the sampler-process mode ran under
``PASSIVE``, which ``grooves train`` then set so that the trainer's idle threads would not spin
on the sampler's core; since the trainer gives way while the child generates, ``PASSIVE`` only
slows the update's two-thread parts (its threads sleep and wake between every small kernel).
See docs/scale.md.

A last run trains the synchronous loop on one torch thread (``--no-ceiling`` leaves it out):
its generation and update times, with the synchronous loop's, give the most async k = 1 can
gain on this machine's cores, printed as the ``ceiling`` line (see ``ceiling``) and, as the
async run's share of it, ``async_ceiling``.

The sampler process runs half of torch's threads (one on 2 cores), and the trainer the rest
while the child generates, all of them otherwise. ``--async-threads N`` sets the trainer's
torch threads (and a sampler thread's) in the async runs; the other modes keep torch's default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request

from grooves.serve.app import ServerThread

JUDGE_DELAY_S = 0.3


def judge_app(delay: float) -> FastAPI:
    """A chat-completions endpoint that grades a title by its word count, after ``delay`` seconds."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def grade(request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        found = re.search(r"<output>\n(.*?)\n</output>", prompt, re.S)
        words = len(found.group(1).split()) if found else 0
        score = max(0.0, 10.0 - 2.0 * abs(words - 6))
        await asyncio.sleep(delay)
        content = '{"reason": "length", "score": %g}' % score
        return {"id": "judge", "object": "chat.completion", "created": int(time.time()), "model": "judge",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}

    return app


def serve_judge(urls) -> None:
    """The judge's own process: serve until killed, after putting its URL on ``urls``."""
    with ServerThread(judge_app(JUDGE_DELAY_S)) as judge:
        urls.put(judge.base_url)
        while True:
            time.sleep(3600)


class JudgeProcess:
    """The 300 ms judge, served on 127.0.0.1 from a spawned process."""

    def __enter__(self) -> JudgeProcess:
        context = multiprocessing.get_context("spawn")
        urls = context.Queue()
        self.process = context.Process(target=serve_judge, args=(urls,), name="judge", daemon=True)
        self.process.start()
        self.base_url = urls.get(timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.join()


def config_for(args, judge_url: str, name: str, k: int, ray: bool, sampler: str):
    from grooves.training.config import parse_config

    data = {
        "name": name, "seed": 0, "steps": args.steps,
        "model": {"spec": args.model, "device": "cpu"},
        "lora": {"rank": 8, "alpha": 16},
        "tasks": {"source": "builtin:titles"},
        "reward": {"builtin": "titles", "max_concurrency": args.judge_concurrency,
                   "endpoints": {"slow": {"base_url": judge_url, "model": "judge", "api_key_env": None,
                                          "timeout": 30.0}},
                   "components": [{"kind": "judge", "name": "judge", "endpoint": "slow", "weight": 0.1,
                                   "rubric": "A title of about six words.", "high": 10.0}]},
        "algorithm": {"preset": "grpo"},
        "sampling": {"max_completion_length": args.max_new},
        "optim": {"learning_rate": args.lr},
        "train": {"group_size": args.group, "tasks_per_step": args.tasks, "max_off_policy_steps": k,
                  "async_sampler": sampler},
        "log": {"save_every": args.steps, "val_every": 10_000, "val_size": 0, "tensorboard": False,
                "kl_every": 0},
        "monitors": {"enabled": False},  # the same for every mode; the tiny model's gibberish trips them
    }
    if ray:
        data["ray"] = {"workers": 2, "cpus_per_worker": 1}
    return parse_config(data)


MODES = {  # name: (max_off_policy_steps, Ray, train.async_sampler)
    "sync": (0, False, "thread"),
    "sync1": (0, False, "thread"),  # the synchronous loop on one torch thread: the ceiling's costs
    "async": (1, False, "process"),
    "thread": (1, False, "thread"),
    "ray2": (1, True, "thread"),
}


def train(args, runs: Path, name: str) -> dict:
    """Train one mode in this process; return its steps per minute over steps 2..N and medians."""
    from grooves.training.build import load_policy, task_sets
    from grooves.training.loop import TrainingRun

    k, ray, sampler = MODES[name]
    if k and args.async_threads:
        torch.set_num_threads(args.async_threads)
    if name == "sync1":
        torch.set_num_threads(1)
    config = config_for(args, args.judge_url, name, k, ray, sampler)
    if ray:
        import ray as ray_module

        ray_module.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                        logging_level="warning")
    try:
        run = TrainingRun(config, load_policy(config), task_sets(config), runs / name).run()  # progress on stderr
    finally:
        if ray:
            ray_module.shutdown()
    rows = [row for row in run.metrics if row["step"] >= 2]
    times = [row["train/total_step_time"] for row in rows]
    # the judge's wait in a step: its calls in rounds of max_concurrency, each as long as a call's mean
    judge = [math.ceil(row.get("reward/judge/calls", 0.0) / args.judge_concurrency)
             * row.get("reward/judge/latency_s", 0.0) for row in rows]
    return {"spm": 60.0 * len(times) / sum(times), "step": statistics.median(times),
            "wait": statistics.median(row.get("train/wait_time", math.nan) for row in rows),
            "sample": statistics.fmean(row["train/sample_time"] for row in rows),
            "update": statistics.fmean(row.get("train/step_time", 0.0) for row in rows),  # 0 for a skipped step
            "judge": statistics.fmean(judge), "mean_step": statistics.fmean(times),
            "mean_wait": statistics.fmean(row.get("train/wait_time", math.nan) for row in rows),
            "generate": statistics.fmean(row.get("train/generate_time", math.nan) for row in rows),
            "tail": judge_tail(rows, args.group * args.tasks, args.judge_concurrency),
            "latency": statistics.fmean(row.get("reward/judge/latency_s", 0.0) for row in rows)}  # one call's


def measure(args, runs: Path, name: str) -> dict:
    """Train one mode in a fresh process (its own OpenMP settings); print it, return what ``train`` returned."""
    variables = dict(os.environ)
    argv = [sys.executable, __file__, "--mode", name, "--judge-url", args.judge_url, "--runs", str(runs),
            "--steps", str(args.steps), "--group", str(args.group), "--tasks", str(args.tasks),
            "--max-new", str(args.max_new), "--lr", str(args.lr), "--judge-concurrency", str(args.judge_concurrency),
            "--async-threads", str(args.async_threads), *(["--quick"] if args.quick else [])]
    done = subprocess.run(argv, env=variables, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"the {name} mode failed (exit code {done.returncode}); its output is above")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    policy = variables.get("OMP_WAIT_POLICY", "default")
    print(f"{name:>6}: {result['spm']:6.2f} steps/min  (step {result['step']:.2f} s median, waiting for "
          f"rollouts {result['wait']:.2f} s median; OMP_WAIT_POLICY {policy})", flush=True)
    return result


def generation(run: dict) -> float:
    """A synchronous run's generation of a batch: its sampling less the judge's wait (no CPU here)."""
    return run["sample"] - run["judge"]


def side_by_side(generate1: float, update1: float, after: float, share: float, speedup: float, a: float) -> float:
    """A step's length when the generation and the update run ``a`` seconds side by side (each at
    ``share`` times its one-thread speed), then each finishes alone at ``speedup`` times it; the
    update's part alone lasts at least ``after`` (the batch's judge tail, when only it can run)."""
    gen_rest, update_rest = max(0.0, generate1 - share * a), max(0.0, update1 - share * a)
    return a + gen_rest / speedup + max(after, update_rest / speedup)


def ceiling(sync: dict, one_thread: dict, tail: float | None = None) -> tuple[float, str, float]:
    """The most async k = 1 can gain over the synchronous loop on this machine's cores, and why;
    and the same gain under the floor this benchmark used until 2026-12-07 (09:00 UTC), to compare.

    Costs, all measured: the generation (sampling minus the judge's wait, which takes no CPU
    here) and the update, on one thread (``sync1``) and on every thread (``sync``); the judge's
    wait J for a step's calls at its concurrency, and L, one call's. The async pipeline asks the
    judge for each completion as its row finishes, so a batch's judging runs during its
    generation; what must follow the generation is its tail ``A``: the calls of the rows that
    end on the decode's last step. Rows cut at the length limit all end there together, and
    their calls wait their turn at the judge's concurrency, so ``A`` is at least
    ``ceil(n / concurrency) * L`` for the n rows of a batch that the async run's own samples cut,
    and at least ``L`` (``tail``, from ``train``; one call when not given). Three floors for a
    step of the pipeline:

    - work: sampling and the update each spend at least their one-thread CPU time, however the
      cores are shared (more threads split the work, they do not shrink it). While a batch's
      tail is out, only one job can run: the update before it, then the generation of the next
      batch, which waits for that update's adapter (k = 1). The same holds whenever one job has
      done its part of the step: the sampler cannot start the batch after next before the
      update ends, nor the trainer the next update before its batch is in. One job on every
      thread works at most ``s`` times as fast as on one, ``s`` being the larger of the two
      speedups the synchronous loop shows; two side by side each at most at their share of the
      cores (``p = cores / 2`` times one thread's speed: one thread each on 2 cores). So a step
      is ``a`` seconds of both jobs side by side, then each job's rest alone at ``s`` (the
      update's for at least ``A``), with ``a`` chosen to make that shortest;
    - chain: two steps hold one batch's generation, its tail and its update, in turn, each no
      faster than on every thread;
    - the judge: a step's calls take J.

    Caches and memory bandwidth shared by the two jobs keep a real step above all three. The
    floor before counted one call for the tail and let both jobs share the cores to the end
    (``cores * (T - L) + s * L`` covering the step's work), which no k = 1 schedule reaches when
    one job is the longer or most rows end together; it is returned third and printed as
    "before". The text also gives the floor with the whole of J after the generation, the
    ceiling of a pipeline that judges a batch only once it is sampled.
    """
    cores = len(os.sched_getaffinity(0))
    judge, call = one_thread["judge"], one_thread["latency"]
    after = max(call, tail if tail is not None else call)
    generate1, update1 = generation(one_thread), one_thread["update"]
    generate, update = generation(sync), sync["update"]
    speedup = min(float(cores), max(generate1 / generate, update1 / update))
    share = cores / 2

    def floor(after: float) -> tuple[float, float, float]:
        work = min(side_by_side(generate1, update1, after, share, speedup, a)
                   for a in (0.0, min(generate1, update1) / share,
                             max(0.0, min(generate1, update1 - speedup * after)) / share))
        chain = (generate + after + update) / 2
        return max(work, chain, judge), work, chain

    (least, work, chain), (judged_after, *_) = floor(after), floor(judge)
    before = max(call + max(0.0, generate1 + update1 - speedup * call) / cores, (generate + call + update) / 2, judge)
    sync_step = 60.0 / sync["spm"]
    why = (f"a step's generation takes {generate1:.2f} s on one thread and {generate:.2f} s on {cores}, its update "
           f"{update1:.2f} s and {update:.2f} s, the judge's wait {judge:.2f} s ({call:.2f} s a call, {after:.2f} s "
           f"of them after the generation: the rows ending together on its last step). While they are out one job "
           f"runs, at most {speedup:.2f}x its one-thread speed, as when the other has done its part: a k = 1 step "
           f"takes at least {least:.2f} s (work {work:.2f} s, chain {chain:.2f} s; {judged_after:.2f} s with the "
           f"judge asked only once a batch is sampled; {before:.2f} s by the floor before, one call after the "
           f"generation and the cores shared to the end), against the synchronous loop's {sync_step:.2f} s")
    return sync_step / least, why, sync_step / before


def judge_tail(rows: list[dict], per_step: int, concurrency: int) -> float:
    """The least time a batch's judging must go on after its generation (means over ``rows``): its
    rows cut at the length limit end on the decode's last step together, and their calls go
    ``concurrency`` at a time, each as long as a call's mean latency; at least one call."""
    return statistics.fmean(
        max(1, math.ceil(round(row.get("train/truncated_ratio", 0.0) * per_step) / concurrency))
        * row.get("reward/judge/latency_s", 0.0) for row in rows)


def where_the_time_goes(asynchronous: dict, sync: dict, one_thread: dict) -> str:
    """Where an async step's time went (means over steps 2..N), beside each job's cost alone.

    The trainer's step is its wait for the batch, its update and the rest of the loop (monitors,
    the run store); the sampler's generation of a batch ran meanwhile. Alone, on one thread and on
    every thread, they cost what ``ceiling`` read from the synchronous runs: a job that runs beside
    the other slower than alone on one thread is losing to sharing the cores, caches and memory
    bandwidth, which no floor counts."""
    step, wait, update = asynchronous["mean_step"], asynchronous["mean_wait"], asynchronous["update"]
    generate1, generate = generation(one_thread), generation(sync)
    return (f"{step:.2f} s on average: waiting for the batch {wait:.2f} s, the update {update:.2f} s "
            f"({update / one_thread['update']:.2f}x its one-thread cost alone, {update / sync['update']:.2f}x "
            f"its cost on every thread), the rest of the loop {step - wait - update:.2f} s; meanwhile the "
            f"sampler generated a batch in {asynchronous['generate']:.2f} s ({asynchronous['generate'] / generate1:.2f}x "
            f"alone on one thread, {asynchronous['generate'] / generate:.2f}x on every thread), and its judging went "
            f"on {asynchronous['sample'] - asynchronous['generate']:.2f} s after it (at least "
            f"{asynchronous['tail']:.2f} s: its rows cut at the length limit)")


def heldout(args, runs: Path, name: str) -> list[float]:
    """Greedy rewards of a mode's trained adapter (its last checkpoint) on the first held-out tasks."""
    from grooves.policy import Policy
    from grooves.policy.sampler import Sampling
    from grooves.training.build import task_sets
    from grooves.training.gather import evaluate

    k, ray, sampler = MODES[name]
    task_set = task_sets(config_for(args, args.judge_url, name, k, ray, sampler))[0]
    policy = Policy.load(f"{name}@{args.steps}", runs=runs)
    tasks = task_set.heldout[: args.heldout]
    sampling = Sampling(temperature=0.0, max_new_tokens=args.max_new, seed=0)
    return evaluate(policy, tasks, [task_set.render(t) for t in tasks], task_set.reward, sampling, 0).rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny random-weight model, 3 steps: a smoke check")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=2, help="tasks per step")
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--heldout", type=int, default=32, help="held-out tasks scored after training")
    parser.add_argument("--judge-concurrency", type=int, default=2, help="judge requests in flight (default 2; "
                        "1: the one-at-a-time-judge workload)")
    parser.add_argument("--async-threads", type=int, default=0, help="torch threads while the async run trains "
                        "(each of its two threads, the sampler's and the trainer's, uses this many; "
                        "0 = torch's default, as for the other modes)")
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray mode (ray2_spm=nan)")
    parser.add_argument("--no-thread", action="store_true", help="leave out async k = 1 with a sampler thread "
                        "(the async mode measured is the sampler process)")
    parser.add_argument("--no-ceiling", action="store_true", help="leave out the synchronous loop on one thread, "
                        "whose costs give the most async k = 1 can gain on this machine (the 'ceiling' line)")
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)  # one mode, in a child process
    parser.add_argument("--judge-url", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = "bundled:smollm2-135m-instruct"
    if args.quick:
        args.model, args.steps, args.group, args.max_new, args.heldout = "tiny", 3, 4, 8, 6
    if args.mode:
        print(json.dumps(train(args, args.runs, args.mode)), flush=True)
        return
    print(f"scale: {args.model}, {args.steps} steps of {args.tasks} tasks x {args.group} samples, "
          f"{args.max_new} new tokens, judge {JUDGE_DELAY_S * 1000:.0f} ms with {args.judge_concurrency} in "
          f"flight, torch threads {torch.get_num_threads()} (async: {args.async_threads or 'the same'})", flush=True)
    with JudgeProcess() as judge, tempfile.TemporaryDirectory() as folder:
        runs = Path(folder)
        args.judge_url = judge.base_url
        sync = measure(args, runs, "sync")
        asynchronous = measure(args, runs, "async")
        async_spm = asynchronous["spm"]
        thread = None if args.no_thread else measure(args, runs, "thread")
        thread_spm = math.nan if thread is None else thread["spm"]
        ray2_spm = math.nan if args.no_ray else measure(args, runs, "ray2")["spm"]
        one_thread = None if args.no_ceiling else measure(args, runs, "sync1")
        bound = None if one_thread is None else ceiling(sync, one_thread, asynchronous["tail"])
        thread_bound = None if one_thread is None or thread is None else ceiling(sync, one_thread, thread["tail"])
        a, b = heldout(args, runs, "sync"), heldout(args, runs, "async")
    pairs = [(x, y) for x, y in zip(a, b) if x == x and y == y]
    diffs = [y - x for x, y in pairs]
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    heldout_sync = statistics.fmean(x for x, _ in pairs)
    heldout_async = statistics.fmean(y for _, y in pairs)
    sync_spm = sync["spm"]
    async_ceiling = thread_ceiling = math.nan
    if bound is not None:
        print(f"ceiling: async k = 1 cannot beat {bound[0]:.2f}x the synchronous loop on this machine now: {bound[1]}")
        async_ceiling = async_spm / (sync["spm"] * bound[0])  # the ceiling's steps/min: 60 s over the floor
        if thread_bound is not None:  # its own samples, its own judge tail
            thread_ceiling = thread_spm / (sync["spm"] * thread_bound[0])
        print(f"async/ceiling: {async_ceiling:.2f} of the most async k = 1 can reach here (goal >= 0.90; "
              f"{async_spm / (sync['spm'] * bound[2]):.2f} by the floor before); with a sampler thread: "
              f"{thread_ceiling:.2f}")
        print(f"async step: {where_the_time_goes(asynchronous, sync, one_thread)}")
    print(f"async/sync throughput: {async_spm / sync_spm:.2f}x (goal >= 1.5x); with a sampler thread instead "
          f"of a process: {thread_spm / sync_spm:.2f}x; ray2/sync: "
          f"{ray2_spm / sync_spm:.2f}x; held-out async - sync: {heldout_async - heldout_sync:+.3f} "
          f"(stderr {stderr:.3f}, {len(pairs)} tasks)")
    print(f"scale sync_spm={sync_spm:.3f} async_spm={async_spm:.3f} ray2_spm={ray2_spm:.3f} "
          f"heldout_sync={heldout_sync:.4f} heldout_async={heldout_async:.4f} stderr={stderr:.4f} "
          f"async_ceiling={async_ceiling:.3f} thread_ceiling={thread_ceiling:.3f}")


if __name__ == "__main__":
    sys.exit(main())
