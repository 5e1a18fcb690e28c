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

The rows and outputs live in ``rows.py``, the packed CPU weights in ``packing.py`` and the
prefill and KV cache in ``prefill.py``; this module is the loop and the token choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grooves.policy.packing import _foldable_adapter, packed_linears
from grooves.policy.prefill import _prefill, _row_past
from grooves.policy.rows import BASE_ADAPTER, Constraint, FinishCallback, Past, Row, RowOutput, TokenCallback, _Model

__all__ = ["BASE_ADAPTER", "Constraint", "FinishCallback", "Past", "Row", "RowOutput", "TokenCallback", "decode",
           "pick_tokens", "sample_from", "top_p_filter"]


@torch.inference_mode()
def decode(policy, rows: list[Row], on_token: TokenCallback | None = None,
           on_finish: FinishCallback | None = None) -> list[RowOutput]:
    """Generate every row to its end in one batch; ``on_finish`` hears of each row as it leaves the
    batch, its output complete, while the other rows go on (a judge can start on it)."""
    with packed_linears(policy, _foldable_adapter(policy, rows)):
        return _decode(policy, rows, on_token, on_finish)


def _decode(policy, rows: list[Row], on_token: TokenCallback | None,
            on_finish: FinishCallback | None) -> list[RowOutput]:
    model = _Model(policy, rows)
    cache, logits, attention, next_position = _prefill(model, policy.device, rows, max(r.max_new_tokens for r in rows))
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
            elif row.cancelled is not None and row.cancelled():  # its client is gone: stop paying for it
                out.finish_reason = "abort"
            elif len(out.token_ids) < row.max_new_tokens:
                keep.append(position)
            if position not in keep:  # leaving the batch
                if row.keep_past:  # take its KV with it
                    out.past = _row_past(cache, position, attention[position])
                out.text = _text(policy, out.token_ids, row.stop)
                if on_finish is not None:
                    on_finish(row_index, out)
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
    return outputs


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
