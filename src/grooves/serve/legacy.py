"""``POST /v1/completions``, the legacy API: a raw prompt (text, several texts, or token ids),
no chat template, ``logprobs`` as an integer and ``echo`` (the prompt back, with its own
logprobs when asked: the way prompts are scored).

Prompt logprobs come from one forward pass of the named model (adapter included) at
temperature 1; the first prompt token has none (``null``), as in OpenAI's API. Generated
tokens' logprobs are the sampling distribution's, as in chat completions. A token that is
not whole UTF-8 is written ``bytes:\\xNN...`` in ``tokens``, OpenAI's convention.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import torch
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from grooves.policy.decoding import BASE_ADAPTER, RowOutput
from grooves.serve.engine import EngineStopped, Failed, Finished, GenerationRequest
from grooves.serve.protocol import ApiError, CompletionRequest
from grooves.serve.responses import completion_id, token_bytes, usage
from grooves.serve.server import Server, as_api_error, event_queue, next_event, stopped_error, submit
from grooves.serve.streaming import legacy_stream


async def completions(server: Server, body: CompletionRequest, record: dict):
    body.check_supported()
    resolved = server.resolve(body.model)
    for prompt in body.prompts:
        if isinstance(prompt, str):
            server.check_text(len(prompt), param="prompt")
    prompts = [await run_in_threadpool(_ids, server, p) for p in body.prompts]
    for prompt in prompts:
        server.check_room(len(prompt), body.max_tokens)
    record.update(model=body.model, prompt_tokens=sum(len(p) for p in prompts))
    events, put = event_queue()
    for i, prompt in enumerate(prompts):
        if body.max_tokens == 0:  # nothing to generate: only the echo (prompt scoring)
            put((i, Finished([RowOutput("", [], [], "length") for _ in range(body.n)], resolved.step)))
            continue
        submit(server, GenerationRequest(
            model=body.model, prompt_ids=prompt, deliver=lambda e, i=i: put((i, e)), n=body.n,
            temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_tokens, stop=body.stop_list,
            seed=body.seed, top_logprobs=body.logprobs or 0, stream=body.stream, ignore_eos=body.ignore_eos))
    if body.stream:
        return StreamingResponse(legacy_stream(server, body, record["prompt_tokens"], events, len(prompts), record),
                                 media_type="text/event-stream")
    outputs: dict[int, list[RowOutput]] = {}
    while len(outputs) < len(prompts):
        prompt, event = await next_event(server, events)
        if isinstance(event, Failed):
            raise as_api_error(event.error)
        if isinstance(event, Finished):
            outputs[prompt] = event.outputs
    scored = [await _prompt_logprobs(server, resolved, p, body.logprobs) for p in prompts] \
        if body.echo and body.logprobs is not None else [None] * len(prompts)
    record["completion_tokens"] = sum(len(o.token_ids) for outs in outputs.values() for o in outs)
    choices = [_choice(server, body, prompts[p], output, scored[p], p * body.n + j)
               for p in range(len(prompts)) for j, output in enumerate(outputs[p])]
    return {"id": completion_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": body.model, "choices": choices,
            "usage": usage(record["prompt_tokens"], record["completion_tokens"])}


def _ids(server: Server, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(server.policy.tokenizer.encode(prompt, add_special_tokens=True))
    vocab = server.policy.causal_lm.config.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return prompt


async def _prompt_logprobs(server: Server, resolved, ids: list[int], top: int):
    """(logprob, top) of each prompt token after the first, computed on the engine's thread."""
    try:
        future = server.engine.control(lambda: prompt_logprobs(server, resolved, ids, top))
        return await asyncio.wrap_future(future)
    except EngineStopped:
        raise stopped_error() from None


@torch.inference_mode()
def prompt_logprobs(server: Server, resolved, ids: list[int], top: int) -> list[tuple[float, list]]:
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
    chosen = logp.gather(1, tokens[0, 1:, None]).squeeze(1).tolist()
    best = logp.topk(top, dim=-1) if top else None
    return [(chosen[i], list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best else [])
            for i in range(len(chosen))]


def _token_text(tokenizer, token_id: int) -> str:
    raw = token_bytes(tokenizer, token_id)
    if raw is None:
        return tokenizer.convert_ids_to_tokens(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _choice(server: Server, body: CompletionRequest, prompt: list[int], output: RowOutput, scored, index: int):
    decode = server.policy.decode
    text = (decode(prompt) if body.echo else "") + output.text
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": output.finish_reason, "logprobs": None}
    if body.logprobs is None:
        return choice
    tokenizer = server.policy.tokenizer
    ids, logprobs = list(output.token_ids), list(output.logprobs)
    tops = list(output.top_logprobs) or [[] for _ in ids]
    if body.echo:
        ids = prompt + ids
        logprobs = [None, *(lp for lp, _ in scored)] + logprobs
        tops = [None, *(t for _, t in scored)] + tops
    raw = [token_bytes(tokenizer, t) or b"" for t in ids]
    # where each token starts in `text`: characters before it; a character split over tokens starts at its first
    offsets = [len(b"".join(raw[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    choice["logprobs"] = {
        "tokens": [_token_text(tokenizer, t) for t in ids],
        "token_logprobs": logprobs,
        "top_logprobs": [None if top is None else {_token_text(tokenizer, t): lp for t, lp in top}
                         for top in tops] if body.logprobs else None,
        "text_offset": offsets,
    }
    return choice
