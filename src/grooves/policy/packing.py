"""Packed weights for the CPU decode: oneDNN-reordered copies of the frozen linear layers, with
a training sampler's one LoRA adapter folded in, or a server's rows each on its own adapter
through ``grooves.policy.lora_batch`` (used by ``grooves.policy.decoding``)."""

from __future__ import annotations

import contextlib

import torch

from grooves.policy import lora_batch
from grooves.policy.lora_batch import RowAdapters
from grooves.policy.rows import Row, row_adapters

PACK_LINEARS = True
"""Decode through oneDNN-packed copies of the frozen linear weights on CPU (see ``packed_linears``)."""


class PackedLinear(torch.nn.Module):
    """A frozen linear layer whose weight oneDNN has reordered for small batches.

    ``torch.ops.mkldnn._linear_pointwise`` on a weight from ``_reorder_linear_weight`` is the
    path torch's own compiler takes for CPU linears; it reads dense inputs, so activations are
    never converted. Measured on this project's CPU for 8 rows: 2x faster than ``F.linear``
    on the decoder's matrices, 3.7x on the 49152 x 576 output head.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int = 8):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@contextlib.contextmanager
def packed_linears(policy, adapter: str | RowAdapters | None = None):
    """On a CPU in fp32, run the model's plain linear layers (LoRA base layers and the output
    head; not the LoRA matrices, which train) through oneDNN with weights packed once.

    Decoding multiplies a handful of rows by every weight matrix, and MKL's sgemm is slow at
    that shape on this project's reference CPU (the output head reads at about 6 GB/s against
    45 GB/s for a copy); see ``PackedLinear`` and docs/benchmarks.md. The packed copies cost
    one more copy of those weights in memory. They are rebuilt when a weight changes: each is
    keyed by the weight's storage and version (a load copies in place) and by the adapters
    PEFT merged into it (a merge writes through ``.data``, which the version does not see).

    ``adapter``: the one LoRA adapter a training sampler's rows use (``_foldable_adapter``).
    Its matrices are folded into the packed copy of each layer they adapt, ``W + scale * B @ A``
    (PEFT's ``get_delta_weight``; the model's own weights are not touched), so a decode step
    runs one product per layer instead of three, without PEFT's per-layer Python (a decode of
    2 x 8 titles on this project's CPU: 18% faster on one thread, 20% on two). The copy is
    folded again when the adapter's values change (compared by value: a fused optimizer step
    does not bump a tensor's version).
    Same numbers up to float rounding: tests/test_decoding.py compares the paths.

    ``adapter`` as ``RowAdapters`` (a server's rows, each naming its adapter): the LoRA layers
    are swapped for ``lora_batch.BatchedLoRA`` over the packed base layers (``_row_adapters``),
    on any device; the packing itself only on a CPU in fp32, as above.
    """
    if isinstance(adapter, RowAdapters):
        with _row_adapters(policy, adapter):
            yield
        return
    if not _can_pack(policy):
        yield
        return
    cache = policy.__dict__.setdefault("_packed_linears", {})
    swapped = []
    try:
        for parent, name, layer in list(_lora_layers(policy.causal_lm, adapter)):
            setattr(parent, name, _folded(cache, layer, adapter))  # its base layer leaves the tree with it
            swapped.append((parent, name, layer))
        _pack_plain_linears(policy, cache, swapped)
        yield
    finally:
        for parent, name, linear in reversed(swapped):
            setattr(parent, name, linear)


@contextlib.contextmanager
def _row_adapters(policy, names: RowAdapters):
    """A server's batch: every LoRA layer swapped for ``lora_batch.BatchedLoRA`` over the packed base
    (or the plain one off CPU), and the selection ``_Model`` sets per forward left on the policy.
    Nothing is folded: with batches for the base and for adapters taking turns, every turn would
    pack the layers again. When some layer is not covered, the batch takes PEFT's path."""
    layers = lora_batch.plan(policy, names)
    if layers is None:
        with packed_linears(policy):
            yield
        return
    packing = _can_pack(policy)
    cache = policy.__dict__.setdefault("_packed_linears", {})

    def base_of(layer):
        return _packed(cache, layer.base_layer, layer) if packing else layer.base_layer

    swaps, selection = lora_batch.batched(policy, layers, names, base_of)
    swapped = []
    try:
        for (parent, name, module), (_, _, layer, _) in zip(swaps, layers):
            setattr(parent, name, module)
            swapped.append((parent, name, layer))
        if packing:
            _pack_plain_linears(policy, cache, swapped)
        policy.__dict__["_lora_selection"] = selection
        yield
    finally:
        policy.__dict__.pop("_lora_selection", None)
        for parent, name, module in reversed(swapped):
            setattr(parent, name, module)


def _pack_plain_linears(policy, cache: dict, swapped: list) -> None:
    for parent, name, linear in list(_plain_linears(policy.causal_lm)):
        setattr(parent, name, _packed(cache, linear, parent))
        swapped.append((parent, name, linear))


def _packed(cache: dict, linear: torch.nn.Linear, parent: torch.nn.Module) -> PackedLinear:
    """``linear``'s packed copy, made again when its weight changed (see ``packed_linears``)."""
    key = (id(linear), linear.weight.data_ptr(), linear.weight._version, tuple(getattr(parent, "merged_adapters", ())))
    packed = cache.get(id(linear))
    if packed is None or packed[0] != key:
        cache.pop(id(parent), None)  # one packed copy of a layer at a time: drop its folded one
        with torch.inference_mode(False), torch.no_grad():
            packed = (key, PackedLinear(linear.weight, linear.bias))
        cache[id(linear)] = packed
    return packed[1]


def _foldable_adapter(policy, rows: list[Row]) -> str | RowAdapters | None:
    """What ``packed_linears`` does with the LoRA layers for ``rows``: fold the policy's only
    adapter (its name) when every row runs the model as it is (a training sampler's rows);
    swap in the batched LoRA (``RowAdapters``, each row's adapter) when rows name their
    adapters (a server's); nothing (None) without an adapter."""
    names = row_adapters(policy, rows)
    if names is not None:
        return RowAdapters(names) if lora_batch.BATCH_LORA else None
    if not policy.has_adapter:
        return None
    names = list(getattr(policy.model, "peft_config", {}))
    return names[0] if len(names) == 1 and policy.model.active_adapter == names[0] else None


def _lora_layers(module: torch.nn.Module, adapter: str | None):
    """(parent, attribute, LoRA layer) of each PEFT LoRA linear whose output is exactly its base
    layer plus ``adapter``'s product: on, not merged, not DoRA, no dropout at work, a plain base."""
    if adapter is None:
        return
    for parent in module.modules():
        for name, layer in parent.named_children():
            lora_a = getattr(layer, "lora_A", None)
            if not (isinstance(lora_a, torch.nn.ModuleDict) and adapter in lora_a
                    and type(getattr(layer, "base_layer", None)) is torch.nn.Linear):
                continue
            dropout = layer.lora_dropout[adapter]
            if (layer.disable_adapters or layer.merged or list(layer.active_adapters) != [adapter]
                    or layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter)
                    or (layer.training and not isinstance(dropout, torch.nn.Identity))):
                continue
            yield parent, name, layer


def _folded(cache: dict, layer, adapter: str) -> PackedLinear:
    """``layer``'s packed copy with ``adapter`` folded in, made again when any input to it changed."""
    base = layer.base_layer.weight
    lora = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
    key = (id(layer), adapter, base.data_ptr(), base._version, layer.scaling[adapter])
    entry = cache.get(id(layer))
    if entry is not None and entry[0] == key and all(torch.equal(a, b) for a, b in zip(entry[1], lora)):
        return entry[2]
    cache.pop(id(layer.base_layer), None)  # one packed copy of a layer at a time: drop the unfolded one
    with torch.inference_mode(False), torch.no_grad():
        weight = base + layer.get_delta_weight(adapter).to(base.dtype)
        packed = PackedLinear(weight, layer.base_layer.bias)
    cache[id(layer)] = (key, tuple(t.detach().clone() for t in lora), packed)
    return packed


def _can_pack(policy) -> bool:
    if not (PACK_LINEARS and policy.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and next(policy.causal_lm.parameters()).dtype == torch.float32):
        return False
    try:  # private oneDNN ops: a torch without them decodes the plain way
        return bool(torch.ops.mkldnn._linear_pointwise) and bool(torch.ops.mkldnn._reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


def _plain_linears(module: torch.nn.Module):
    """(parent, attribute, nn.Linear) of every plain linear layer outside the LoRA matrices."""
    for parent in module.modules():
        if isinstance(parent, torch.nn.ModuleDict):  # lora_A / lora_B: the trained matrices
            continue
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                yield parent, name, child


