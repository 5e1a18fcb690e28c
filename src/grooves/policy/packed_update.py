"""The update's forward through the decode's packed weights (``grooves.policy.packing``).

A training step samples with the adapter folded into oneDNN-packed copies of the frozen
layers, then trains that same adapter. Its forward can read those copies: a LoRA layer's
output ``W x + s B A x`` is ``(W + s B A) x``, the folded copy's product, so the forward runs
one packed product per layer instead of PEFT's three (and none of its per-layer Python), and
the output head runs through its packed copy too. The backward is written out by hand, from
the dense weights (oneDNN's packed op has no derivative):

- ``dx = dy W + s (dy B) A``; ``dA = s (dy B)^T x``; ``dB = s dy^T (A x)``;
- the head and other frozen plain layers: ``dx = dy W``.

These are PEFT's own products, so the gradient is the same up to float rounding (the forward
differs from PEFT's by the rounding of the fold: tests/test_packed_update.py holds both to
1e-5). The copies are those the decode keeps (no second copy in memory), used only while they
are current: after an optimizer step within a step (mini-batches, a second pass) the plain
path runs, and the next decode folds again.
"""

from __future__ import annotations

import contextlib

import torch

from grooves.policy.packing import PackedLinear, _can_pack, _foldable_adapter, _lora_layers, _plain_linears

PACK_UPDATE = True
"""Run the update's forward through the packed weights on CPU (see ``packed_update``)."""


class _PackedLoRA(torch.autograd.Function):
    """``x (W + s B A)^T`` from the packed fold; the gradient from the dense ``W``, ``A``, ``B``."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, packed: PackedLinear, weight, scale: float):
        ctx.save_for_backward(x, lora_a, lora_b, weight)
        ctx.scale = scale
        return packed(x)

    @staticmethod
    def backward(ctx, dy):
        x, a, b, weight = ctx.saved_tensors
        s = ctx.scale
        flat_x, flat_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # (N, in), (N, out)
        dyb = (flat_dy @ b).mul_(s)  # (N, r): s dy B
        dx = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            dx = (flat_dy @ weight).addmm_(dyb, a).reshape(x.shape)  # (N, in)
        if ctx.needs_input_grad[1]:
            grad_a = dyb.T @ flat_x  # (r, in)
        if ctx.needs_input_grad[2]:
            grad_b = (flat_dy.T @ (flat_x @ a.T)).mul_(s)  # (out, r)
        return dx, grad_a, grad_b, None, None, None


class _PackedFrozen(torch.autograd.Function):
    """``x W^T + bias`` from the packed copy of a frozen layer; ``dx = dy W``."""

    @staticmethod
    def forward(ctx, x, packed: PackedLinear, weight):
        ctx.save_for_backward(weight)
        return packed(x)

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        return (dy @ weight if ctx.needs_input_grad[0] else None), None, None


class _LoRAForward(torch.nn.Module):
    """Stands in for a PEFT LoRA linear during the update's forward."""

    def __init__(self, layer, adapter: str, packed: PackedLinear):
        super().__init__()
        self.packed, self.scale = packed, float(layer.scaling[adapter])
        self.weights = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.base_layer.weight)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        a, b, weight = self.weights
        return _PackedLoRA.apply(x, a, b, self.packed, weight, self.scale)


class _FrozenForward(torch.nn.Module):
    """Stands in for a frozen plain linear layer (the output head) during the update's forward."""

    def __init__(self, linear: torch.nn.Linear, packed: PackedLinear):
        super().__init__()
        self.packed, self.weight_ref = packed, (linear.weight,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PackedFrozen.apply(x, self.packed, self.weight_ref[0])


@contextlib.contextmanager
def packed_update(policy):
    """Within it, the policy's forward (with or without gradient) runs its adapter's LoRA layers
    and its frozen plain linears through the packed copies (``grooves.policy.packing``); outside
    it the model is as it was. Does nothing off CPU fp32, without exactly one active adapter, or
    with activation checkpointing (its recompute in the backward would run outside)."""
    adapter = _foldable_adapter(policy, []) if PACK_UPDATE and _can_pack(policy) else None
    if adapter is None or getattr(policy.causal_lm, "is_activation_checkpointing", False):
        yield
        return
    cache = policy.__dict__.setdefault("_packed_linears", {})
    layers = [(parent, name, layer) for parent, name, layer in _lora_layers(policy.causal_lm, adapter)
              if not _trains(layer.base_layer)]
    folds = [_current_fold(cache, layer, adapter) for _, _, layer in layers]
    if not layers or any(fold is None for fold in folds):  # folded for another adapter state: not worth a fold
        yield
        return
    swapped = []
    try:
        with torch.inference_mode(False):
            for (parent, name, layer), fold in zip(layers, folds):
                setattr(parent, name, _LoRAForward(layer, adapter, fold))
                swapped.append((parent, name, layer))
            for parent, name, linear in list(_plain_linears(policy.causal_lm)):
                if _trains(linear):
                    continue
                setattr(parent, name, _FrozenForward(linear, _plain_packed(cache, parent, linear)))
                swapped.append((parent, name, linear))
        yield
    finally:
        for parent, name, module in reversed(swapped):
            setattr(parent, name, module)


def _trains(linear: torch.nn.Linear) -> bool:
    return linear.weight.requires_grad or (linear.bias is not None and linear.bias.requires_grad)


def _current_fold(cache: dict, layer, adapter: str) -> PackedLinear | None:
    """The decode's folded copy of ``layer`` when it was folded from the adapter as it is now
    (the entry ``packing._folded`` keeps: key, adapter matrices, packed copy), else None: an update right after its sampling finds every
    fold current; after an optimizer step within the step (mini-batches, a second pass) the
    folds are stale, and folding again (a pass over every weight) is left to the next decode."""
    entry = cache.get(id(layer))
    if entry is None or len(entry) != 3:
        return None
    lora = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
    if entry[0] != _fold_key(layer, adapter) or not all(torch.equal(a, b) for a, b in zip(entry[1], lora)):
        return None
    return entry[2]


def _fold_key(layer, adapter: str) -> tuple:
    base = layer.base_layer.weight
    return (id(layer), adapter, base.data_ptr(), base._version, layer.scaling[adapter])


def _plain_packed(cache: dict, parent, linear: torch.nn.Linear) -> PackedLinear:
    """The decode's packed copy of a plain linear layer, under the key ``packed_linears`` uses."""
    key = (id(linear), linear.weight.data_ptr(), linear.weight._version, tuple(getattr(parent, "merged_adapters", ())))
    entry = cache.get(id(linear))
    if entry is None or entry[0] != key:
        cache.pop(id(parent), None)
        with torch.no_grad():
            entry = (key, PackedLinear(linear.weight, linear.bias))
        cache[id(linear)] = entry
    return entry[1]
