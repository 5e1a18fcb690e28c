"""The OpenAI chat-completions request and response shapes, and grooves' extensions.

Extensions (``extra_body`` in the openai client): with ``"return_token_ids": true`` the
response carries ``grooves.prompt_token_ids`` and ``grooves.adapter_step`` at the
top level and ``grooves.completion_token_ids`` / ``grooves.completion_logprobs`` in each
choice: the exact ids the model saw and produced, so a trajectory is rebuilt without
re-tokenising. ``"ignore_eos": true`` makes every sample exactly ``max_tokens`` long (for
benchmarks). Logprobs are those of the sampling distribution (logits / temperature,
before top-p and constraints), as the trainer computes them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grooves.policy.decoding import RowOutput
from grooves.policy.tools import parse_tool_calls


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ChatCompletionRequest(BaseModel):
    # Unknown fields are ignored, as many clients send extras (user, metadata, store, ...).
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    return_token_ids: bool = False
    ignore_eos: bool = False  # grooves extension: always generate max_tokens (for benchmarks)

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role must be system, developer, user, assistant or tool")
            out.append({**message, "role": "system" if role == "developer" else role,
                        "content": _text_content(message.get("content"), i)})
        return out

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty and presence_penalty are not supported (use 0)")
        if self.stop is not None and len(self.stop_list) > 4:
            raise ValueError("stop takes at most 4 strings")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def wants_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _text_content(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError(f"messages[{index}]: only text content parts are supported")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


class AdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Alias to serve the checkpoint under.")
    checkpoint: str = Field(description="RUN@STEP or RUN@latest under the server's runs root.")


# --- responses -----------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def choice_message(request: ChatCompletionRequest, text: str, finish_reason: str) -> tuple[dict, str]:
    """The assistant message (with parsed tool calls when tools were offered) and the finish reason."""
    if request.wants_tools:
        parsed = parse_tool_calls(text)
        if parsed.tool_calls:
            message = {"role": "assistant", "content": parsed.content or None,
                       "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
            return message, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


def logprobs_block(policy, output: RowOutput) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = policy.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for i, (token, logprob) in enumerate(zip(output.token_ids, output.logprobs)):
        item = entry(token, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in output.top_logprobs[i]] if output.top_logprobs else []
        content.append(item)
    return {"content": content}


def completion_body(request: ChatCompletionRequest, policy, prompt_ids: list[int], outputs: list[RowOutput],
                    adapter_step: int | None) -> dict[str, Any]:
    choices = []
    for index, output in enumerate(outputs):
        message, finish = choice_message(request, output.text, output.finish_reason)
        choice = {"index": index, "message": message, "finish_reason": finish,
                  "logprobs": logprobs_block(policy, output) if request.logprobs else None}
        if request.return_token_ids:
            choice["grooves"] = {"completion_token_ids": output.token_ids, "completion_logprobs": output.logprobs}
        choices.append(choice)
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    body = {
        "id": completion_id(), "object": "chat.completion", "created": int(time.time()), "model": request.model,
        "choices": choices,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(prompt_ids) + completion_tokens},
    }
    if request.return_token_ids:
        body["grooves"] = {"prompt_token_ids": prompt_ids, "adapter_step": adapter_step}
    return body


def chunk_body(request: ChatCompletionRequest, chunk_id: str, created: int, index: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None) -> dict[str, Any]:
    return {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": request.model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}
