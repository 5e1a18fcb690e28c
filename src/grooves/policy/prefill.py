"""Prefill for the decode loop: each distinct prompt runs once, a long shared beginning runs
once for all prompts, and rows that bring the KV of a prefix (``Row.past``) run only the rest.
Also the KV cache layer with room reserved, so a decode step writes in place."""

from __future__ import annotations

import dataclasses
import functools

import torch

from grooves.policy.rows import Past, Row, _Model


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

        @classmethod
        def reserved(cls, keys: torch.Tensor, values: torch.Tensor, length: int):
            """A layer on buffers already the full size: the first ``length`` positions are in use."""
            layer = cls.__new__(cls)
            DynamicLayer.__init__(layer)
            layer.device, layer.is_initialized, layer.length = keys.device, True, length
            layer._keys, layer._values = keys, values
            layer._views()
            return layer

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


def _prefill(model: _Model, device, rows: list[Row], room: int = 0):
    """Run each distinct (prompt, adapter) once, left-padded, then give every row its own cache copy
    with ``room`` positions reserved for the decode.

    Distinct prompts that begin alike for at least ``SHARED_PREFIX_MIN`` tokens under one adapter
    (an agent env's system prompt and tools, before each task's own message) run that beginning
    once: it becomes every prompt's past, and only the rest of each prompt is prefilled.
    """
    from transformers import DynamicCache

    if any(r.past is not None for r in rows):
        return _prefill_past(model, device, rows, room=room)
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
        cache, logits, attention, lengths = _prefill_past(model, device, firsts, prefill_rows, room)
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
    _make_room(cache, room)
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


def _prefill_past(model: _Model, device, rows: list[Row], model_rows: list[int] | None = None, room: int = 0):
    """Prefill rows that bring the KV of their prompt's prefix: only the rest of each prompt runs.

    The batch cache holds each row's past right-aligned after left padding, then the prompts'
    remaining tokens, left-padded too; the attention mask hides both paddings and the position
    ids continue each row's own sequence, so every row sees exactly its own tokens in order.
    The cache is allocated once with ``room`` positions to spare for the decode (the forward and
    every decode step write in place), and each row's past is consumed: a layer's tensors are
    dropped from the ``Past`` as soon as they are in the batch, so the conversation's KV is held
    once, not twice (a multi-turn rollout's memory; see ``Row.past``).
    """
    from transformers import DynamicCache

    cached = [r.past.length if r.past is not None else 0 for r in rows]
    rests = [r.prompt_ids[c:] for r, c in zip(rows, cached)]
    if any(not rest for rest in rests):
        raise ValueError("a row's past covers its whole prompt: the prompt must go on after it")
    width_past, width = max(cached), max(len(rest) for rest in rests)
    pasts = list({id(r.past): r.past for r in rows if r.past is not None}.values())  # a past may serve many rows
    cache = DynamicCache(config=model.policy.causal_lm.config)
    for index in range(len(pasts[0].layers)):
        keys, values = pasts[0].layers[index]
        shape = (len(rows), keys.shape[0], width_past + width + room, keys.shape[2])
        k, v = keys.new_zeros(shape), values.new_zeros(shape)  # zeros: padding must stay finite under the mask
        for i, row in enumerate(rows):
            if row.past is not None:
                k[i, :, width_past - cached[i]: width_past] = row.past.layers[index][0]
                v[i, :, width_past - cached[i]: width_past] = row.past.layers[index][1]
        for past in pasts:
            past.layers[index] = None
        cache.layers[index] = _roomy_layer().reserved(k, v, width_past)
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
