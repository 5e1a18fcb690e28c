"""One GRPO step on the CPU: grooves vs TRL's GRPOTrainer, side by side.

Both sides get the same model (the bundled SmolLM2-135M-Instruct, fp32), the same LoRA
(rank 8, alpha 16, every linear layer), the same prompts (the demo's title tasks, one
prompt per step, 8 completions of it), the same reward (the demo's title verifier), at
most 48 new tokens, temperature 1.0, beta 0, one optimizer step per generation. Each side
runs in its own subprocess (so its peak RSS is its own), the sides alternate, and each
subprocess times its steps after a warm-up step.

    pip install -e '.[bench]'                      # TRL
    python benchmarks/grpo_step.py [--pairs 2] [--steps 4] [--warmup 1]

Per side it prints per-step wall time (median, min, max), completion tokens per second,
peak RSS, and each pair's ratio TRL/grooves. It also prints the floor for this machine: the
time the step's arithmetic and weight traffic need at the measured fp32 matmul rate and
memory bandwidth, and each side's median as a multiple of it. The last line is
machine-readable:
``grpo_step trl_s=X grooves_s=Y ratio=R grooves_rss_mb=A trl_rss_mb=B``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from grooves.progress import Reporter

BASE = "bundled:smollm2-135m-instruct"
GROUP, MAX_NEW, LR = 8, 48, 1e-5


def prompts(count: int) -> list[dict]:
    from grooves.tasks.titles import tasks

    return tasks("train")[:count]


def title_reward(completion: str, task: dict) -> float:
    from grooves.tasks.titles import format_score, grounded, length_score, reference_f1

    text = task["text"]
    return 0.25 * (format_score(completion, text) + length_score(completion, text) + grounded(completion, text)
                   + reference_f1(completion, task["reference"]))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --- the grooves side ----------------------------------------------------------------------------

def run_grooves(steps: int, out: Path) -> list[dict]:
    """The real training loop (``grooves train``): sampling, reward, monitors, store, update."""
    from grooves.training.config import parse_config
    from grooves.training.api import run_config
    from grooves.runs.store import read_metrics

    tasks = out / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": t["id"], "prompt": t["prompt"], "text": t["text"],
                                         "reference": t["reference"]}) + "\n" for t in prompts(steps)))
    reward = out / "bench_reward.py"
    reward.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                      "from grpo_step import title_reward\n\n"
                      "def title(completion, task):\n    return title_reward(completion, task)\n")
    config = parse_config({
        "name": "bench", "seed": 0, "steps": steps, "model": {"spec": BASE},
        "lora": {"rank": 8, "alpha": 16},
        "tasks": {"source": str(tasks), "heldout_fraction": 0.01},
        "reward": {"components": [{"function": f"{reward}:title"}]},
        "algorithm": {"preset": "grpo", "beta": 0.0},
        "sampling": {"temperature": 1.0, "max_completion_length": MAX_NEW},
        "optim": {"learning_rate": LR, "micro_batch_size": GROUP},
        "train": {"group_size": GROUP, "tasks_per_step": 1},
        "log": {"val_size": 0, "save_every": 10_000, "tensorboard": False},
    })
    run = run_config(config, out=out / "run", progress=False)
    return [{"seconds": row["train/total_step_time"], "tokens": row["completion_len"] * GROUP}
            for row in read_metrics(run.dir / "metrics.jsonl") if row["step"] >= 1]


# --- the TRL side --------------------------------------------------------------------------------

def run_trl(steps: int, out: Path) -> list[dict]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grooves.policy.models import load_model

    model, tokenizer = load_model(BASE)  # the same weights, from grooves' cached safetensors
    rows = prompts(steps)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "text": r["text"], "reference": r["reference"]}
                                 for r in rows])

    def title(completions, text, reference, **_):
        return [title_reward(c[0]["content"], {"text": t, "reference": r})
                for c, t, r in zip(completions, text, reference)]

    times: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append({"seconds": time.perf_counter() - self.start})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and times:
                times[-1]["tokens"] = logs["completions/mean_length"] * GROUP

    config = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=GROUP, num_generations=GROUP,
        max_completion_length=MAX_NEW, beta=0.0, temperature=1.0, learning_rate=LR, max_steps=steps,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0,
        shuffle_dataset=False, dataloader_num_workers=0, gradient_accumulation_steps=1)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=title, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[Timer()])
    trainer.train()
    return times


# --- the machine's floor -------------------------------------------------------------------------

def machine_rates() -> dict:
    """fp32 matmul GFLOP/s (square 1024 matmuls) and memory bandwidth GB/s (a 256 MB copy)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    flops = 2 * 1024 ** 3 * reps / (time.perf_counter() - start)
    src = torch.empty(64 * 1024 * 1024)  # 256 MB
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, reps = time.perf_counter(), 5
    for _ in range(reps):
        dst.copy_(src)
    bandwidth = 2 * src.numel() * 4 * reps / (time.perf_counter() - start)  # read + write
    return {"gflops": flops / 1e9, "gbps": bandwidth / 1e9}


def floor_seconds(rates: dict, n: int, prompt_tokens: float, completion_tokens: float) -> dict:
    """The least time a step needs on this machine (see docs/benchmarks.md for the model).

    Sampling: the prompt prefilled once (2 N P flops), then each decode position reads every
    weight once for the whole batch of 8 (bytes = 4 N per position, ``completion_tokens`` positions
    for the longest sample) and does 2 N flops per token. Training: forward + backward through
    the frozen weights for the input gradients, about 4 N flops per trained token, the shared
    prompt once. N counts the matmul weights, the tied output head included."""
    decode_tokens = GROUP * completion_tokens
    sample_flops = 2 * n * (prompt_tokens + decode_tokens)
    sample_bytes = 4 * n * completion_tokens * 1.0
    train_flops = 4 * n * (prompt_tokens + decode_tokens)
    sample = max(sample_flops / (rates["gflops"] * 1e9), sample_bytes / (rates["gbps"] * 1e9))
    train = train_flops / (rates["gflops"] * 1e9)
    return {"params": n, "sample_s": sample, "train_s": train, "total_s": sample + train}


# --- the driver --------------------------------------------------------------------------------------

def worker(side: str, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = (run_grooves if side == "grooves" else run_trl)(steps, Path(tmp))
    print("RESULT " + json.dumps({"steps": rows, "rss_mb": peak_rss_mb()}), flush=True)


def run_side(side: str, steps: int) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, __file__, "--worker", side, "--steps", str(steps)],
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{side} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="Alternating grooves/TRL subprocess pairs.")
    parser.add_argument("--steps", type=int, default=4, help="Timed steps per subprocess.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed first steps per subprocess.")
    parser.add_argument("--worker", choices=["grooves", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    results: dict[str, list] = {"grooves": [], "trl": []}
    pair_ratios = []
    progress = Reporter(Console())  # stdout: a bar on a terminal, a line per subprocess in a log
    with progress.counting(2 * args.pairs, unit="run"):
        for pair in range(args.pairs):
            medians = {}
            for side in ("grooves", "trl") if pair % 2 == 0 else ("trl", "grooves"):
                progress.phase("running", f"pair {pair + 1} {side}: {args.warmup} + {args.steps} steps in a "
                               f"subprocess")
                result = run_side(side, args.warmup + args.steps)
                timed = result["steps"][args.warmup:]
                results[side].append({"steps": timed, "rss_mb": result["rss_mb"]})
                medians[side] = statistics.median(s["seconds"] for s in timed)
                progress.advance(2 * pair + len(medians), {
                    "pair": f"{pair + 1} {side}", "median": f"{medians[side]:.2f} s/step over {len(timed)} steps",
                    "peak RSS": f"{result['rss_mb']:.0f} MB"})
            pair_ratios.append(medians["trl"] / medians["grooves"])
    progress.phase("measuring", "this machine's matmul rate and memory bandwidth")
    rates = machine_rates()
    n, prompt_tokens = model_sizes()
    summary = {}
    for side, runs in results.items():
        steps = [s for run in runs for s in run["steps"]]
        seconds = [s["seconds"] for s in steps]
        tokens = [s.get("tokens", float("nan")) for s in steps]
        summary[side] = {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
                         "tok_s": statistics.fmean(t / s for t, s in zip(tokens, seconds)),
                         "tokens": statistics.fmean(tokens), "rss_mb": max(run["rss_mb"] for run in runs)}
    completion = statistics.fmean(summary[s]["tokens"] for s in summary) / GROUP
    floor = floor_seconds(rates, n, prompt_tokens, completion)
    print(f"\nmachine: fp32 matmul {rates['gflops']:.0f} GFLOP/s, memory {rates['gbps']:.1f} GB/s; "
          f"{floor['params'] / 1e6:.0f} M matmul weights; prompt {prompt_tokens:.0f} tokens, "
          f"completions {completion:.1f} tokens on average")
    print(f"floor: sampling {floor['sample_s']:.2f} s + training {floor['train_s']:.2f} s = {floor['total_s']:.2f} s/step\n")
    print(f"{'side':<8} {'median s':>9} {'min s':>7} {'max s':>7} {'tok/s':>7} {'peak RSS MB':>12} {'x floor':>8}")
    for side in ("trl", "grooves"):
        row = summary[side]
        print(f"{side:<8} {row['median']:>9.2f} {row['min']:>7.2f} {row['max']:>7.2f} {row['tok_s']:>7.1f} "
              f"{row['rss_mb']:>12.0f} {row['median'] / floor['total_s']:>8.1f}")
    print("ratio TRL/grooves per pair: " + ", ".join(f"{r:.2f}" for r in pair_ratios))
    ratio = summary["trl"]["median"] / summary["grooves"]["median"]
    print(f"grpo_step trl_s={summary['trl']['median']:.3f} grooves_s={summary['grooves']['median']:.3f} "
          f"ratio={ratio:.2f} grooves_rss_mb={summary['grooves']['rss_mb']:.0f} trl_rss_mb={summary['trl']['rss_mb']:.0f}")


def model_sizes() -> tuple[int, float]:
    """The model's matmul weights (the tied embeddings are the head) and the mean prompt
    length in tokens of the benchmark's prompts, in the chat template."""
    from grooves.policy.models import load_model

    model, tokenizer = load_model(BASE)
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    lengths = [len(tokenizer.apply_chat_template(t["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)) for t in prompts(8)]
    return n, statistics.fmean(lengths)


if __name__ == "__main__":
    main()
