"""Response bodies in OpenAI's shapes: chat completions, their stream chunks, legacy completions.

Logprobs are those of the sampling distribution (logits / temperature, before top-p and
constraints), as the trainer computes them. Each logprob entry's ``bytes`` are the token's
own bytes, not those of its decoded text: a token that holds half of a UTF-8 character has
no text of its own (it decodes to U+FFFD), but its bytes joined with its neighbours'
rebuild the reply exactly. Special tokens (the end-of-turn token) have no bytes (``null``).
"""

from __future__ import annotations

import re
import time
import uuid
from functools import lru_cache
from typing import Any

from grooves.policy.decoding import RowOutput
from grooves.policy.tools import parse_tool_calls
from grooves.serve.protocol import ChatCompletionRequest

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each byte is written as one printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...)
    take the characters from U+0100 on, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The bytes a token stands for; None for special tokens, which have no text."""
    if token_id in tokenizer.all_special_ids:
        return None
    piece = tokenizer.convert_ids_to_tokens(token_id)
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ == "ByteLevel":
        alphabet = _byte_level_alphabet()
        if all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
    if match := _BYTE_TOKEN.match(piece or ""):
        return bytes([int(match.group(1), 16)])
    if piece and piece.startswith("\u2581"):  # SentencePiece's word-start marker is a space
        return (" " + piece[1:]).encode()
    return tokenizer.decode([token_id]).encode()


def token_entry(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    text = tokenizer.convert_ids_to_tokens(token_id) if raw is None else raw.decode("utf-8", errors="replace")
    return {"token": text, "logprob": logprob, "bytes": None if raw is None else list(raw)}


def logprob_content(tokenizer, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
    """One ``logprobs.content`` item of a chat completion."""
    return {**token_entry(tokenizer, token_id, logprob), "top_logprobs": [token_entry(tokenizer, t, lp)
                                                                           for t, lp in top]}


def logprobs_block(policy, output: RowOutput) -> dict[str, Any]:
    tops = output.top_logprobs or [[] for _ in output.token_ids]
    return {"content": [logprob_content(policy.tokenizer, token, logprob, top)
                        for token, logprob, top in zip(output.token_ids, output.logprobs, tops)]}


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_message(request: ChatCompletionRequest, text: str, finish_reason: str) -> tuple[dict, str]:
    """The assistant message (with parsed tool calls when tools were offered) and the finish reason."""
    if request.wants_tools:
        parsed = parse_tool_calls(text)
        calls = parsed.tool_calls if request.parallel_tool_calls else parsed.tool_calls[:1]
        if calls:
            message = {"role": "assistant", "content": parsed.content or None,
                       "tool_calls": [c.to_openai() for c in calls]}
            return message, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


def completion_body(request: ChatCompletionRequest, policy, prompt_ids: list[int], outputs: list[RowOutput],
                    adapter_step: int | None, served: str | None = None,
                    prompt_logprobs: list | None = None) -> dict[str, Any]:
    """A chat completion; ``served`` (RUN@STEP, a LoRA's name or the base) becomes ``system_fingerprint``."""
    choices = []
    for index, output in enumerate(outputs):
        message, finish = choice_message(request, output.text, output.finish_reason)
        choice = {"index": index, "message": message, "finish_reason": finish,
                  "logprobs": logprobs_block(policy, output) if request.logprobs else None}
        if request.return_token_ids:
            choice["token_ids"] = output.token_ids
            choice["grooves"] = {"completion_token_ids": output.token_ids, "completion_logprobs": output.logprobs}
        choices.append(choice)
    body = {
        "id": completion_id(), "object": "chat.completion", "created": int(time.time()), "model": request.model,
        "system_fingerprint": served, "choices": choices,
        "usage": usage(len(prompt_ids), sum(len(o.token_ids) for o in outputs)),
    }
    if request.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
        body["grooves"] = {"prompt_token_ids": prompt_ids, "adapter_step": adapter_step}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def chunk_body(request, chunk_id: str, created: int, index: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": request.model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def tool_call_deltas(message: dict) -> list[dict[str, Any]]:
    """A message's tool calls as stream deltas: each with its ``index``, as the spec's first delta of a call."""
    return [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or [])]
