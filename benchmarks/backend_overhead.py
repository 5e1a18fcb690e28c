"""What the training service costs over training in this process, and how it shares its worker.

1. The same RL step (sample ``--group`` completions for each of ``--prompts`` demo prompts,
   score them with the demo verifier, one update) in this process (``Policy`` + ``Trainer``)
   and through ``grooves backend serve`` on 127.0.0.1 (``RemotePolicy`` + ``RemoteTrainer``:
   the official tinker SDK over HTTP, the service's one worker). Both start from the same
   base model; the step's seconds are the median over ``--steps`` steps after ``--warmup``.
   ``ratio`` = remote / in-process.
2. Sampled tokens per second per tenant: one tenant alone sends ``--requests`` sample
   requests (``--group`` completions of ``--tokens`` new tokens each); then three tenants
   each send as many at once. The service runs one operation at a time, taking tenants in
   turn, so each of three tenants should get about a third of one tenant's rate.

3. With ``--quality-steps N``: the demo config (``grooves demo``'s) trained for N steps in this
   process and through the service (``grooves train --backend``'s code), each scoring
   ``--quality-heldout`` held-out tasks greedily before and after; prints
   ``backend_quality local_before=.. local_after=.. remote_before=.. remote_after=..``.
   The two runs sample different tokens (the service seeds each request), so they agree
   within noise, not exactly.

The last line is machine-readable:
``backend_overhead inproc_s=X remote_s=Y ratio=R tenants1_tps=A tenants3_tps=B``.

    python benchmarks/backend_overhead.py                 # the bundled model
    python benchmarks/backend_overhead.py --quick         # tiny random model, one step: checks it runs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import torch

from grooves.algorithms import preset
from grooves.backend.client import RemotePolicy, RemoteTrainer
from grooves.backend.local import LocalService
from grooves.policy import LoRA, Policy
from grooves.policy.sampler import Sampling
from grooves.rewards.compose import RewardReport
from grooves.tasks import titles
from grooves.training.config import OptimConfig
from grooves.training.gather import rollout_groups
from grooves.training.trainer import Trainer


def rl_step_seconds(policy, trainer, args, generator: torch.Generator) -> list[float]:
    """Seconds of each step after the warmup: sample, score, train."""
    tasks = titles.tasks("train")
    reward = titles.reward()
    sampling = Sampling(temperature=1.0, max_new_tokens=args.tokens)
    times = []
    for step in range(args.warmup + args.steps):
        chosen = [tasks[(step * args.prompts + i) % len(tasks)] for i in range(args.prompts)]
        t0 = time.perf_counter()
        groups = rollout_groups(policy, chosen, [t["prompt"] for t in chosen], args.group, sampling, generator, step)
        reward.score(groups, RewardReport())
        trainer.train_step(groups)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def tenant_rates(service: LocalService, names: list[str], args) -> list[float]:
    """Sampled tokens per second of each tenant, all sampling at once."""
    import tinker
    from tinker import types

    clients = {n: tinker.ServiceClient(base_url=service.base_url, api_key=service.keys[n]) for n in names}
    samplers = {n: c.create_sampling_client(base_model=args.model).result() for n, c in clients.items()}
    prompt = types.ModelInput.from_ints(list(range(10, 40)))
    params = types.SamplingParams(max_tokens=args.tokens, temperature=1.0)
    rates: dict[str, float] = {}

    def run(name: str) -> None:
        t0 = time.perf_counter()
        futures = [samplers[name].sample(prompt, args.group, params) for _ in range(args.requests)]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        rates[name] = tokens / (time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients.values():
        client.close("success").result(timeout=60)
    return [rates[n] for n in names]


def heldout(run) -> tuple[float, float]:
    return tuple(run.evaluations[step].metrics["val/reward/total"] for step in (0, run.step))


def quality(args) -> dict[str, float]:
    """Held-out reward before and after ``--quality-steps`` demo steps, locally and through the service."""
    from grooves.demo import demo_config_path
    from grooves.training.api import run_config
    from grooves.training.config import load_config

    config = load_config(demo_config_path())
    config.model.spec, config.steps = args.model, args.quality_steps
    config.log.val_every = config.log.save_every = config.steps
    config.log.val_size = args.quality_heldout
    out = {}
    with tempfile.TemporaryDirectory() as root:
        run = run_config(config, runs=f"{root}/local", progress=False)
        out["local_before"], out["local_after"] = heldout(run)
        with LocalService(config.model.spec, f"{root}/service") as service:
            remote = RemotePolicy(service.base_url, config.model.spec, config.lora.rank, config.seed,
                                  api_key=service.keys["local"])
            try:
                run = run_config(config, runs=f"{root}/remote", progress=False, policy=remote,
                                 trainer=RemoteTrainer)
            finally:
                remote.close()
        out["remote_before"], out["remote_after"] = heldout(run)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=2, help="demo prompts per RL step (default: %(default)s)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per completion (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="timed RL steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed RL steps first (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=4, help="sample requests per tenant (default: %(default)s)")
    parser.add_argument("--quality-steps", type=int, default=0, help="also train the demo config this many "
                        "steps locally and through the service (default: off)")
    parser.add_argument("--quality-heldout", type=int, default=64, help="held-out tasks for --quality-steps")
    parser.add_argument("--quick", action="store_true", help="tiny model, one small step: checks the script runs")
    args = parser.parse_args()
    if args.quick:
        args.model, args.prompts, args.group, args.tokens, args.steps, args.warmup, args.requests = \
            "tiny", 1, 2, 4, 1, 1, 1
    algorithm, optim = preset("grpo"), OptimConfig(learning_rate=1e-4)
    kwargs = dict(temperature=1.0, max_completion_length=args.tokens, total_steps=args.warmup + args.steps)

    local = Policy.load(args.model, lora=LoRA(rank=8), seed=0)
    inproc = rl_step_seconds(local, Trainer(local, algorithm, optim, **kwargs), args, torch.Generator().manual_seed(0))
    del local

    with tempfile.TemporaryDirectory() as root, \
            LocalService(args.model, root, tenants=["t1", "t2", "t3"]) as service:
        remote = RemotePolicy(service.base_url, args.model, rank=8, seed=0, api_key=service.keys["t1"])
        try:
            through = rl_step_seconds(remote, RemoteTrainer(remote, algorithm, optim, **kwargs), args,
                                      torch.Generator().manual_seed(0))
        finally:
            remote.close()
        alone = tenant_rates(service, ["t1"], args)
        shared = tenant_rates(service, ["t1", "t2", "t3"], args)

    if args.quality_steps:
        scores = quality(args)
        print("backend_quality " + " ".join(f"{k}={v:.4f}" for k, v in scores.items()))
    inproc_s, remote_s = statistics.median(inproc), statistics.median(through)
    print(f"RL step ({args.prompts} prompts x {args.group} completions, {args.tokens} tokens, {args.model}): "
          f"in-process {inproc_s:.2f} s, through the service {remote_s:.2f} s (median of {args.steps})")
    print(f"sampled tokens/s: one tenant {alone[0]:.1f}; three at once {', '.join(f'{r:.1f}' for r in shared)}")
    print(f"backend_overhead inproc_s={inproc_s:.3f} remote_s={remote_s:.3f} ratio={remote_s / inproc_s:.3f} "
          f"tenants1_tps={alone[0]:.2f} tenants3_tps={statistics.fmean(shared):.2f}")


if __name__ == "__main__":
    main()
