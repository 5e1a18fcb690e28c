"""``POST /v1/completions``, the legacy API: a raw prompt (text, several texts, or token ids),
no chat template, ``logprobs`` as an integer and ``echo`` (the prompt back, with its own
logprobs when asked: the way prompts are scored).

Prompt logprobs come from one forward pass of the named model (adapter included) at
temperature 1; the first prompt token has none (``null``), as in OpenAI's API. Generated
tokens' logprobs are the sampling distribution's, as in chat completions. A token that is
not whole UTF-8 is written ``bytes:\\xNN...`` in ``tokens``, OpenAI's convention.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from grooves.policy.decoding import RowOutput
from grooves.serve.engine import Failed, Finished, GenerationRequest
from grooves.serve.protocol import ApiError, CompletionRequest
from grooves.serve.responses import completion_id, token_bytes, usage
from grooves.serve.server import (
    CLIENT_GONE, Server, as_api_error, event_queue, next_event, served_headers, submit, watch_client,
)
from grooves.serve.streaming import CancellingStream, legacy_stream
from grooves.serve.tokens import prompt_logprobs, scored_prompt


async def completions(server: Server, body: CompletionRequest, request) -> Response | StreamingResponse:
    record = request.state.record
    body.check_supported()
    resolved = server.resolve(body.model)  # pinned: every prompt is answered by the same weights
    for prompt in body.prompts:
        if isinstance(prompt, str):
            server.check_text(len(prompt), param="prompt")
    prompts = [await run_in_threadpool(_ids, server, p) for p in body.prompts]
    for prompt in prompts:
        server.check_room(len(prompt), body.max_tokens)
    record.update(model=body.model, prompt_tokens=sum(len(p) for p in prompts))
    events, put = event_queue()
    cancelled = threading.Event()  # one for the whole request: its client is gone for every prompt
    for i, prompt in enumerate(prompts):
        if body.max_tokens == 0:  # nothing to generate: only the echo (prompt scoring)
            put((i, Finished([RowOutput("", [], [], "length") for _ in range(body.n)], resolved.step)))
            continue
        submit(server, GenerationRequest(
            model=body.model, prompt_ids=prompt, deliver=lambda e, i=i: put((i, e)), n=body.n,
            temperature=body.temperature, top_p=body.top_p, max_tokens=body.max_tokens, stop=body.stop_list,
            seed=body.seed, top_logprobs=body.logprobs or 0, stream=body.stream, ignore_eos=body.ignore_eos,
            resolved=resolved, cancelled=cancelled))
    headers = served_headers(resolved.served)
    if body.stream:
        stream = legacy_stream(server, body, prompts, events, record, resolved.served)
        return CancellingStream(stream, cancelled, media_type="text/event-stream", headers=headers)
    outputs: dict[int, list[RowOutput]] = {}
    async with watch_client(request.receive, cancelled) as gone:
        while len(outputs) < len(prompts) and not gone[0]:
            item = await next_event(server, events, gone)
            if item is None:
                break
            prompt, event = item
            if isinstance(event, Failed):
                raise as_api_error(event.error)
            if isinstance(event, Finished):
                outputs[prompt] = event.outputs
        if gone[0]:
            return Response(status_code=CLIENT_GONE)
    top = max(body.logprobs or 0, body.prompt_logprobs or 0)
    wants_scores = (body.echo and body.logprobs is not None) or body.wants_prompt_logprobs
    scored = [await scored_prompt(server, resolved, p, top) for p in prompts] if wants_scores \
        else [None] * len(prompts)
    record["completion_tokens"] = sum(len(o.token_ids) for outs in outputs.values() for o in outs)
    choices = [_choice(server, body, prompts[p], output, scored[p], p * body.n + j)
               for p in range(len(prompts)) for j, output in enumerate(outputs[p])]
    return JSONResponse({"id": completion_id("cmpl"), "object": "text_completion", "created": int(time.time()),
                         "model": body.model, "system_fingerprint": resolved.served, "choices": choices,
                         "usage": usage(record["prompt_tokens"], record["completion_tokens"])}, headers=headers)


def _ids(server: Server, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(server.policy.tokenizer.encode(prompt, add_special_tokens=True))
    vocab = server.policy.causal_lm.config.vocab_size
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    return prompt


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
    if body.return_token_ids:  # vLLM's names, per choice on this route
        choice.update(prompt_token_ids=prompt, token_ids=output.token_ids)
    if body.wants_prompt_logprobs:
        k = body.prompt_logprobs
        choice["prompt_logprobs"] = prompt_logprobs(server.policy.tokenizer, prompt, [(lp, rank, t[:k])
                                                                                      for lp, rank, t in scored])
    if body.logprobs is None:
        return choice
    tokenizer = server.policy.tokenizer
    ids, logprobs = list(output.token_ids), list(output.logprobs)
    tops = list(output.top_logprobs) or [[] for _ in ids]
    if body.echo:
        ids = prompt + ids
        k = body.logprobs
        logprobs = [None, *(lp for lp, _, _ in scored)] + logprobs
        tops = [None, *(t[:k] for _, _, t in scored)] + tops
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
