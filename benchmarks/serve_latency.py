"""Serving latency of adapters on the bundled model: base, unmerged adapter, merged, 4 mixed.

One run, on one machine, over real HTTP (the official openai client against grooves serve
on 127.0.0.1):

  (a) base       the base model (a server without adapters), one request at a time
  (b) unmerged   base + one LoRA adapter (rank 8, all linear layers), one request at a time
  (c) merged     the same adapter merged into the weights, served as a plain model
  (d) mixed4     four requests at once, each for a different adapter, decoded in one batch

Every request generates exactly ``--tokens`` tokens (``ignore_eos``) from the same prompt;
the configurations are measured in alternating rounds so drift on the machine hits all of
them alike. Latency is per request (for mixed4: each of the four). The adapters have random
non-zero LoRA weights: latency does not depend on what they learned.

    python benchmarks/serve_latency.py [--rounds 8] [--tokens 32]

The last line is machine-readable:
``serve_latency unmerged_ratio=X merged_ratio=Y mixed4_ratio=Z`` (p50 latency over the base's).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import openai
import torch
from rich.console import Console

from grooves import algorithms
from grooves.policy import LoRA, Policy
from grooves.progress import Reporter
from grooves.serve import merge_checkpoint
from grooves.serve.app import ServerThread, build_server, create_app
from grooves.training.trainer import Trainer

BASE = "bundled:smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Write a short paragraph about the sea."}]


def make_adapters(runs: Path, count: int) -> None:
    for index in range(count):
        policy = Policy.load(BASE, lora=LoRA(rank=8), seed=index)
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.01, generator=torch.Generator().manual_seed(index))
        Trainer(policy, algorithms.grpo()).save(runs / f"adapter{index}")


def timed(client, model: str, tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=tokens, temperature=0,
                                           extra_body={"ignore_eos": True})
    return time.perf_counter() - start, reply.usage.completion_tokens


def timed_concurrently(client, models: list[str], tokens: int) -> list[tuple[float, int]]:
    results: list[tuple[float, int]] = [(0.0, 0)] * len(models)

    def run(i: int) -> None:
        results[i] = timed(client, models[i], tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def summary(samples: list[tuple[float, int]]) -> tuple[float, float, float]:
    latencies = sorted(s for s, _ in samples)
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    tokens_per_s = sum(n for _, n in samples) / sum(s for s, _ in samples)
    return statistics.median(latencies), p95, tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grooves-serve-bench-"))
    runs = work / "runs"
    progress = Reporter(Console())  # stdout: a bar on a terminal, lines in a log
    progress.phase("preparing", "4 adapters and a merged model")
    make_adapters(runs, 4)
    merged_dir = merge_checkpoint("adapter0@latest", work / "merged", runs=runs)

    servers = {"base": build_server(BASE, runs=work / "none"),
               "adapters": build_server(BASE, runs=runs, batch_window_s=0.02),
               "merged": build_server(str(merged_dir), runs=work / "none")}
    samples: dict[str, list[tuple[float, int]]] = {"base": [], "unmerged": [], "merged": [], "mixed4": []}
    try:
        with ServerThread(create_app(servers["base"])) as b, ServerThread(create_app(servers["adapters"])) as a, \
                ServerThread(create_app(servers["merged"])) as m:
            clients = {name: openai.OpenAI(base_url=t.base_url, api_key="x", max_retries=0, timeout=600)
                       for name, t in (("base", b), ("adapters", a), ("merged", m))}
            mixed = [f"adapter{i}@latest" for i in range(4)]
            progress.phase("warming up", "one short request per configuration")
            timed(clients["base"], BASE, 4)  # warm-up; loads the adapters
            timed(clients["merged"], str(merged_dir), 4)
            timed_concurrently(clients["adapters"], mixed, 4)
            with progress.counting(args.rounds, unit="round"):
                for round_number in range(args.rounds):
                    progress.phase("timing", "base, unmerged, merged, mixed4", log=False)
                    samples["base"].append(timed(clients["base"], BASE, args.tokens))
                    samples["unmerged"].append(timed(clients["adapters"], "adapter0@latest", args.tokens))
                    samples["merged"].append(timed(clients["merged"], str(merged_dir), args.tokens))
                    samples["mixed4"] += timed_concurrently(clients["adapters"], mixed, args.tokens)
                    progress.advance(round_number + 1, {name: f"{samples[name][-1][0]:.2f} s"
                                                        for name in ("base", "unmerged", "merged")})
    finally:
        for server in servers.values():
            server.engine.stop()

    base_p50 = summary(samples["base"])[0]
    print(f"\n{'config':<10} {'p50 s':>8} {'p95 s':>8} {'tok/s':>8} {'p50 / base':>11}")
    ratios = {}
    for name, values in samples.items():
        p50, p95, rate = summary(values)
        ratios[name] = p50 / base_p50
        print(f"{name:<10} {p50:>8.3f} {p95:>8.3f} {rate:>8.1f} {ratios[name]:>11.2f}")
    print(f"({args.rounds} rounds, {args.tokens} tokens per request, {torch.get_num_threads()} threads)")
    print(f"serve_latency unmerged_ratio={ratios['unmerged']:.3f} merged_ratio={ratios['merged']:.3f} "
          f"mixed4_ratio={ratios['mixed4']:.3f}")


if __name__ == "__main__":
    main()
