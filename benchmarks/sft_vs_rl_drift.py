"""Does SFT move a model far more than RL? The demo task, both ways, compared at matched reward.

The seed's claim (DESIGN.md, "RL stays in the grooves"): supervised fine-tuning on reference
answers moves the weights and the output distribution much more than RL reaching the same
quality. Here both start from the bundled SmolLM2-135M-Instruct with the same LoRA (the demo
config's rank 8, alpha 16, every linear layer) on the demo task's training titles:

- **RL**: the demo config as it is (DAPO, the titles reward, 25 steps), a checkpoint and a
  held-out validation every ``--rl-every`` steps;
- **SFT**: ``grooves sft`` on the same training tasks, each prompt followed by its reference
  title as the assistant turn (``--sft-steps`` steps of ``--sft-batch`` examples, learning
  rate ``--sft-lr``), a checkpoint every ``--sft-every`` steps.

**Matching.** Every checkpoint's held-out reward is the demo's own held-out metric (the same
64 held-out tasks, greedy, the titles reward: ``grooves.workflows.evals.heldout_groups``, which
``tests/test_eval.py`` checks gives the ``val/reward/total`` a run logs). The common level is
the best held-out reward RL reached; SFT checkpoints are scored in order of step until one
reaches that level, and the SFT checkpoint closest to it is taken. If SFT never gets there, the
level is SFT's best and the RL checkpoint closest to it is taken. So the two checkpoints
compared are as good as each other on the task (both rewards are printed), and the question is
only what each cost the model.

**Measures** (``grooves drift base CHECKPOINT``, docs/drift.md), for each matched checkpoint:
per-module relative weight change ``‖ΔW‖/‖W‖`` of the effective LoRA update, its mean and max
over every adapted module and the overall ratio; the exact per-token KL to the base on the
held-out prompts along the model's greedy completions; forgetting, the rise in NLL per token of
the reference answers of ``general_qa.jsonl`` (a task neither run trained on). Each as SFT/RL.

    python benchmarks/sft_vs_rl_drift.py            # the full comparison (estimated 12-15 min on 2 quiet cores)
    python benchmarks/sft_vs_rl_drift.py --quick    # a smoke check: one step of each, small evals

The last line is machine-readable:
``sft_vs_rl_drift level=L reward_sft=X reward_rl=Y dw_sft=A dw_rl=B dw_ratio=R dwmax_sft=.. dwmax_rl=..
dwmax_ratio=.. kl_sft=K1 kl_rl=K2 kl_ratio=Q forget_sft=F1 forget_rl=F2 forget_ratio=..``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from grooves.demo import demo_config_path
from grooves.training.api import run_config
from grooves.training.build import task_sets
from grooves.training.config import load_config, parse_config
from grooves.workflows.drift import measure
from grooves.workflows.evals import heldout_groups, mean_se
from grooves.training.sft import SFTConfig, run_sft_config


def rl_run(root: Path, args) -> list[tuple[int, float]]:
    """Train the demo config; ``(step, held-out reward)`` of every checkpoint (and step 0)."""
    config = load_config(demo_config_path())
    config.name, config.steps = "drift-rl", args.rl_steps
    config.log.save_every = config.log.val_every = args.rl_every
    config.log.val_size, config.log.tensorboard = args.heldout, False
    if args.quick:
        config.train.group_size, config.train.tasks_per_step = 4, 1
    run_config(config, runs=root)  # its progress (steps, ETA) on stderr
    rows = [json.loads(line) for line in (root / "drift-rl" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val/reward/total"]) for r in rows if "val/reward/total" in r]


def sft_data(root: Path) -> tuple[Path, Path, object]:
    """The demo's training tasks (and held-out ones, for the held-out loss) as chats whose assistant
    turn is the reference title; also the demo run config the held-out reward comes from."""
    config = load_config(demo_config_path())
    (task_set,) = task_sets(config)
    files = []
    for split, tasks in (("train", task_set.train), ("heldout", task_set.heldout)):
        path = root / f"titles-{split}.jsonl"
        path.write_text("".join(json.dumps({"id": t["id"], "messages": task_set.render(t) + [
            {"role": "assistant", "content": t["reference"]}]}) + "\n" for t in tasks))
        files.append(path)
    return files[0], files[1], config


def sft_run(root: Path, train: Path, heldout: Path, args) -> Path:
    demo = load_config(demo_config_path())
    config = parse_config({
        "name": "drift-sft", "seed": demo.seed, "steps": args.sft_steps, "batch_size": args.sft_batch,
        "model": {"spec": demo.model.spec}, "lora": demo.lora.model_dump(),
        "data": {"source": str(train), "heldout": str(heldout)},
        "optim": {"learning_rate": args.sft_lr, "micro_batch_size": 4},
        "log": {"save_every": args.sft_every, "val_every": args.sft_every, "val_size": 16, "tensorboard": False},
    }, SFTConfig)
    run_sft_config(config, runs=root)
    return root / "drift-sft"


def heldout_reward(model: str, demo, root: Path) -> float:
    from grooves.policy import Policy

    policy = Policy.load(model, dtype=demo.model.dtype, seed=demo.seed, runs=root)
    return mean_se([t.reward for g in heldout_groups(policy, demo) for t in g.trajectories])[0]


def closest(curve: list[tuple[int, float]], level: float) -> tuple[int, float]:
    """The checkpoint (step > 0) whose reward is closest to ``level``; the earliest on a tie."""
    return min((p for p in curve if p[0] > 0), key=lambda p: (abs(p[1] - level), p[0]))


def drift_of(checkpoint: str, root: Path, prompts: Path, args) -> dict[str, float]:
    report = measure("base", checkpoint, runs=root, prompts_file=prompts, n_prompts=args.kl_prompts,
                     max_new_tokens=args.kl_tokens)
    relative = [m.relative for m in report.modules]
    return {"dw": statistics.fmean(relative), "dwmax": max(relative), "total": report.total,
            "kl": report.kl[checkpoint], "forget": report.forgetting[checkpoint] - report.forgetting["base"],
            "modules": len(relative), "prompts": report.prompts}


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="A smoke check: 1 step of each, small evaluations.")
    parser.add_argument("--runs", type=Path, help="Keep the two runs here (default: a temporary folder).")
    parser.add_argument("--rl-steps", type=int, default=25)
    parser.add_argument("--rl-every", type=int, default=5, help="RL checkpoint and validation interval.")
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--sft-every", type=int, default=2, help="SFT checkpoint interval.")
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--sft-lr", type=float, default=2e-4)
    parser.add_argument("--heldout", type=int, default=64, help="Held-out tasks scored per checkpoint.")
    parser.add_argument("--kl-prompts", type=int, default=16, help="Held-out prompts of the KL to the base.")
    parser.add_argument("--kl-tokens", type=int, default=24, help="Greedy tokens per prompt for the KL.")
    args = parser.parse_args()
    if args.quick:
        args.rl_steps, args.rl_every, args.sft_steps, args.sft_every, args.sft_batch = 1, 1, 1, 1, 4
        args.heldout, args.kl_prompts, args.kl_tokens = 6, 3, 8
    started = time.perf_counter()
    root = args.runs or Path(tempfile.mkdtemp(prefix="sft-vs-rl-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"runs under {root}", flush=True)

    rl = rl_run(root, args)
    print("RL held-out reward by step: " + ", ".join(f"{s}: {r:.4f}" for s, r in rl), flush=True)
    train, heldout, demo = sft_data(root)
    demo.log.val_size = args.heldout
    sft_run(root, train, heldout, args)
    level = max(r for s, r in rl if s > 0)
    sft = [(0, rl[0][1])]  # step 0 of both is the untouched base
    steps = sorted(int(p.name.removeprefix("step-")) for p in (root / "drift-sft" / "checkpoints").glob("step-*"))
    for step in steps:
        sft.append((step, heldout_reward(f"drift-sft@{step}", demo, root)))
        print(f"SFT step {step}: held-out reward {sft[-1][1]:.4f}", flush=True)
        if sft[-1][1] >= level:
            break
    if max(r for _, r in sft) < level:
        level = max(r for s, r in sft if s > 0)
    step_sft, reward_sft = closest(sft, level)
    step_rl, reward_rl = closest(rl, level)

    prompts = root / "heldout-prompts.jsonl"  # the same held-out prompts for both KLs
    (task_set,) = task_sets(demo)
    prompts.write_text("".join(json.dumps({"prompt": task_set.render(t)}) + "\n" for t in task_set.heldout))
    d_sft = drift_of(f"drift-sft@{step_sft}", root, prompts, args)
    d_rl = drift_of(f"drift-rl@{step_rl}", root, prompts, args)

    print(f"\nmatched at held-out reward {level:.4f} (base {rl[0][1]:.4f}); {d_sft['modules']} modules, "
          f"KL on {d_sft['prompts']} held-out prompts, {args.kl_tokens} greedy tokens each")
    print(f"{'':<34}{'SFT':>12}{'RL':>12}{'SFT / RL':>12}")
    rows = [("checkpoint step", step_sft, step_rl, None), ("held-out reward", reward_sft, reward_rl, None),
            ("mean ‖ΔW‖/‖W‖ over modules", d_sft["dw"], d_rl["dw"], ratio(d_sft["dw"], d_rl["dw"])),
            ("max ‖ΔW‖/‖W‖ over modules", d_sft["dwmax"], d_rl["dwmax"], ratio(d_sft["dwmax"], d_rl["dwmax"])),
            ("all modules √Σ‖ΔW‖²/√Σ‖W‖²", d_sft["total"], d_rl["total"], ratio(d_sft["total"], d_rl["total"])),
            ("KL to base per token (nats)", d_sft["kl"], d_rl["kl"], ratio(d_sft["kl"], d_rl["kl"])),
            ("forgetting: Δ NLL/token general QA", d_sft["forget"], d_rl["forget"],
             ratio(d_sft["forget"], d_rl["forget"]))]
    for name, a, b, r in rows:
        cells = [f"{a:>12}", f"{b:>12}"] if isinstance(a, int) else [f"{a:>12.6f}", f"{b:>12.6f}"]
        print(f"{name:<34}{''.join(cells)}{'' if r is None else f'{r:>12.2f}'}")
    print(f"seconds={time.perf_counter() - started:.0f}")
    print(f"sft_vs_rl_drift level={level:.4f} reward_sft={reward_sft:.4f} reward_rl={reward_rl:.4f} "
          f"step_sft={step_sft} step_rl={step_rl} dw_sft={d_sft['dw']:.6f} dw_rl={d_rl['dw']:.6f} "
          f"dw_ratio={ratio(d_sft['dw'], d_rl['dw']):.3f} dwmax_sft={d_sft['dwmax']:.6f} dwmax_rl={d_rl['dwmax']:.6f} "
          f"dwmax_ratio={ratio(d_sft['dwmax'], d_rl['dwmax']):.3f} kl_sft={d_sft['kl']:.6f} kl_rl={d_rl['kl']:.6f} "
          f"kl_ratio={ratio(d_sft['kl'], d_rl['kl']):.3f} forget_sft={d_sft['forget']:.6f} "
          f"forget_rl={d_rl['forget']:.6f} forget_ratio={ratio(d_sft['forget'], d_rl['forget']):.3f}", flush=True)


if __name__ == "__main__":
    main()
