"""Batched sampling for training: many prompts x ``n`` samples with one set of settings.

A thin layer over ``grooves.policy.decoding`` (which states the token and logprob
bookkeeping): it encodes prompts, groups them into batches of similar length, and
returns ``n`` completions per prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grooves.policy.decoding import Row, decode
from grooves.types import Message

Prompt = str | list[Message] | list[int]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token or string) or "length"
    prompt_ids: list[int]  # the ids the model read (an engine's own reading of the prompt)
    prefix_break: bool = False  # an engine read other prompt ids than the ones sent


def encode_prompt(policy, prompt: Prompt) -> list[int]:
    """A prompt's token ids: a text is one user message, messages go through the chat template,
    token ids stay as they are."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if prompt and isinstance(prompt[0], dict):
        return policy.chat_ids(prompt)
    return list(prompt)


class Sampler:
    """Generates completions for many prompts x ``n`` samples in one batch."""

    def __init__(self, policy, max_batch_rows: int = 64):
        self.policy = policy
        self.max_batch_rows = max_batch_rows

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.policy, prompt)

    def decode_rows(self, rows: list[Row]) -> list:
        """Decode rows that each carry their own prompt and settings, ``max_batch_rows`` at a time
        (multi-turn rollouts: every rollout's next turn in one batch)."""
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            outputs = []
            for start in range(0, len(rows), self.max_batch_rows):
                outputs += decode(self.policy, rows[start : start + self.max_batch_rows])
            return outputs
        finally:
            model.train(was_training)

    def generate(
        self,
        prompts: list[Prompt],
        n: int = 1,
        sampling: Sampling = Sampling(),
        generator: torch.Generator | None = None,
        on_completion: Callable[[int, int, Completion], None] | None = None,
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt, as one list per prompt. ``on_completion(prompt index,
        sample index, completion)`` hears of each completion as soon as its row ends, while the
        batch's other rows are still generating."""
        if generator is None and sampling.seed is not None:
            generator = torch.Generator(device=self.policy.device).manual_seed(sampling.seed)
        encoded = [self.encode(p) for p in prompts]
        # Chunks of similar length waste less on left padding; results go back in prompt order.
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        per_chunk = max(1, self.max_batch_rows // n)
        results: list[list[Completion]] = [[] for _ in encoded]
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(order), per_chunk):
                chunk = order[start : start + per_chunk]
                rows = [Row(encoded[i], sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                            tuple(sampling.stop), generator) for i in chunk for _ in range(n)]
                made: dict[int, Completion] = {}  # by row, each as its row finishes

                def finished(row: int, out) -> None:
                    i = chunk[row // n]
                    made[row] = Completion(out.text, out.token_ids, out.logprobs, out.finish_reason, list(encoded[i]))
                    if on_completion is not None:
                        on_completion(i, row % n, made[row])

                decode(self.policy, rows, on_finish=finished)
                for j, i in enumerate(chunk):
                    results[i] = [made[row] for row in range(j * n, (j + 1) * n)]
        finally:
            model.train(was_training)
        return results

