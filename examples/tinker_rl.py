"""RL through the official tinker SDK, in the shape of the Tinker cookbook's ``rl_loop``, on
grooves' demo task (short titles for docstrings, scored by the demo's verifier).

Each step: save the weights for a sampler -> sample GROUP_SIZE titles per prompt -> score them
-> advantage = reward - the group's mean -> ``forward_backward(importance_sampling)`` ->
``optim_step``. The held-out tasks are sampled greedily and scored before the first step and
every ``--eval-every`` steps. Losses are Tinker's: summed over tokens.

    python examples/tinker_rl.py                          # starts a service on 127.0.0.1
    python examples/tinker_rl.py --base-url http://127.0.0.1:8100 --api-key tml-...  # or $TINKER_API_KEY

Without ``--base-url`` the script starts ``grooves backend serve``'s service in this process
(bundled SmolLM2-135M-Instruct, on the CPU) with a generated key, under a temporary folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import tinker
from tinker import types

from grooves.rewards.compose import Reward
from grooves.backend.local import service_client
from grooves.tasks import titles
from grooves.types import Group, Task, Trajectory


@dataclass
class RLSettings:
    steps: int = 8
    prompts_per_step: int = 2
    group_size: int = 8
    learning_rate: float = 1e-3
    rank: int = 8
    max_tokens: int = 24
    heldout: int = 16  # held-out tasks scored greedily
    eval_every: int = 0  # 0: before the first step and after the last only
    seed: int = 0  # the LoRA initialisation's and, with the step and prompt, each sample request's


def prompt_ids(tokenizer, task: Task) -> list[int]:
    text = tokenizer.apply_chat_template(task["prompt"], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def score(reward: Reward, task: Task, completions: list[str]) -> list[float]:
    """The demo verifier's rewards of completions of one task."""
    group = Group(task, [Trajectory(messages=[*task["prompt"], {"role": "assistant", "content": text}],
                                    prompt_ids=[], completion_ids=[], completion_mask=[], logprobs=[])
                         for text in completions])
    reward.score([group])
    return group.rewards


def heldout_reward(sampler: tinker.SamplingClient, tokenizer, tasks: list[Task], reward: Reward,
                   max_tokens: int) -> float:
    """Mean reward of greedy titles for the held-out tasks (one request per task, all in flight)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_ids(tokenizer, t)), 1, params) for t in tasks]
    texts = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    return statistics.fmean(score(reward, task, [text])[0] for task, text in zip(tasks, texts))


def group_datums(prompt: list[int], sequences, advantages: list[float]) -> list[types.Datum]:
    """One datum per sampled sequence: the prompt is context (advantage 0), the completion is trained."""
    datums = []
    context = len(prompt) - 1
    for seq, advantage in zip(sequences, advantages):
        tokens = prompt + list(seq.tokens)
        datums.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * context + list(seq.logprobs),
                            "advantages": [0.0] * context + [advantage] * len(seq.tokens)}))
    return datums


def rl_loop(service: tinker.ServiceClient, base_model: str, settings: RLSettings,
            log: Callable[[str], None] = print) -> dict[int, float]:
    """Train on the demo's training tasks; return the held-out reward by step (0 = before training)."""
    train, heldout = titles.tasks("train"), titles.tasks("heldout")[: settings.heldout]
    reward = titles.reward()
    training = service.create_lora_training_client(base_model=base_model, rank=settings.rank,
                                                   seed=settings.seed).result()
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=settings.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    results: dict[int, float] = {}
    sampler = training.save_weights_and_get_sampling_client().result()
    results[0] = heldout_reward(sampler, tokenizer, heldout, reward, settings.max_tokens)
    log(f"step 0: held-out reward {results[0]:.3f} ({len(heldout)} tasks, greedy)")
    for step in range(1, settings.steps + 1):
        t0 = time.perf_counter()
        first = (step - 1) * settings.prompts_per_step
        tasks = [train[(first + i) % len(train)] for i in range(settings.prompts_per_step)]
        prompts = [prompt_ids(tokenizer, t) for t in tasks]
        # A seed per request: each draws from its own generator (unseeded, the requests shared the
        # service's, and their timing decided which draws each got). The logits can still differ in
        # their last bits with what the service decodes beside a request, so two runs can part after
        # a few steps (two 3-step runs: the same first two steps, then train reward 0.181 and 0.164).
        futures = [sampler.sample(types.ModelInput.from_ints(p), settings.group_size,
                                  types.SamplingParams(max_tokens=settings.max_tokens, temperature=1.0,
                                                       seed=settings.seed * 1_000_000 + step * 1000 + i))
                   for i, p in enumerate(prompts)]
        datums, means = [], []
        for task, prompt, future in zip(tasks, prompts, futures):
            sequences = future.result().sequences
            rewards = score(reward, task, [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in sequences])
            mean = statistics.fmean(rewards)
            means.append(mean)
            if any(r != mean for r in rewards):  # a group whose rewards are all equal teaches nothing
                datums += group_datums(prompt, sequences, [r - mean for r in rewards])
        line = f"step {step}: train reward {statistics.fmean(means):.3f}"
        if datums:
            backward = training.forward_backward(datums, "importance_sampling")
            optim = training.optim_step(adam)
            line += f", loss {backward.result().metrics['loss:sum']:.3f}"
            line += "".join(f", {k} {v:.3g}" for k, v in (optim.result().metrics or {}).items())
        sampler = training.save_weights_and_get_sampling_client().result()
        if step == settings.steps or (settings.eval_every and step % settings.eval_every == 0):
            results[step] = heldout_reward(sampler, tokenizer, heldout, reward, settings.max_tokens)
            line += f", held-out reward {results[step]:.3f}"
        log(f"{line} ({time.perf_counter() - t0:.1f} s)")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = RLSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running Tinker-compatible service; default: start one here")
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY"),
                        help="its API key (default: $TINKER_API_KEY)")
    parser.add_argument("--model", default="bundled:smollm2-135m-instruct",
                        help="base model: the spec the service trains (default: %(default)s)")
    helps = {"steps": "training steps", "prompts_per_step": "training prompts per step",
             "group_size": "titles sampled per prompt", "rank": "LoRA rank", "max_tokens": "new tokens per title",
             "heldout": "held-out tasks scored greedily", "seed": "seed of the LoRA initialisation and of the sampling",
             "eval_every": "score the held-out tasks every N steps too (0: before and after only)"}
    for name, text in helps.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                            help=f"{text} (default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate, help="(default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # the SDK warns each time a long poll ends without a result; a busy CPU service makes many
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
    settings = RLSettings(**{k: getattr(args, k) for k in RLSettings.__dataclass_fields__})
    with service_client(args.model, args.base_url, args.api_key) as service:
        results = rl_loop(service, args.model, settings)
    print(f"held-out reward: {results[0]:.3f} before, {results[max(results)]:.3f} after {max(results)} steps")


if __name__ == "__main__":
    main()
