"""Run the Tinker cookbook's own ``rl_loop`` or ``sl_loop`` (tinker-cookbook 0.6.1, code unchanged)
against a running ``grooves backend serve``. Runs in the cookbook's virtualenv, not grooves'.

    python run_loop.py {rl,sl} --base-url URL --model NAME --tokenizer DIR --log-path DIR

The API key comes from $TINKER_API_KEY, as for any Tinker client. What this script changes, and
nothing else: the URL; the model name; the tokenizer, read from a local folder (the cookbook's own
``register_tokenizer``: no hub); the renderer, which the cookbook's model table does not know for
grooves' models (it names ``qwen3_instruct``, whose tokens are ChatML's); the data (a few local
rows instead of GSM8K and No Robots); and, for RL, the grader: a random tiny model never writes
``\\boxed{}``, so the share of ASCII letters in a reply stands in for GSM8K's exact match.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
from tinker_cookbook import model_info, tokenizer_utils  # noqa: E402

RENDERER = "qwen3_instruct"

QUESTIONS = [  # GSM8K's shape: the answer's last line is "#### <number>"
    ("Tom has 3 apples and buys 2 more. How many apples does he have?", "3 + 2 = 5\n#### 5"),
    ("A box holds 4 pens. How many pens are in 2 boxes?", "4 * 2 = 8\n#### 8"),
    ("Ann reads 6 pages a day. How many pages does she read in 3 days?", "6 * 3 = 18\n#### 18"),
    ("There are 10 birds and 4 fly away. How many are left?", "10 - 4 = 6\n#### 6"),
]

CHATS = [  # No Robots' shape: a list of messages per row
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
     {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hi again!"}],
    [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}],
]


def local_data(name: str, *args, **kwargs) -> datasets.DatasetDict:
    """``datasets.load_dataset`` for the two sets the loops ask for, from the rows above."""
    if name == "openai/gsm8k":
        rows = [{"question": q, "answer": a} for q, a in QUESTIONS]
    elif name == "HuggingFaceH4/no_robots":
        rows = [{"messages": chat} for chat in CHATS]
    else:
        raise ValueError(f"no local data for {name!r}")
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})


def letters_share(response: str, answer: str) -> float:
    """The stand-in grader: the share of ASCII letters in the reply (0 for an empty reply)."""
    return sum(c.isascii() and c.isalpha() for c in response) / len(response) if response else 0.0


def point_at(model: str, tokenizer_dir: str) -> None:
    """Make the cookbook's tokenizer and renderer lookups answer for ``model`` without the hub."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer_utils.register_tokenizer(model, lambda: tokenizer)
    known = model_info.get_recommended_renderer_name
    model_info.get_recommended_renderer_name = lambda name: RENDERER if name == model else known(name)
    datasets.load_dataset = local_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", choices=["rl", "sl"])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer folder")
    parser.add_argument("--log-path", required=True)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    point_at(args.model, args.tokenizer)
    common = dict(base_url=args.base_url, log_path=args.log_path, model_name=args.model, batch_size=2,
                  lora_rank=4, save_every=1, max_steps=args.steps)
    if args.loop == "rl":
        from tinker_cookbook.recipes import rl_loop

        rl_loop.get_reward = letters_share
        # importance_sampling: grooves serves Tinker's documented losses, not stable_reinforce
        rl_loop.main(rl_loop.Config(**common, group_size=4, max_tokens=16, learning_rate=1e-3,
                                    loss_fn="importance_sampling"))
    else:
        from tinker_cookbook.recipes import sl_loop

        sl_loop.main(sl_loop.Config(**common, max_length=512, learning_rate=1e-3))


if __name__ == "__main__":
    main()
