"""What one rollout owns: its ``State`` and the exact token stream (``TokenLog``).

A leaf of the envs room: the env contract (``base``), its tools (``tools``) and the users
(``users``) all take a ``State``, so it lives below them and imports none of them.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from grooves.types import Message, Task

ALWAYS_STORED = frozenset({"env_bugs"})
"""``state.data`` keys a stored trajectory always keeps whole (``grooves env try`` shows them)."""


@dataclass
class TokenLog:
    """The exact token stream of a multi-turn rollout: the first prompt, then every later token
    with ``mask`` 1 where the model generated it and 0 where the env inserted it."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Where the sampler first read other prompt ids than these (an engine that re-tokenised): no
    # token from here on was sampled on this conversation, so none of them is trained.
    break_at: int | None = None

    def add(self, ids: list[int], logprobs: list[float] | None, generated: bool) -> None:
        self.ids += ids
        self.mask += [int(generated)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    @property
    def generated(self) -> int:
        return sum(self.mask)

    def trained_mask(self) -> list[int]:
        """``mask`` with every token from ``break_at`` on left out of training."""
        return self.mask if self.break_at is None else self.mask[: self.break_at] + [0] * (len(self.mask) - self.break_at)


@dataclass
class State:
    """Everything one rollout owns. ``data`` is JSON-able env data; ``resources`` holds live
    objects (a database connection) that ``Env.snapshot`` captures through env hooks."""

    task: Task
    messages: list[Message]
    rng: random.Random
    tokens: TokenLog = field(default_factory=TokenLog)
    data: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)
    turns: int = 0
    done: bool = False
    answer: str | None = None
    finish: str = ""  # "answer", "max_turns", "max_tokens" once done
    # The model's KV cache of the conversation so far, kept between turns by the rollout; never
    # in a snapshot (a restored rollout runs its conversation through the model once more).
    past: Any = field(default=None, repr=False, compare=False)


def stored_data(data: dict[str, Any], limit: int) -> dict[str, Any]:
    """What a stored trajectory keeps of ``state.data``: at most ``limit`` characters of JSON (besides
    ``ALWAYS_STORED``). The largest values are replaced, one by one, by ``{"omitted_chars": n,
    "sha256": ...}`` (of their JSON) until the rest fits; equal data still compare equal."""
    sizes = {key: len(json.dumps(value, default=str)) for key, value in data.items() if key not in ALWAYS_STORED}
    kept, total = dict(data), sum(sizes.values())
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        if total <= limit:
            break
        text = json.dumps(data[key], default=str, sort_keys=True)
        kept[key] = {"omitted_chars": sizes[key], "sha256": hashlib.sha256(text.encode()).hexdigest()}
        total -= sizes[key]
    return kept
