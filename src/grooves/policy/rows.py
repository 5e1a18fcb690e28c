"""The rows a decode runs and what it returns: the data the decode loop, the training sampler,
multi-turn rollouts and the server share (see ``grooves.policy.decoding``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


class Constraint(Protocol):
    """Restricts which tokens a row may produce (see ``grooves.serve.grammar``)."""

    def mask(self, logits: torch.Tensor, remaining: int) -> None:
        """Set disallowed entries of a ``(V,)`` logits row to -inf, in place; ``remaining`` tokens are left."""

    def accept(self, token: int) -> None: ...

    def is_terminated(self) -> bool: ...


@dataclass
class Row:
    prompt_ids: list[int]
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    generator: torch.Generator | None = None
    adapter: str | None = None  # a PEFT adapter name, BASE_ADAPTER, or None for the model as it is
    constraint: Constraint | None = None
    top_logprobs: int = 0
    ignore_eos: bool = False  # generate max_new_tokens whatever the model says (benchmarks)
    past: Past | None = None  # the KV of a prefix of prompt_ids, from an earlier decode (keep_past); consumed
    keep_past: bool = False  # return the row's KV (prompt and tokens but the last) as RowOutput.past
    cancelled: Callable[[], bool] | None = None  # asked after each token: True ends the row ("abort")


@dataclass
class Past:
    """One row's KV cache: per layer ``(keys, values)`` of shape ``(heads, length, head_dim)``, for the
    first ``length`` tokens of a sequence. A multi-turn rollout keeps it between its turns, so a
    turn's prompt (the whole conversation) is not run through the model again. A decode that
    reads it consumes it (each layer is dropped once copied into the batch): the KV is held once."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        if self.layers[0] is None:
            raise ValueError("this past was consumed by a decode: a row's KV serves one next turn")
        return self.layers[0][0].shape[1]


@dataclass
class RowOutput:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token, stop string or finished constraint), "length" or "abort"
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    past: Past | None = None  # with Row.keep_past: the KV of prompt_ids + token_ids[:-1]
    prefix_break: bool = False  # an engine sampler read other prompt ids than the row's (grooves.policy.engine)


TokenCallback = Callable[[int, int, float], None]  # (row index, token id, logprob) as each token is chosen
FinishCallback = Callable[[int, "RowOutput"], None]  # (row index, its output, text included) as a row ends


def row_adapters(policy, rows: list[Row]) -> list[str] | None:
    """Each row's adapter name (None: the active one), when the policy has adapters and some row names one."""
    if policy.has_adapter and any(r.adapter is not None for r in rows):
        active = policy.model.active_adapter
        return [r.adapter or active for r in rows]
    return None


class _Model:
    """Calls the model with the rows' adapters.

    Inside a server's decode, ``grooves.policy.packing`` has swapped the LoRA layers for
    batched ones (``grooves.policy.lora_batch``): the model runs once with each row on its own
    adapter, told by the selection which rows are in each forward. Otherwise, when every row
    uses the same adapter (or none), the model runs plainly with that adapter switched on (or
    all switched off); PEFT's mixed-batch path, which splits every layer's input by adapter,
    is used only for batches that really mix adapters.
    """

    def __init__(self, policy, rows: list[Row]):
        self.policy = policy
        if not policy.has_adapter and any(r.adapter not in (None, BASE_ADAPTER) for r in rows):
            raise ValueError("a row asks for an adapter but the model has none loaded")
        self.names = row_adapters(policy, rows)
        selection = policy.__dict__.get("_lora_selection")  # set for these rows by packing.packed_linears
        same_rows = selection is not None and self.names is not None and selection.names == tuple(self.names)
        self.selection = selection if same_rows else None

    def __call__(self, active: list[int], **kwargs):
        if self.names is None:
            return self.policy.causal_lm(**kwargs)
        names = [self.names[i] for i in active]
        if self.selection is not None:
            self.selection.select(names)
            return self.policy.causal_lm(**kwargs)
        if len(set(names)) > 1:
            return self.policy.model(adapter_names=names, **kwargs)
        if names[0] == BASE_ADAPTER:
            with self.policy.model.disable_adapter():
                return self.policy.causal_lm(**kwargs)
        if self.policy.model.active_adapter != names[0]:
            self.policy.model.set_adapter(names[0])
        return self.policy.causal_lm(**kwargs)
