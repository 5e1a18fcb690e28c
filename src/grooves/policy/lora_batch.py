"""A server's decode batch with each row on its own LoRA adapter, in one pass of each layer.

PEFT's mixed-batch path (``adapter_names=``) splits every adapted layer's input by adapter:
an index, two products and a scatter per adapter per layer, each with its Python around it.
Here, while a server's batch decodes, each PEFT LoRA linear is swapped for ``BatchedLoRA``:

    y = base(x) + ((x @ A.T) * mask) @ B.T          # x (N, T, in), A (R, in), B (out, R)

``A`` stacks the A matrices of the batch's adapters that adapt this layer (R = the sum of their
ranks), ``B`` their B matrices side by side, each times its adapter's scaling (alpha / r, or
PEFT's rsLoRA value). ``mask`` (N, 1, R) is 1 on the columns of a row's own adapter and 0 on
the others: the block-diagonal form of gathering each row's A and B for a batched product,
without padding ranks. A base row (``BASE_ADAPTER``), or an adapter that does not adapt the
layer, gets a zero delta. With one adapter in the batch there is no mask (the unmerged case);
a layer no row adapts is its base alone. Dropout does nothing at inference and is left out.
On CPU the base is oneDNN-packed (``grooves.policy.packing``); the stacks are not: packing a
matrix costs milliseconds whatever its size, and a server's batches change their adapter sets.

Stacks are made per set of adapters a batch uses and kept (the last ``STACKS_KEPT`` sets),
keyed by the adapters' names and their tensors' identities and versions; the adapter registry
drops them all whenever it loads or unloads an adapter (``forget_stacks``).
Layers this does not cover (DoRA, a LoRA bias, a merged or disabled adapter, a base that is
not a plain ``nn.Linear``, training mode) leave the whole batch on PEFT's own path.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grooves.policy.rows import BASE_ADAPTER

BATCH_LORA = True
"""Run a server's batches through ``BatchedLoRA`` (False: PEFT's own per-adapter path)."""

STACKS_KEPT = 4


class RowAdapters(tuple):
    """The adapter of each row of a batch whose rows name their adapters (a server's)."""


class Selection:
    """Which adapter each row of the current forward uses, shared by a batch's ``BatchedLoRA`` layers.

    ``select`` is called before each forward with the names of the rows in it; a layer asks for
    the mask of its column layout, made once per forward for all layers alike."""

    def __init__(self, names: RowAdapters, adapters: list[str]):
        self.names = tuple(names)
        self.index = {name: i for i, name in enumerate(adapters)}
        self.rows: list[int] = []
        self._masks: dict[tuple, torch.Tensor | bool | None] = {}

    def select(self, names: list[str]) -> None:
        rows = [self.index.get(name, -1) for name in names]  # -1: the base, no adapter
        if rows != self.rows:
            self.rows, self._masks = rows, {}

    def mask(self, layout: tuple[tuple[int, int], ...], device, dtype) -> torch.Tensor | bool | None:
        """(N, 1, R) ones and zeros for a layer whose columns are ``layout`` ((adapter, rank), ...);
        None when every column is every row's (no mask needed), False when none is (no delta)."""
        if layout in self._masks:
            return self._masks[layout]
        present = {adapter for adapter, _ in layout}
        if not present.intersection(self.rows):
            mask = False
        elif len(layout) == 1 and set(self.rows) == present:
            mask = None
        else:
            columns = [adapter for adapter, rank in layout for _ in range(rank)]
            mask = torch.tensor([[float(r == c) for c in columns] for r in self.rows], device=device, dtype=dtype)
            mask = mask[:, None, :]
        self._masks[layout] = mask
        return mask


class BatchedLoRA(torch.nn.Module):
    """A LoRA linear for a batch of rows on different adapters: the base plus one masked product pair."""

    def __init__(self, base: torch.nn.Module, stack: _Stack, selection: Selection):
        super().__init__()
        self.base = base
        self.a, self.b = stack.a, stack.b  # (R, in) and (out, R); plain tensors, not parameters
        self.layout, self.selection = stack.layout, selection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (N, T, out)
        mask = self.selection.mask(self.layout, x.device, self.a.dtype)
        if mask is False:
            return y
        h = F.linear(x, self.a)  # (N, T, R)
        if mask is not None:
            h = h * mask
        return y.add_(F.linear(h, self.b))


@dataclass(frozen=True)
class _Stack:
    """One layer's stacks: ``a`` (R, in), ``b`` (out, R) with the scalings in, the columns' layout."""

    a: torch.Tensor
    b: torch.Tensor
    layout: tuple[tuple[int, int], ...]  # (adapter index in the batch, rank) per block of columns


def eligible(layer, adapters: list[str]) -> bool:
    """Whether ``layer``'s output for these adapters is exactly base + scaling * B @ A."""
    if type(getattr(layer, "base_layer", None)) is not torch.nn.Linear:
        return False
    if layer.training or layer.merged or layer.disable_adapters:
        return False
    return not any(layer.use_dora.get(a) or getattr(layer, "lora_bias", {}).get(a)
                   or a in getattr(layer, "lora_variant", {}) for a in adapters)


def lora_layers(module: torch.nn.Module):
    """(parent, attribute, PEFT LoRA layer) of every layer with LoRA linear matrices."""
    for parent in module.modules():
        for name, layer in parent.named_children():
            if isinstance(getattr(layer, "lora_A", None), torch.nn.ModuleDict):
                yield parent, name, layer


def plan(policy, names: RowAdapters):
    """(parent, attribute, layer, the batch's adapters it has) for each LoRA layer, or None when
    some layer is not covered (the batch then takes PEFT's path)."""
    adapters = _adapters(names)
    layers = []
    for parent, name, layer in _known_lora_layers(policy):
        here = [a for a in adapters if a in layer.lora_A]
        if here and not eligible(layer, here):
            return None
        layers.append((parent, name, layer, here))
    return layers


def _known_lora_layers(policy) -> list:
    """``lora_layers`` of the policy's model, found again when an adapter is added, loaded or
    deleted (PEFT injects layers when an adapter targets new modules) and by ``forget_stacks``:
    walking the model's modules took 25 ms a decode, more than a decode step of the bundled model."""
    key = tuple((name, id(config)) for name, config in getattr(policy.model, "peft_config", {}).items())
    known = policy.__dict__.get("_lora_layers")
    if known is None or known[0] != key:
        known = (key, list(lora_layers(policy.causal_lm)))
        policy.__dict__["_lora_layers"] = known
    return known[1]


def batched(policy, layers, names: RowAdapters, base_of: Callable):
    """The modules to swap in for ``plan``'s layers, and the selection ``_Model`` sets per forward."""
    adapters = _adapters(names)
    selection = Selection(names, adapters)
    stacks = _stacks(policy, layers, adapters)
    swaps = []
    for (parent, name, layer, _), stack in zip(layers, stacks):
        base = base_of(layer)
        swaps.append((parent, name, base if stack is None else BatchedLoRA(base, stack, selection)))
    return swaps, selection


def forget_stacks(policy) -> None:
    """Drop every kept stack and the list of LoRA layers (an adapter was loaded, reloaded or unloaded)."""
    policy.__dict__.pop("_lora_stacks", None)
    policy.__dict__.pop("_lora_layers", None)


def _adapters(names: RowAdapters) -> list[str]:
    """The batch's adapters in one order whatever the rows' order, so a set's stacks are made once."""
    return sorted({n for n in names if n != BASE_ADAPTER})


def _stacks(policy, layers, adapters: list[str]) -> list[_Stack | None]:
    kept: OrderedDict = policy.__dict__.setdefault("_lora_stacks", OrderedDict())
    tensors = [(id(t), t._version) for _, _, layer, here in layers for a in here
               for t in (layer.lora_A[a].weight, layer.lora_B[a].weight)]
    key = (tuple(adapters), tuple(tensors),
           tuple(layer.scaling[a] for _, _, layer, here in layers for a in here))
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    with torch.inference_mode(False), torch.no_grad():
        stacks = [_stack(layer, here, adapters) if here else None for _, _, layer, here in layers]
    kept[key] = stacks
    while len(kept) > STACKS_KEPT:
        kept.popitem(last=False)
    return stacks


def _stack(layer, here: list[str], adapters: list[str]) -> _Stack:
    dtype = layer.base_layer.weight.dtype
    a = torch.cat([layer.lora_A[n].weight.to(dtype) for n in here])  # (R, in)
    b = torch.cat([layer.lora_B[n].weight.to(dtype) * layer.scaling[n] for n in here], dim=1)  # (out, R)
    layout = tuple((adapters.index(n), layer.lora_A[n].weight.shape[0]) for n in here)
    return _Stack(a.detach().clone(), b.detach().contiguous(), layout)
