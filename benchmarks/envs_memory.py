"""Peak memory of one search RL step: G rollouts of each of 4 tasks, scored, one GRPO update.

The settings are those of ``examples/agents/search-sft-rl.toml`` (max 4 turns, 256 generated
tokens per rollout, 96 per turn, results cut at 800 characters, micro-batches of 4, LoRA rank
16), built by the same functions ``grooves train`` uses. The base model never calls a tool (it
answers at once), so each rollout plays the env's own demonstration instead: search, read the
source, answer. Every turn still goes through the training sampler, with the KV cache kept
between turns; a constraint only forces the demo's tokens, whose logprobs are the model's. Half
of each group answers right and half wrong, so every group has reward
variance and the update runs on every rollout: the memory of a real step where the SFT model
does the task about half the time.

Each G runs in a fresh process (its peak RSS is its own). Per G it prints the peak resident
set after loading, after the rollouts and after the update, the conversation length in tokens,
and the last line is machine-readable:
``envs_memory g4_mb=X g8_mb=Y g16_mb=Z`` (peak RSS in MiB).

    python benchmarks/envs_memory.py [--groups 4,8,16] [--tasks 4] [--steps 1]
    python benchmarks/envs_memory.py --quick        # the tiny model, one task per step (make test)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

BASE = "bundled:smollm2-135m-instruct"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_config(model: str, group: int, tasks: int, quick: bool) -> dict:
    """The search SFT+RL example's run config, on ``model`` with a fresh adapter."""
    # the tiny model's tokens are bytes: a demo's search call is ~280 of them
    max_tokens, turn_tokens, prompt = (256, 96, 1024) if not quick else (640, 300, 4096)
    return {
        "name": "envs-memory", "seed": 0, "steps": 1,
        "model": {"spec": model},
        "lora": {"rank": 16, "alpha": 32},
        "env": {"name": "search", "train_tasks": max(tasks, 8), "heldout_tasks": 0,
                "options": {"max_turns": 4, "max_tokens": max_tokens,
                            "max_result_chars": 800 if not quick else 200, "kinds": ["name"]}},
        "algorithm": {"preset": "grpo"},
        "sampling": {"temperature": 0.8, "max_completion_length": turn_tokens, "max_prompt_length": prompt},
        "optim": {"learning_rate": 3e-4, "micro_batch_size": 4},
        "train": {"group_size": group, "tasks_per_step": tasks},
        "log": {"kl_every": 0, "tensorboard": False},
    }


class Forced:
    """A constraint that allows exactly one token sequence (the decode's ``Constraint``)."""

    def __init__(self, ids: list[int]):
        self.ids, self.at = ids, 0

    def mask(self, logits, remaining: int) -> None:
        token = self.ids[min(self.at, len(self.ids) - 1)]
        keep = logits[token].clone()
        logits.fill_(float("-inf"))
        logits[token] = keep

    def accept(self, token: int) -> None:
        self.at += 1

    def is_terminated(self) -> bool:
        return self.at >= len(self.ids)


def scripted_turns(policy, env, tasks: list[dict], group: int) -> list[list[list[int]]]:
    """Per rollout (task-major, ``group`` each), the token ids of its turns: the env's demo, with
    a wrong answer in every second rollout (reward variance)."""
    from grooves.envs.base import call_text

    wrong = call_text("answer", text="no.such_name")
    rollouts = []
    for demo in (env.demonstrate(task) for task in tasks):
        for i in range(group):
            turns = demo if i % 2 == 0 else [*demo[:-1], wrong]
            rollouts.append([policy.tokenizer.encode(t, add_special_tokens=False) + [policy.end_of_turn_id]
                             for t in turns])
    return rollouts


def child(args) -> None:
    """One RL step of the search example in this process; prints a JSON line of figures."""
    import torch

    from grooves.envs.rollout import env_groups, sampler_generate
    from grooves.training.build import load_policy, task_sets
    from grooves.training.config import parse_config
    from grooves.training.trainer import Trainer

    config = parse_config(run_config(args.model, args.group, args.tasks, args.quick))
    policy = load_policy(config)
    task_set = task_sets(config)[0]
    env, tasks = task_set.env, [t for t in task_set.train if task_set.env.demonstrate(t)][: args.tasks]
    s = config.sampling
    trainer = Trainer(policy, config.algorithm, config.optim, temperature=s.temperature,
                      max_completion_length=env.max_tokens, total_steps=args.steps, kl_every=0)
    figures = {"group": args.group, "load_mb": peak_rss_mb()}
    script = scripted_turns(policy, env, tasks, args.group)
    for step in range(args.steps):
        turn_of = [0] * len(script)  # every rollout plays all its turns, so the batch order is fixed

        def constrain(index: int, prompt: list[int]) -> Forced:
            ids = script[index][turn_of[index]]
            turn_of[index] += 1
            return Forced(ids)

        generator = torch.Generator().manual_seed(step)
        generate = sampler_generate(policy, s.temperature, 1.0, generator, constrain=constrain)
        groups = env_groups(policy, env, tasks, args.group, generate, s.max_completion_length, step)
        task_set.reward.score(groups)
        figures[f"rollouts_mb_{step}"] = peak_rss_mb()
        lengths = [len(t.prompt_ids) + len(t.completion_ids) for g in groups for t in g.trajectories]
        figures["tokens_max"], figures["tokens_mean"] = max(lengths), sum(lengths) / len(lengths)
        metrics = trainer.train_step(groups)
        figures[f"update_mb_{step}"] = peak_rss_mb()
        figures["skipped"] = metrics.get("train/skipped", 0.0)

    figures["peak_mb"] = peak_rss_mb()
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", default="4,8,16", help="group sizes G, each in a fresh process")
    parser.add_argument("--tasks", type=int, default=None, help="tasks per step (default 4; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=1, help="RL steps per process")
    parser.add_argument("--model", default=None, help=f"model spec (default {BASE}; tiny with --quick)")
    parser.add_argument("--quick", action="store_true", help="the tiny model and short rollouts (make test)")
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)  # a child process: one G
    args = parser.parse_args()
    args.model = args.model or ("tiny" if args.quick else BASE)
    args.tasks = args.tasks or (1 if args.quick else 4)
    if args.group is not None:
        child(args)
        return
    peaks = {}
    for group in (int(g) for g in args.groups.split(",")):
        command = [sys.executable, str(Path(__file__).resolve()), "--group", str(group), "--tasks", str(args.tasks),
                   "--steps", str(args.steps), "--model", args.model] + (["--quick"] if args.quick else [])
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"G={group} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"G={group}: " + " ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in figures.items() if k != "group"), flush=True)
        peaks[group] = figures["peak_mb"]
    print("envs_memory " + " ".join(f"g{g}_mb={mb:.0f}" for g, mb in peaks.items()))


if __name__ == "__main__":
    main()
