"""Per-token log-probabilities of completion tokens, for training.

Two paths give the same numbers (a test holds them to 1e-5, gradients included):

- ``completion_logprobs``: sequences are ``prompt_ids + completion_ids``, right-padded.
  With causal attention the padding after a sequence never influences its real
  positions, so no attention mask is needed.
- ``shared_prefix_logprobs``: rows that begin alike run their common prefix once; its KV
  cache is repeated for every row and the gradient flows back through it. The G completions
  of a group share their whole prompt (with ~150 prompt and ~30 completion tokens, ~3.5x fewer
  tokens); SFT transcripts of an agent env share its system prompt and tools.
  Rows of different lengths run after the prefix as one sequence, end to end, with a
  block-causal mask (``_packed_rows``): no padding to the longest row.
- ``SharedPrefix(detached=True)``: the same, with the prefix run once for many micro-batches
  (an SFT step's, whose examples all begin with one system prompt and tools).

Either way the output head runs only on the completion positions that are trained (mask 1):
prompt positions, tool results and env text never get full-vocabulary logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grooves.types import Trajectory

_kept_prefixes: ContextVar[list | None] = ContextVar("grooves_kept_prefixes", default=None)

PACK_ROWS = True
"""Run a shared prefix's rows as one sequence without padding (``_packed_rows``)."""
PACK_ROWS_MAX = 4096
"""At most this many tokens in that sequence: its attention grows with the square of the total
(every token is scored against every other, most of them masked), the padded batch's with each
row's own length; below it, the rows pack only where that costs less (``_packing_pays``)."""


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # (B, L) prompt + completion, right-padded
    starts: torch.Tensor  # (B,) index of the first completion token in input_ids
    targets: torch.Tensor  # (B, T) completion token ids, right-padded
    mask: torch.Tensor  # (B, T) 1.0 on model-generated completion tokens
    sampler_logprobs: torch.Tensor  # (B, T) the sampler's logprobs (0 where mask is 0)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> TokenBatch:
        return TokenBatch(*(t[rows] for t in (self.input_ids, self.starts, self.targets,
                                                self.mask, self.sampler_logprobs)))

    def trimmed(self) -> TokenBatch:
        """The same rows cut after their last position with ``mask > 0``: a row's logits there
        never depend on what follows (causal attention), so the columns after it are wasted work
        (a short group padded to the longest completion of the batch, a final tool result)."""
        trained = self.mask.any(dim=0).nonzero()
        width = int(trained[-1]) + 1 if len(trained) else 1
        if width == self.targets.shape[1]:
            return self
        end = int((self.starts + width).max())
        return TokenBatch(self.input_ids[:, :end], self.starts, self.targets[:, :width],
                          self.mask[:, :width], self.sampler_logprobs[:, :width])

    def chunks(self, size: int) -> list[torch.Tensor]:
        """Row indices in chunks of at most ``size`` rows that share one prompt."""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for row in range(len(self)):
            prompt = tuple(self.input_ids[row, : int(self.starts[row])].tolist())
            by_prompt.setdefault(prompt, []).append(row)
        return [torch.tensor(rows[i : i + size], device=self.input_ids.device)
                for rows in by_prompt.values() for i in range(0, len(rows), size)]


def build_token_batch(trajectories: list[Trajectory], device: torch.device | str = "cpu") -> TokenBatch:
    batch = len(trajectories)
    seq_len = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
    comp_len = max(max(len(t.completion_ids) for t in trajectories), 1)
    input_ids = torch.zeros(batch, seq_len, dtype=torch.long)
    targets = torch.zeros(batch, comp_len, dtype=torch.long)
    mask = torch.zeros(batch, comp_len)
    sampler_logprobs = torch.zeros(batch, comp_len)
    starts = torch.zeros(batch, dtype=torch.long)
    for row, t in enumerate(trajectories):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        input_ids[row, : p + c] = torch.tensor(t.prompt_ids + t.completion_ids)
        starts[row] = p
        targets[row, :c] = torch.tensor(t.completion_ids, dtype=torch.long)
        mask[row, :c] = torch.tensor(t.completion_mask, dtype=torch.float)
        sampler_logprobs[row, :c] = torch.tensor(t.logprobs, dtype=torch.float)
    return TokenBatch(input_ids.to(device), starts.to(device), targets.to(device),
                      mask.to(device), sampler_logprobs.to(device))


def completion_logprobs(
    causal_lm, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``(B, T)`` of ``batch.targets`` at ``temperature`` (and entropies).

    Position ``starts + t - 1`` predicts completion token ``t``. Entropy is computed
    without gradient (a diagnostic, not part of the loss).
    """
    hidden = causal_lm.get_decoder()(input_ids=batch.input_ids, use_cache=False).last_hidden_state  # (B, L, H)
    width = batch.targets.shape[1]
    offsets = torch.arange(width, device=hidden.device)
    index = (batch.starts[:, None] - 1 + offsets).clamp(max=hidden.shape[1] - 1)  # (B, T)
    picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    return _head_logprobs(causal_lm, picked, batch, temperature, with_entropy)


def shared_prefix_length(batch: TokenBatch) -> int:
    """How many leading tokens every row of ``batch`` has in common, at most its shortest prompt."""
    limit = int(batch.starts.min())
    same = (batch.input_ids[:, :limit] == batch.input_ids[:1, :limit]).all(dim=0)  # (limit,)
    differ = (~same).nonzero()
    return int(differ[0]) if len(differ) else limit


def shared_prefix_logprobs(
    causal_lm, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``completion_logprobs`` that runs the rows' common prefix once: the whole prompt of a
    group's G completions, or the system prompt and tools of SFT transcripts of different tasks.
    The prefix's KV cache is repeated for every row and the gradient flows back through it."""
    shared = shared_prefix_length(batch)
    if shared == 0:
        return completion_logprobs(causal_lm, batch, temperature, with_entropy)
    return SharedPrefix(causal_lm, batch.input_ids[0, :shared]).logprobs(batch, temperature, with_entropy)


@contextlib.contextmanager
def keep_prefix_states() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Within it, each ``SharedPrefix`` made also keeps ``(prefix ids (P,), its final hidden
    states (P, H), detached)`` in the list it yields: a training service answers the log-probs of
    a prompt's positions from them instead of running the prompt again (``grooves.backend.positions``)."""
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    token = _kept_prefixes.set(kept)
    try:
        yield kept
    finally:
        _kept_prefixes.reset(token)


class SharedPrefix:
    """A prefix that many rows begin with, run once for all of them; ``logprobs`` runs rows against
    its KV cache (the same numbers as ``completion_logprobs``).

    ``detached=False``: the rows' graphs reach through the cache into the prefix's own graph (one
    backward does it all). ``detached=True``: the cache is a leaf, so row after row (an SFT step's
    micro-batches) can run and backpropagate with the prefix run only once; ``backward()`` then
    sends the gradient they left on the cache back through the prefix, once (dL/dθ is a sum over
    the uses of the cache, so the result is the same gradient)."""

    def __init__(self, causal_lm, prefix_ids: torch.Tensor, detached: bool = False):  # prefix_ids (P,)
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.causal_lm, self.ids = causal_lm, prefix_ids
        cache = DynamicCache(config=causal_lm.config)
        hidden = causal_lm.get_decoder()(input_ids=prefix_ids[None], cache=cache,
                                         use_cache=True).last_hidden_state  # (1, P, H)
        if not all(type(layer) is DynamicLayer for layer in cache.layers):  # e.g. sliding windows cut the cache
            raise ValueError("SharedPrefix needs a model whose cache keeps every position")
        kept = _kept_prefixes.get()
        if kept is not None:
            kept.append((prefix_ids, hidden[0].detach()))
        # index 0 predicts a row's first completion token when its prompt is the whole prefix
        self._outputs = [hidden[:, -1:]] + [t for layer in cache.layers for t in (layer.keys, layer.values)]
        self._inputs = [t.detach().requires_grad_(t.requires_grad) for t in self._outputs] if detached \
            else self._outputs

    def __len__(self) -> int:
        return self.ids.shape[0]

    def logprobs(self, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``completion_logprobs(causal_lm, batch)`` for rows whose prompts begin with the prefix."""
        from transformers import DynamicCache

        shared = len(self)
        if int(batch.starts.min()) < shared or not bool((batch.input_ids[:, :shared] == self.ids).all()):
            raise ValueError("every row's prompt must begin with the shared prefix")
        rows, width = batch.targets.shape
        last, *kv = self._inputs
        packed = _packed_rows(self.causal_lm, batch, shared, last, kv) if PACK_ROWS and rows > 1 else None
        if packed is not None:
            return _head_logprobs(self.causal_lm, packed, batch, temperature, with_entropy)
        cache = DynamicCache(config=self.causal_lm.config)
        for layer in range(len(kv) // 2):  # expand: differentiable, the gradient sums over the rows
            cache.update(kv[2 * layer].expand(rows, -1, -1, -1), kv[2 * layer + 1].expand(rows, -1, -1, -1), layer)
        rest = batch.input_ids[:, shared: int((batch.starts + width).max())]  # (B, R), right-padded
        positions = torch.arange(shared, shared + rest.shape[1], device=rest.device).expand(rows, -1)
        hidden = self.causal_lm.get_decoder()(input_ids=rest, position_ids=positions, cache=cache,
                                              use_cache=True).last_hidden_state  # (B, R, H)
        # position starts + t - 1 predicts completion token t; index 0 below is the prefix's last position
        hidden = torch.cat([last.expand(rows, 1, -1), hidden], dim=1)  # (B, 1 + R, H)
        offsets = torch.arange(width, device=hidden.device)
        index = (batch.starts[:, None] - shared + offsets).clamp(max=hidden.shape[1] - 1)  # (B, T)
        picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
        return _head_logprobs(self.causal_lm, picked, batch, temperature, with_entropy)

    def backward(self) -> None:
        """With ``detached``, after the rows' ``backward()``: their gradient on the cache, through the prefix."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self._outputs, self._inputs)
                 if leaf is not out and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        self._outputs = self._inputs = []


def _packed_rows(causal_lm, batch: TokenBatch, shared: int, last: torch.Tensor, kv: list[torch.Tensor]):
    """The rows' hidden states ``(B, T, H)`` at the positions that predict their targets, from one
    sequence of all the rows' tokens after the prefix, end to end, instead of a batch padded to
    the longest (a group's completions of 5 to 48 tokens: a third of that batch was padding).

    Each row's tokens keep their own positions and attend to the prefix and to their own
    earlier tokens only (a block-causal mask), so every number is that of the padded batch up
    to float rounding. None when the model's attention takes no such mask (then the rows pad)."""
    kind = getattr(causal_lm.config, "_attn_implementation", None)
    if kind not in ("sdpa", "eager"):
        return None
    from transformers import DynamicCache

    device, width = batch.input_ids.device, batch.targets.shape[1]
    trained = batch.mask > 0
    counts = torch.where(trained.any(1), width - trained.flip(1).int().argmax(1), 0)  # (B,) targets to the last trained
    lengths = torch.where(counts > 0, batch.starts + counts - 1 - shared, 0).clamp(min=0).tolist()  # tokens each
    # row needs after the prefix: up to the one before its last trained target
    total, padded = sum(lengths), int((batch.starts + width).max()) - shared  # the padded batch's columns
    if total == 0 or total > PACK_ROWS_MAX or not _packing_pays(causal_lm.config, shared, lengths, padded):
        return None
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    offsets = torch.tensor([0] + lengths[:-1], device=device).cumsum(0)  # (B,) each row's first index
    local = torch.arange(total, device=device) - offsets[segment]  # (S,) index within its row
    ids = batch.input_ids[segment, shared + local][None]  # (1, S)
    allowed = (segment[:, None] == segment[None, :]) & (local[:, None] >= local[None, :])  # (S, S) block-causal
    allowed = torch.cat([allowed.new_ones(total, shared), allowed], dim=1)[None, None]  # (1, 1, S, P + S)
    mask = allowed if kind == "sdpa" else torch.zeros(allowed.shape, dtype=last.dtype, device=device).masked_fill(
        ~allowed, torch.finfo(last.dtype).min)
    cache = DynamicCache(config=causal_lm.config)
    for layer in range(len(kv) // 2):
        cache.update(kv[2 * layer], kv[2 * layer + 1], layer)
    hidden = causal_lm.get_decoder()(input_ids=ids, position_ids=(shared + local)[None], attention_mask=mask,
                                     cache=cache, use_cache=True).last_hidden_state[0]  # (S, H)
    hidden = torch.cat([last[0], hidden], dim=0)  # (1 + S, H): index 0 is the prefix's last position
    # target t of row i is predicted at its position starts + t - 1: the prefix's last one, or a row token
    position = batch.starts[:, None] - shared + torch.arange(width, device=device)  # (B, T) 0 = the prefix's last
    within = torch.minimum(position, torch.tensor(lengths, device=device)[:, None])  # untrained columns stay in range
    index = torch.where(within > 0, offsets[:, None] + within, 0)  # (B, T) into hidden
    return hidden[index]  # (B, T, H)


def _packing_pays(config, shared: int, lengths: list[int], padded: int) -> bool:
    """Whether one sequence of the rows' ``lengths`` costs less than the batch padded to ``padded``
    columns after a ``shared``-token prefix, counted in multiply-adds: a token's linear layers,
    and its attention to every key it is scored against (the packed sequence scores each token
    against all ``shared + total`` keys, most masked; a padded row against ``shared + padded``).
    Rows of similar length after a long prefix (SFT on agent transcripts) pad; a group of short
    and long completions after a short prompt packs."""
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    inner = getattr(config, "intermediate_size", 4 * hidden)
    per_token = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * inner  # q, o, k, v, MLP
    per_pair = 2 * heads * head_dim  # scores and the weighted sum
    total, rows = sum(lengths), len(lengths)
    packed = total * per_token + total * (shared + total) * per_pair
    padded_cost = rows * padded * per_token + rows * padded * (shared + padded) * per_pair
    return packed < padded_cost


def vocab_logprobs(causal_lm, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs over the vocabulary ``(N, V)`` from final hidden states ``(N, H)``: the output
    head, then the sampling temperature."""
    logits = causal_lm.get_output_embeddings()(hidden).float()  # (N, V)
    if temperature > 0 and temperature != 1:  # x / 1 is x: no pass over the (N, V) logits
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


def _head_logprobs(causal_lm, picked, batch, temperature, with_entropy):
    """Log-probs (and entropies) of the targets at the trained positions (mask > 0) only: an
    agent's completion is mostly tool results and the env's text, which never get gradient, and
    the vocabulary-wide head is the costliest part of a position. Other positions are 0."""
    keep = batch.mask > 0  # (B, T)
    logp_all = vocab_logprobs(causal_lm, picked[keep], temperature)  # (N, V)
    picked_logp = logp_all.gather(-1, batch.targets[keep][:, None]).squeeze(-1)  # (N,)
    logp = torch.zeros(keep.shape, dtype=picked_logp.dtype, device=keep.device).masked_scatter(keep, picked_logp)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            values = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
            entropy = torch.zeros(keep.shape, dtype=values.dtype, device=keep.device).masked_scatter(keep, values)
    return logp, entropy
