"""Token-level extensions with vLLM's names: the prompt's own logprobs (``prompt_logprobs``).

A prompt is scored by one forward pass of the model that answers (its adapter included) at
temperature 1, on the engine's thread. vLLM's shape: one entry per prompt token, ``null`` for
the first (nothing comes before it), else ``{token id: {"logprob", "rank", "decoded_token"}}``
holding the prompt's own token and the ``k`` most likely ones. ``rank`` counts the tokens at
least as likely as this one, itself included (vLLM's rule: the most likely token is 1).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

from grooves.policy.decoding import BASE_ADAPTER
from grooves.serve.engine import EngineStopped
from grooves.serve.responses import token_entry
from grooves.serve.server import Server, stopped_error

Scored = list[tuple[float, int, list[tuple[int, float]]]]  # per prompt token after the first: logprob, rank, top k


@torch.inference_mode()
def score_prompt(server: Server, resolved, ids: list[int], top: int) -> Scored:
    """(logprob, rank, top ``top``) of each prompt token after the first. The engine's thread only."""
    policy = server.policy
    adapter = server.registry.acquire(resolved, set())
    switch = contextlib.nullcontext()
    if policy.has_adapter and adapter == BASE_ADAPTER:
        switch = policy.model.disable_adapter()
    elif adapter != BASE_ADAPTER:
        policy.model.set_adapter(adapter)
    tokens = torch.tensor([ids], device=policy.device)
    with switch:
        logits = policy.causal_lm(input_ids=tokens).logits[0, :-1].float()  # (L-1, V)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[0, 1:, None])  # (L-1, 1)
    ranks = (logp >= chosen).sum(dim=-1).tolist()
    best = logp.topk(top, dim=-1) if top else None
    return [(chosen[i, 0].item(), ranks[i],
             list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else [])
            for i in range(len(ranks))]


async def scored_prompt(server: Server, resolved, ids: list[int], top: int) -> Scored:
    try:
        return await asyncio.wrap_future(server.engine.control(lambda: score_prompt(server, resolved, ids, top)))
    except EngineStopped:
        raise stopped_error() from None


def prompt_logprobs(tokenizer, ids: list[int], scored: Scored) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` list for a scored prompt."""
    def entry(token: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_entry(tokenizer, token, logprob)["token"]}

    out: list[dict[int, dict[str, Any]] | None] = [None]
    for token, (logprob, rank, best) in zip(ids[1:], scored):
        position = {token: entry(token, logprob, rank)}
        for place, (other, value) in enumerate(best, start=1):
            position.setdefault(other, entry(other, value, place))
        out.append(position)
    return out
