"""Throughput of the synchronous loop, the async pipeline (k = 1) and Ray with 2 workers, in one run.

The task is the demo's (titles, the bundled SmolLM2-135M-Instruct, LoRA rank 8); the reward is
the demo's title verifier plus a pointwise LLM judge served on 127.0.0.1 that answers every
request after a fixed 300 ms (its score: how close the title is to 6 words), with at most
``--judge-concurrency`` requests in flight (``reward.max_concurrency``, default 2: a
rate-limited judge). That wait is what the async pipeline hides behind the update.

Each mode trains the same config from the same seed for ``--steps`` steps; steps per minute
come from the loop's own step times (``train/total_step_time``) of steps 2..N (step 1 fills
the pipeline). After training, the policies of the synchronous and the async run are scored
greedily on the same held-out tasks; the standard error is that of the mean per-task
difference. The last line is machine-readable:

    scale sync_spm=X async_spm=Y ray2_spm=Z heldout_sync=A heldout_async=B stderr=S

    pip install -e '.[ray]'
    python benchmarks/scale.py                # the recorded setting (docs/benchmarks.md)
    python benchmarks/scale.py --quick        # a smoke check on the tiny random-weight model

On 2 cores the sampler thread and the trainer thread each run torch's intra-op threads;
``--async-threads 1`` gives each of them one (the other modes keep torch's default).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
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


def config_for(args, judge_url: str, name: str, k: int, ray: bool):
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
        "train": {"group_size": args.group, "tasks_per_step": args.tasks, "max_off_policy_steps": k},
        "log": {"save_every": args.steps, "val_every": 10_000, "val_size": 0, "tensorboard": False,
                "kl_every": 0},
        "monitors": {"enabled": False},  # the same for every mode; the tiny model's gibberish trips them
    }
    if ray:
        data["ray"] = {"workers": 2, "cpus_per_worker": 1}
    return parse_config(data)


def train(args, judge_url: str, runs: Path, name: str, k: int, ray: bool = False):
    """Train one mode; return (steps per minute over steps 2..N, the trained policy, its task set)."""
    from grooves.training.api import load_policy, task_sets
    from grooves.training.loop import TrainingRun

    config = config_for(args, judge_url, name, k, ray)
    sets = task_sets(config)
    policy = load_policy(config)
    run = TrainingRun(config, policy, sets, runs / name, progress=False).run()
    times = [row["train/total_step_time"] for row in run.metrics if row["step"] >= 2]
    waits = [row.get("train/wait_time", math.nan) for row in run.metrics if row["step"] >= 2]
    spm = 60.0 * len(times) / sum(times)
    print(f"{name:>6}: {spm:6.2f} steps/min  (step {statistics.median(times):.2f} s median, "
          f"waiting for rollouts {statistics.median(waits):.2f} s median)", flush=True)
    return spm, policy, sets[0]


def heldout(args, policy, task_set) -> list[float]:
    from grooves.policy.sampler import Sampling
    from grooves.training.rollout import evaluate

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
    parser.add_argument("--judge-concurrency", type=int, default=2)
    parser.add_argument("--async-threads", type=int, default=0, help="torch threads while the async run trains "
                        "(each of its two threads, the sampler's and the trainer's, uses this many; 0 = torch's default, "
                        "as for the other modes)")
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray mode (ray2_spm=nan)")
    args = parser.parse_args()
    args.model = "bundled:smollm2-135m-instruct"
    if args.quick:
        args.model, args.steps, args.group, args.max_new, args.heldout = "tiny", 3, 4, 8, 6
    print(f"scale: {args.model}, {args.steps} steps of {args.tasks} tasks x {args.group} samples, "
          f"{args.max_new} new tokens, judge {JUDGE_DELAY_S * 1000:.0f} ms with {args.judge_concurrency} in "
          f"flight, torch threads {torch.get_num_threads()} (async: {args.async_threads or 'the same'})", flush=True)
    with ServerThread(judge_app(JUDGE_DELAY_S)) as judge, tempfile.TemporaryDirectory() as folder:
        runs = Path(folder)
        sync_spm, sync_policy, task_set = train(args, judge.base_url, runs, "sync", k=0)
        threads = torch.get_num_threads()
        torch.set_num_threads(args.async_threads or threads)
        async_spm, async_policy, _ = train(args, judge.base_url, runs, "async", k=1)
        torch.set_num_threads(threads)
        ray2_spm = math.nan
        if not args.no_ray:
            import ray

            ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                     logging_level="warning")
            try:
                ray2_spm, _, _ = train(args, judge.base_url, runs, "ray2", k=1, ray=True)
            finally:
                ray.shutdown()
        a, b = heldout(args, sync_policy, task_set), heldout(args, async_policy, task_set)
    pairs = [(x, y) for x, y in zip(a, b) if x == x and y == y]
    diffs = [y - x for x, y in pairs]
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    heldout_sync = statistics.fmean(x for x, _ in pairs)
    heldout_async = statistics.fmean(y for _, y in pairs)
    print(f"async/sync throughput: {async_spm / sync_spm:.2f}x (goal >= 1.5x); ray2/sync: "
          f"{ray2_spm / sync_spm:.2f}x; held-out async - sync: {heldout_async - heldout_sync:+.3f} "
          f"(stderr {stderr:.3f}, {len(pairs)} tasks)")
    print(f"scale sync_spm={sync_spm:.3f} async_spm={async_spm:.3f} ray2_spm={ray2_spm:.3f} "
          f"heldout_sync={heldout_sync:.4f} heldout_async={heldout_async:.4f} stderr={stderr:.4f}")


if __name__ == "__main__":
    sys.exit(main())
