"""Server-sent events for chat and legacy completions.

Text goes out as tokens arrive, holding back what could still become a stop string or an
incomplete UTF-8 character. When the request offers tools the reply is sent whole at the
end (it is only known to be a tool call once it is complete), its calls as the spec's
deltas: each with its ``index``, ``id``, ``type`` and the function's name and arguments.
With ``stream_options.include_usage`` every chunk has ``"usage": null`` and a last chunk
with no choices carries the usage. Streamed logprobs come with each token, with its
``top_logprobs`` when asked. With ``return_token_ids`` (vLLM's rule) the first chunk carries
``prompt_token_ids`` and each chunk the ``token_ids`` it adds (ids of held-back text travel
with the next chunk), so the chunks' ids joined are the sample's ids. The last chunk of each
choice carries ``system_fingerprint``: which weights answered.

A client that disconnects ends the stream and sets the request's ``cancelled`` event, so the
engine stops generating for it (``CancellingStream``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from grooves.serve.engine import Finished, TokenEvent
from grooves.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from grooves.serve.responses import (
    choice_message, chunk_body, completion_id, logprob_content, logprobs_block, tool_call_deltas, usage,
)
from grooves.serve.server import Server, as_api_error, next_event

DONE = "data: [DONE]\n\n"
log = logging.getLogger("grooves.serve")


class CancellingStream(StreamingResponse):
    """A streamed reply whose end, however it comes (done, or the client gone), sets ``cancelled``."""

    def __init__(self, content, cancelled: threading.Event, **kwargs):
        super().__init__(content, **kwargs)
        self.cancelled = cancelled

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            log.info("the client of a stream went away")
        finally:
            self.cancelled.set()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class TextStream:
    """Incremental text of one sample, holding back a possible stop string or partial character."""

    def __init__(self, policy, stop: tuple[str, ...]):
        self.policy, self.stop = policy, stop
        self.ids: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.policy.decode(self.ids)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text = text[: min(cuts)]
        safe = len(text) - self.hold - (1 if text.endswith("\ufffd") else 0)
        delta = text[self.sent : safe] if safe > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self, final_text: str) -> str:
        return final_text[self.sent :]


async def chat_stream(server: Server, body: ChatCompletionRequest, prompt_ids: list[int], events: asyncio.Queue,
                      record: dict, served: str) -> AsyncIterator[str]:
    chunk_id, created = completion_id(), int(time.time())
    texts = [TextStream(server.policy, body.stop_list) for _ in range(body.n)]
    tokenizer = server.policy.tokenizer
    unsent: list[list[int]] = [[] for _ in range(body.n)]  # token ids not yet on a chunk, per choice

    def chunk(index: int, delta: dict, **kwargs) -> dict:
        out = chunk_body(body, chunk_id, created, index, delta, **kwargs)
        if body.return_token_ids:
            out["choices"][0]["token_ids"], unsent[index] = unsent[index], []
        return {**out, "usage": None} if body.include_usage else out

    for index in range(body.n):
        first = chunk(index, {"role": "assistant", "content": ""})
        if body.return_token_ids and index == 0:
            first["prompt_token_ids"] = prompt_ids
        yield sse(first)
    while True:
        try:
            event = await next_event(server, events)
        except ApiError as error:
            yield sse(error.body()) + DONE
            return
        if isinstance(event, TokenEvent):
            unsent[event.index].append(event.token)
            if body.wants_tools:
                continue  # sent whole at the end
            delta = texts[event.index].push(event.token)
            logprobs = None
            if body.logprobs:
                logprobs = {"content": [logprob_content(tokenizer, event.token, event.logprob, event.top)]}
            if delta or logprobs:
                yield sse(chunk(event.index, {"content": delta}, logprobs=logprobs))
        elif isinstance(event, Finished):
            for index, output in enumerate(event.outputs):
                for closing in _last_chunks(server, body, lambda delta, i=index: chunk(i, delta), texts[index],
                                            output, prompt_ids, event.adapter_step, served):
                    yield sse(closing)
            completion_tokens = sum(len(o.token_ids) for o in event.outputs)
            record["completion_tokens"] = completion_tokens
            if body.include_usage:
                yield sse({**chunk_body(body, chunk_id, created, 0, {}), "choices": [],
                           "usage": usage(len(prompt_ids), completion_tokens)})
            yield DONE
            return
        else:
            yield sse(as_api_error(event.error).body()) + DONE
            return


def _last_chunks(server: Server, body: ChatCompletionRequest, chunk, text: TextStream, output,
                 prompt_ids: list[int], adapter_step: int | None, served: str) -> list[dict]:
    """A choice's closing chunks: the rest of its text (or its tool calls), then one with the finish
    reason alone, as OpenAI sends it (the SDK's helper closes a tool call only on a later chunk)."""
    message, finish = choice_message(body, output.text, output.finish_reason)
    rest = chunk(_output_delta(body, message, text, output))
    if body.wants_tools and body.logprobs:
        rest["choices"][0]["logprobs"] = logprobs_block(server.policy, output)
    last = chunk({})
    last["system_fingerprint"] = served
    choice = last["choices"][0]
    choice["finish_reason"] = finish
    if body.return_token_ids:
        choice["grooves"] = {"completion_token_ids": output.token_ids, "completion_logprobs": output.logprobs}
        last["grooves"] = {"prompt_token_ids": prompt_ids, "adapter_step": adapter_step}
    if rest["choices"][0]["delta"]:
        return [rest, last]
    if "token_ids" in rest["choices"][0]:  # the ids of text held back until now go on the last chunk
        choice["token_ids"] = rest["choices"][0]["token_ids"]
    return [last]


def _output_delta(body: ChatCompletionRequest, message: dict, text: TextStream, output) -> dict:
    if not body.wants_tools:
        remaining = text.finish(output.text)
        return {"content": remaining} if remaining else {}
    delta = {"content": message["content"]} if message["content"] else {}
    if message.get("tool_calls"):
        delta["tool_calls"] = tool_call_deltas(message)
    return delta


async def legacy_stream(server: Server, body: CompletionRequest, prompts: list[list[int]], events: asyncio.Queue,
                        record: dict, served: str) -> AsyncIterator[str]:
    """Text deltas of each prompt's samples; events arrive as ``(prompt index, event)``. With
    ``return_token_ids`` a choice's first chunk carries its ``prompt_token_ids`` and each chunk
    the ``token_ids`` it adds (vLLM's fields)."""
    chunk_id, created = completion_id("cmpl"), int(time.time())
    texts: dict[int, TextStream] = {}
    unsent: dict[int, list[int]] = {}  # token ids not yet on a chunk, per choice
    started: set[int] = set()
    left, completion_tokens = len(prompts), 0

    def chunk(index: int, text: str, finish: str | None = None) -> dict:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        if body.return_token_ids:
            choice["token_ids"], unsent[index] = unsent.get(index, []), []
            if index not in started:
                choice["prompt_token_ids"] = prompts[index // body.n]
        started.add(index)
        out = {"id": chunk_id, "object": "text_completion", "created": created, "model": body.model,
               "choices": [choice]}
        return {**out, "usage": None} if body.include_usage else out

    while left:
        try:
            prompt, event = await next_event(server, events)
        except ApiError as error:
            yield sse(error.body()) + DONE
            return
        if isinstance(event, TokenEvent):
            index = prompt * body.n + event.index
            unsent.setdefault(index, []).append(event.token)
            stream = texts.setdefault(index, TextStream(server.policy, body.stop_list))
            if delta := stream.push(event.token):
                yield sse(chunk(index, delta))
        elif isinstance(event, Finished):
            for i, output in enumerate(event.outputs):
                index = prompt * body.n + i
                rest = texts.setdefault(index, TextStream(server.policy, body.stop_list)).finish(output.text)
                yield sse({**chunk(index, rest, output.finish_reason), "system_fingerprint": served})
                completion_tokens += len(output.token_ids)
            left -= 1
        else:
            yield sse(as_api_error(event.error).body()) + DONE
            return
    record["completion_tokens"] = completion_tokens
    if body.include_usage:
        yield sse({**chunk(0, ""), "choices": [], "usage": usage(sum(map(len, prompts)), completion_tokens)})
    yield DONE
