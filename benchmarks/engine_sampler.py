"""The engine sampler against the trainer's own decoder, on the same training run.

The demo config (``grooves demo``'s) trains ``--steps`` steps twice from the same start: once
sampling in this process, once through ``grooves serve`` in a process of its own on 127.0.0.1
(``[sampler] url``: token-id prompts, each version loaded with ``/v1/load_lora_adapter``). Each
run's held-out reward after the steps is scored by the run itself (greedy, ``--heldout`` tasks;
the engine run samples them through the engine). Steps per minute count the training steps only
(the run's ``train/total_step_time``). There is no speed goal on 2 cores: the server and the
trainer share them, and the point is that the held-out rewards agree within 2 standard errors of
their per-task difference (the two runs sample different tokens: the engine seeds each request).

The last line is machine-readable:
``engine_sampler inproc_spm=X engine_spm=Y heldout_inproc=A heldout_engine=B stderr=S``.

    python benchmarks/engine_sampler.py              # the bundled model, the demo's 25 steps
    python benchmarks/engine_sampler.py --quick      # the tiny random model, 2 steps: checks it runs
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from grooves.demo import demo_config_path
from grooves.training.api import run_config
from grooves.training.config import load_config
from grooves.training.placement import EngineConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, runs: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "grooves.cli", "serve", "--model", model, "--port", str(port),
                             "--runs", str(runs)], stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise SystemExit("grooves serve did not start") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("grooves serve did not answer in 600 s")


def scores(run) -> dict[str, float]:
    """The final held-out reward of each task (greedy: one sample per task)."""
    evaluation = run.evaluations[run.step]
    return {group.task["id"]: group.trajectories[0].reward for group in evaluation.groups}


def steps_per_minute(run) -> float:
    times = [row["train/total_step_time"] for row in run.metrics if "train/total_step_time" in row]
    return 60.0 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="Training steps (default: the demo's).")
    parser.add_argument("--heldout", type=int, default=64, help="Held-out tasks scored after the steps.")
    parser.add_argument("--quick", action="store_true", help="Tiny random model, 2 steps, 8 held-out tasks.")
    args = parser.parse_args()
    config = load_config(demo_config_path())
    if args.quick:
        config.model.spec, args.steps, args.heldout = "tiny", 2, 8
    config.steps = args.steps or config.steps
    config.log.val_every = config.log.save_every = config.steps
    config.log.val_size = args.heldout
    with tempfile.TemporaryDirectory() as root:
        inproc = run_config(config, runs=f"{root}/inproc", progress=False)
        print(f"in-process: {steps_per_minute(inproc):.2f} steps/min", file=sys.stderr)
        proc, url = start_server(config.model.spec, Path(root) / "served")
        try:
            engine_config = config.model_copy(deep=True)
            engine_config.sampler = EngineConfig(url=url, adapters=f"{root}/served/engine")
            engine = run_config(engine_config, runs=f"{root}/engine", progress=False)
        finally:
            proc.kill()
        print(f"engine: {steps_per_minute(engine):.2f} steps/min", file=sys.stderr)
    a, b = scores(inproc), scores(engine)
    common = sorted(set(a) & set(b))
    diffs = [b[t] - a[t] for t in common]
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    mean_a, mean_b = statistics.fmean(a[t] for t in common), statistics.fmean(b[t] for t in common)
    agree = abs(mean_b - mean_a) <= 2 * stderr if stderr == stderr else False
    print(f"held-out after {config.steps} steps: in-process {mean_a:.4f}, engine {mean_b:.4f}, difference "
          f"{mean_b - mean_a:+.4f} (stderr {stderr:.4f}, {len(common)} tasks): "
          f"{'within' if agree else 'NOT within'} 2 stderr")
    print(f"engine_sampler inproc_spm={steps_per_minute(inproc):.3f} engine_spm={steps_per_minute(engine):.3f} "
          f"heldout_inproc={mean_a:.4f} heldout_engine={mean_b:.4f} stderr={stderr:.4f}")


if __name__ == "__main__":
    main()
