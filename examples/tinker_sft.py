"""Supervised fine-tuning through the official tinker SDK, in the shape of the Tinker cookbook's
``sl_loop``, on grooves' demo task: the model learns to answer each docstring with its reference
title.

Each step: a batch of (prompt, reference title) conversations -> datums whose weights are 1 on
the reply's tokens and 0 on the prompt's -> ``forward_backward(cross_entropy)`` -> ``optim_step``.
The held-out conversations' loss per reply token is measured with ``forward`` (no gradients)
before the first step and after each ``--eval-every`` steps. Tinker's ``cross_entropy`` is a
sum over tokens; the script divides by the token count to print a mean.

    python examples/tinker_sft.py                          # starts a service on 127.0.0.1
    python examples/tinker_sft.py --base-url http://127.0.0.1:8100 --api-key tml-...  # or $TINKER_API_KEY
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import tinker
from tinker import types

from grooves.backend.local import service_client
from grooves.tasks import titles
from grooves.types import Task


@dataclass
class SFTSettings:
    steps: int = 6
    batch_size: int = 4
    learning_rate: float = 5e-4
    rank: int = 8
    heldout: int = 8
    eval_every: int = 1
    seed: int = 0


def conversation_datum(tokenizer, task: Task) -> types.Datum:
    """The prompt then the reference title as the assistant's reply; only the reply is trained."""
    prompt = tokenizer.apply_chat_template(task["prompt"], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*task["prompt"], {"role": "assistant", "content": task["reference"]}],
                                         tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(full, add_special_tokens=False)
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * (len(ids) - len(prompt_ids))  # one per target token
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def mean_loss(output: types.ForwardBackwardOutput, datums: list[types.Datum]) -> float:
    """Loss per trained token: Tinker's cross_entropy is summed over tokens."""
    tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in datums)
    return output.metrics["loss:sum"] / tokens


def sft_loop(service: tinker.ServiceClient, base_model: str, settings: SFTSettings,
             log: Callable[[str], None] = print) -> dict[int, float]:
    """Train on the demo's training tasks; return the held-out loss per token by step (0 = before)."""
    training = service.create_lora_training_client(base_model=base_model, rank=settings.rank,
                                                   seed=settings.seed).result()
    tokenizer = training.get_tokenizer()
    train = [conversation_datum(tokenizer, t) for t in titles.tasks("train")]
    heldout = [conversation_datum(tokenizer, t) for t in titles.tasks("heldout")[: settings.heldout]]
    adam = types.AdamParams(learning_rate=settings.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    results = {0: mean_loss(training.forward(heldout, "cross_entropy").result(), heldout)}
    log(f"step 0: held-out loss {results[0]:.3f} per token ({len(heldout)} conversations)")
    for step in range(1, settings.steps + 1):
        t0 = time.perf_counter()
        first = (step - 1) * settings.batch_size
        batch = [train[(first + i) % len(train)] for i in range(settings.batch_size)]
        backward = training.forward_backward(batch, "cross_entropy")
        optim = training.optim_step(adam)
        line = f"step {step}: train loss {mean_loss(backward.result(), batch):.3f}"
        optim.result()
        if step == settings.steps or (settings.eval_every and step % settings.eval_every == 0):
            results[step] = mean_loss(training.forward(heldout, "cross_entropy").result(), heldout)
            line += f", held-out loss {results[step]:.3f}"
        log(f"{line} ({time.perf_counter() - t0:.1f} s)")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = SFTSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running Tinker-compatible service; default: start one here")
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY"),
                        help="its API key (default: $TINKER_API_KEY)")
    parser.add_argument("--model", default="bundled:smollm2-135m-instruct",
                        help="base model: the spec the service trains (default: %(default)s)")
    helps = {"steps": "training steps", "batch_size": "conversations per step", "rank": "LoRA rank",
             "heldout": "held-out conversations", "seed": "LoRA initialisation seed",
             "eval_every": "measure the held-out loss every N steps (0: before and after only)"}
    for name, text in helps.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                            help=f"{text} (default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate, help="(default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # the SDK warns each time a long poll ends without a result; a busy CPU service makes many
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
    settings = SFTSettings(**{k: getattr(args, k) for k in SFTSettings.__dataclass_fields__})
    with service_client(args.model, args.base_url, args.api_key) as service:
        results = sft_loop(service, args.model, settings)
    print(f"held-out loss per token: {results[0]:.3f} before, {results[max(results)]:.3f} after {max(results)} steps")


if __name__ == "__main__":
    main()
