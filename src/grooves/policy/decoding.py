"""The decode loop shared by the training sampler and the server.

Each row of a batch carries its own settings: temperature, top-p, token budget, stop
strings, random generator, LoRA adapter and an optional constraint (a grammar that masks
tokens, e.g. for JSON output). Rows that share a prompt and an adapter are prefilled once;
rows that finish leave the batch and its KV cache.

Bookkeeping (training relies on it):

- ``logprobs[t] = log_softmax(logits_t / T)[token_t]``, taken before top-p and before any
  constraint mask: the numbers a training forward at temperature ``T`` recomputes. At
  ``T = 0`` (greedy) they are ``log_softmax(logits_t)``.
- A row that ends on a stop token or stop string keeps that token in ``token_ids``; its
  ``text`` leaves the stop token/string out (as OpenAI does).
- Padding is tracked by lengths and an attention mask, never by ``pad_token_id``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

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
    past: Past | None = None  # the KV of a prefix of prompt_ids, from an earlier decode (keep_past)
    keep_past: bool = False  # return the row's KV (prompt and tokens but the last) as RowOutput.past


@dataclass
class Past:
    """One row's KV cache: per layer ``(keys, values)`` of shape ``(heads, length, head_dim)``, for the
    first ``length`` tokens of a sequence. A multi-turn rollout keeps it between its turns, so a
    turn's prompt (the whole conversation) is not run through the model again."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[1]


@dataclass
class RowOutput:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token, stop string or finished constraint) or "length"
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    past: Past | None = None  # with Row.keep_past: the KV of prompt_ids + token_ids[:-1]


TokenCallback = Callable[[int, int, float], None]  # (row index, token id, logprob) as each token is chosen


@torch.inference_mode()
def decode(policy, rows: list[Row], on_token: TokenCallback | None = None) -> list[RowOutput]:
    """Generate every row to its end in one batch."""
    with packed_linears(policy, _foldable_adapter(policy, rows)):
        return _decode(policy, rows, on_token)


def _decode(policy, rows: list[Row], on_token: TokenCallback | None) -> list[RowOutput]:
    model = _Model(policy, rows)
    cache, logits, attention, next_position = _prefill(model, policy.device, rows)
    _make_room(cache, max(r.max_new_tokens for r in rows))
    active = list(range(len(rows)))  # original index of each row still in the batch
    outputs = [RowOutput("", [], [], "length") for _ in rows]
    stop_ids = policy.stop_token_ids
    for _ in range(max(r.max_new_tokens for r in rows)):
        chosen, chosen_logprob, top = pick_tokens(logits, [rows[i] for i in active],
                                                  [rows[i].max_new_tokens - len(outputs[i].token_ids) for i in active])
        keep = []
        for position, row_index in enumerate(active):
            row, out, token = rows[row_index], outputs[row_index], chosen[position]
            out.token_ids.append(token)
            out.logprobs.append(chosen_logprob[position])
            if row.top_logprobs:
                out.top_logprobs.append(top[position])
            if row.constraint is not None:
                row.constraint.accept(token)
            if on_token is not None:
                on_token(row_index, token, chosen_logprob[position])
            if ((token in stop_ids and not row.ignore_eos) or _hits_stop_string(policy, out.token_ids, row.stop)
                    or (row.constraint is not None and row.constraint.is_terminated())):
                out.finish_reason = "stop"
            elif len(out.token_ids) < row.max_new_tokens:
                keep.append(position)
            if row.keep_past and position not in keep:  # leaving the batch: take its KV with it
                out.past = _row_past(cache, position, attention[position])
        if not keep:
            break
        next_tokens = torch.tensor([chosen[p] for p in keep], device=policy.device)
        if len(keep) < len(active):  # drop finished rows from the batch and the cache
            index = torch.tensor(keep, device=policy.device)
            cache.batch_select_indices(index)
            attention, next_position = attention[index], next_position[index]
            active = [active[p] for p in keep]
        attention = torch.cat([attention, attention.new_ones(len(active), 1)], dim=1)
        logits = model(active, input_ids=next_tokens[:, None], attention_mask=attention,
                       position_ids=next_position[:, None], cache=cache, use_cache=True).logits[:, -1, :]
        next_position = next_position + 1
    for row, out in zip(rows, outputs):
        out.text = _text(policy, out.token_ids, row.stop)
    return outputs


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
def packed_linears(policy, adapter: str | None = None):
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
    """
    if not _can_pack(policy):
        yield
        return
    cache = policy.__dict__.setdefault("_packed_linears", {})
    swapped = []
    try:
        for parent, name, layer in list(_lora_layers(policy.causal_lm, adapter)):
            setattr(parent, name, _folded(cache, layer, adapter))  # its base layer leaves the tree with it
            swapped.append((parent, name, layer))
        for parent, name, linear in list(_plain_linears(policy.causal_lm)):
            key = (id(linear), linear.weight.data_ptr(), linear.weight._version,
                   tuple(getattr(parent, "merged_adapters", ())))
            packed = cache.get(id(linear))
            if packed is None or packed[0] != key:
                cache.pop(id(parent), None)  # one packed copy of a layer at a time: drop its folded one
                with torch.inference_mode(False), torch.no_grad():
                    packed = (key, PackedLinear(linear.weight, linear.bias))
                cache[id(linear)] = packed
            setattr(parent, name, packed[1])
            swapped.append((parent, name, linear))
        yield
    finally:
        for parent, name, linear in reversed(swapped):
            setattr(parent, name, linear)


def _foldable_adapter(policy, rows: list[Row]) -> str | None:
    """The adapter to fold into the packed weights for ``rows``: the policy's only adapter, when
    every row runs the model as it is (a training sampler's rows). A server names each row's
    adapter and is not folded: with batches for the base and for adapters taking turns, every
    turn would pack the layers again."""
    if not policy.has_adapter or any(r.adapter is not None for r in rows):
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


class _Model:
    """Calls the model with the rows' adapters.

    When every row uses the same adapter (or none), the model runs plainly with that adapter
    switched on (or all switched off); PEFT's mixed-batch path, which splits every layer's
    input by adapter, is used only for batches that really mix adapters.
    """

    def __init__(self, policy, rows: list[Row]):
        self.policy = policy
        self.names = None
        if not policy.has_adapter and any(r.adapter not in (None, BASE_ADAPTER) for r in rows):
            raise ValueError("a row asks for an adapter but the model has none loaded")
        if policy.has_adapter and any(r.adapter is not None for r in rows):
            active = policy.model.active_adapter
            self.names = [r.adapter or active for r in rows]

    def __call__(self, active: list[int], **kwargs):
        if self.names is None:
            return self.policy.causal_lm(**kwargs)
        names = [self.names[i] for i in active]
        if len(set(names)) > 1:
            return self.policy.model(adapter_names=names, **kwargs)
        if names[0] == BASE_ADAPTER:
            with self.policy.model.disable_adapter():
                return self.policy.causal_lm(**kwargs)
        if self.policy.model.active_adapter != names[0]:
            self.policy.model.set_adapter(names[0])
        return self.policy.causal_lm(**kwargs)


def _row_past(cache, position: int, attention: torch.Tensor) -> Past:
    """Row ``position``'s KV without its padding columns (indexing copies: the batch cache moves on)."""
    columns = attention.nonzero().squeeze(1)
    return Past([(layer.keys[position][:, columns], layer.values[position][:, columns]) for layer in cache.layers])


def _make_room(cache, tokens: int) -> None:
    """Give every layer of a prefilled cache room for ``tokens`` more positions (``_roomy_layer``)."""
    from transformers.cache_utils import DynamicLayer

    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            cache.layers[index] = _roomy_layer()(layer.keys, layer.values, tokens)


@functools.cache
def _roomy_layer() -> type:
    """The class below, built on first use (transformers loads only when a model decodes)."""
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        """A KV cache layer with room reserved after its positions: a decode step writes its
        token's keys and values in place. The plain layer concatenates, which copies the whole
        cache of the batch at every step (most of a long multi-turn decode's time on a CPU).
        ``keys`` and ``values`` are views of the used part."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
            super().__init__()
            self.device, self.is_initialized, self.length = keys.device, True, keys.shape[-2]
            self._keys = keys.new_empty(*keys.shape[:-2], self.length + room, keys.shape[-1])
            self._values = values.new_empty(*values.shape[:-2], self.length + room, values.shape[-1])
            self._keys[..., : self.length, :], self._values[..., : self.length, :] = keys, values
            self._views()

        def _views(self) -> None:
            self.keys, self.values = self._keys[..., : self.length, :], self._values[..., : self.length, :]

        def update(self, key_states, value_states, *args, **kwargs):
            new = key_states.shape[-2]
            if self.length + new > self._keys.shape[-2]:  # out of room: grow (copies once, not per step)
                extra = max(new, self._keys.shape[-2])
                self._keys = torch.cat([self._keys, self._keys.new_empty(*self._keys.shape[:-2], extra,
                                                                         self._keys.shape[-1])], dim=-2)
                self._values = torch.cat([self._values, self._values.new_empty(*self._values.shape[:-2], extra,
                                                                               self._values.shape[-1])], dim=-2)
            self._keys[..., self.length: self.length + new, :] = key_states
            self._values[..., self.length: self.length + new, :] = value_states
            self.length += new
            self._views()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._keys, self._values = self._keys[indices, ...], self._values[indices, ...]
            self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._views()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("a decode cache is never cropped")

        def reset(self) -> None:
            raise NotImplementedError("a decode cache is never reset")

    return RoomyLayer


SHARED_PREFIX_MIN = 64  # tokens; a shorter common beginning is not worth a separate forward


def _prefill(model: _Model, device, rows: list[Row]):
    """Run each distinct (prompt, adapter) once, left-padded, then give every row its own cache copy.

    Distinct prompts that begin alike for at least ``SHARED_PREFIX_MIN`` tokens under one adapter
    (an agent env's system prompt and tools, before each task's own message) run that beginning
    once: it becomes every prompt's past, and only the rest of each prompt is prefilled.
    """
    from transformers import DynamicCache

    if any(r.past is not None for r in rows):
        return _prefill_past(model, device, rows)
    unique: dict[tuple, int] = {}
    row_source = [unique.setdefault((tuple(r.prompt_ids), r.adapter), len(unique)) for r in rows]
    prompts = [list(key[0]) for key in unique]
    if min(len(p) for p in prompts) == 0:
        raise ValueError("a prompt has no tokens")
    first_of = {source: row for row, source in reversed(list(enumerate(row_source)))}
    prefill_rows = [first_of[source] for source in range(len(prompts))]  # one row per prompt, for its adapter
    index = torch.tensor(row_source, device=device)
    shared = _common_prefix(prompts) if len({key[1] for key in unique}) == 1 else 0
    if len(prompts) > 1 and shared >= SHARED_PREFIX_MIN:
        past = _prefix_past(model, device, prompts[0][:shared], prefill_rows[0])
        firsts = [dataclasses.replace(rows[i], past=past) for i in prefill_rows]
        cache, logits, attention, lengths = _prefill_past(model, device, firsts, prefill_rows)
        cache.batch_select_indices(index)
        return cache, logits[index], attention[index], lengths[index]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    attention = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        attention[i, width - len(p):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.policy.causal_lm.config)
    logits = model(prefill_rows, input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1, :]  # (U, V)
    cache.batch_select_indices(index)  # (U, ...) -> (N, ...): n samples of a prompt share its prefill
    lengths = torch.tensor([len(p) for p in prompts], device=device)[index]
    return cache, logits[index], attention[index], lengths  # next position of each row = its prompt length


def _common_prefix(prompts: list[list[int]]) -> int:
    """Length of the beginning every prompt shares, short of the shortest prompt's last token
    (each prompt keeps at least one token of its own to prefill)."""
    limit = min(len(p) for p in prompts) - 1
    for position in range(limit):
        token = prompts[0][position]
        if any(p[position] != token for p in prompts):
            return position
    return max(limit, 0)


def _prefix_past(model: _Model, device, prefix: list[int], row: int) -> Past:
    """The KV of ``prefix``, run once for ``row``'s adapter."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.policy.causal_lm.config)
    ids = torch.tensor([prefix], device=device)
    model([row], input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(len(prefix),
          device=device)[None], cache=cache, use_cache=True, logits_to_keep=1)
    return Past([(layer.keys[0], layer.values[0]) for layer in cache.layers])


def _prefill_past(model: _Model, device, rows: list[Row], model_rows: list[int] | None = None):
    """Prefill rows that bring the KV of their prompt's prefix: only the rest of each prompt runs.

    The batch cache holds each row's past right-aligned after left padding, then the prompts'
    remaining tokens, left-padded too; the attention mask hides both paddings and the position
    ids continue each row's own sequence, so every row sees exactly its own tokens in order.
    """
    from transformers import DynamicCache

    cached = [r.past.length if r.past is not None else 0 for r in rows]
    rests = [r.prompt_ids[c:] for r, c in zip(rows, cached)]
    if any(not rest for rest in rests):
        raise ValueError("a row's past covers its whole prompt: the prompt must go on after it")
    width_past, width = max(cached), max(len(rest) for rest in rests)
    first = next(r.past for r in rows if r.past is not None)
    layers = []
    for index, (keys, values) in enumerate(first.layers):
        shape = (len(rows), keys.shape[0], width_past, keys.shape[2])
        k, v = keys.new_zeros(shape), values.new_zeros(shape)
        for i, row in enumerate(rows):
            if row.past is not None:
                k[i, :, width_past - cached[i]:] = row.past.layers[index][0]
                v[i, :, width_past - cached[i]:] = row.past.layers[index][1]
        layers.append((k, v))
    cache = DynamicCache(layers, config=model.policy.causal_lm.config)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    attention = torch.zeros(len(rows), width_past + width, dtype=torch.long, device=device)
    positions = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, rest in enumerate(rests):
        ids[i, width - len(rest):] = torch.tensor(rest, device=device)
        attention[i, width_past - cached[i]: width_past] = 1
        attention[i, width_past + width - len(rest):] = 1
        positions[i, width - len(rest):] = torch.arange(cached[i], cached[i] + len(rest), device=device)
    active = model_rows if model_rows is not None else list(range(len(rows)))  # rows' indices in the decode
    logits = model(active, input_ids=ids, attention_mask=attention, position_ids=positions,
                   cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :]  # (N, V)
    lengths = torch.tensor([len(r.prompt_ids) for r in rows], device=device)
    return cache, logits, attention, lengths


def pick_tokens(logits: torch.Tensor, rows: list[Row], remaining: list[int]) -> tuple[list[int], list[float], list]:
    """One token per row, its logprob (before top-p and constraints) and the row's top logprobs."""
    logits = logits.float()  # (A, V)
    temperature = torch.tensor([r.temperature for r in rows], device=logits.device)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp = F.log_softmax(scaled, dim=-1)  # reported logprobs
    masked = scaled
    if any(r.constraint is not None for r in rows):
        masked = scaled.clone()
        for i, row in enumerate(rows):
            if row.constraint is not None:
                row.constraint.mask(masked[i], remaining[i])
    probs = F.softmax(masked, dim=-1)
    top_p = torch.tensor([r.top_p if r.top_p < 1 else float("inf") for r in rows], device=logits.device)
    if bool(torch.isfinite(top_p).any()):  # rows without top-p keep every token
        probs = top_p_filter(probs, top_p[:, None])
    tokens = masked.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if row.temperature > 0]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        tokens[index] = sample_from(probs[index], _uniforms([rows[i] for i in sampled], logits.device))
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    top = [[] for _ in rows]
    for i, row in enumerate(rows):
        if row.top_logprobs:
            values, ids = logp[i].topk(row.top_logprobs)
            top[i] = list(zip(ids.tolist(), values.tolist()))
    return tokens.tolist(), chosen.tolist(), top


def _uniforms(rows: list[Row], device) -> torch.Tensor:
    """One uniform draw per row from its own generator; rows sharing a generator draw in row order."""
    u = torch.empty(len(rows), device=device)
    by_generator: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_generator.setdefault(id(row.generator), []).append(i)
    for positions in by_generator.values():
        generator = rows[positions[0]].generator
        u[positions] = torch.rand(len(positions), generator=generator, device=device)
    return u


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalised ``probs`` ``(A, V)`` by inverting the CDF at ``uniforms`` ``(A,)``.

    Cheaper here than ``torch.multinomial`` (one cumsum instead of an exponential per
    vocabulary entry); ``right=True`` never lands on a zero-probability token.
    """
    cdf = probs.cumsum(dim=-1)  # (A, V)
    total = cdf[:, -1:]
    u = uniforms[:, None] * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rounding must not reach the total
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches ``top_p`` (unnormalised)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def _hits_stop_string(policy, token_ids: list[int], stop: tuple[str, ...]) -> bool:
    return bool(stop) and any(s in policy.decode(token_ids) for s in stop)


def _text(policy, token_ids: list[int], stop: tuple[str, ...]) -> str:
    text = policy.decode(token_ids)
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text
