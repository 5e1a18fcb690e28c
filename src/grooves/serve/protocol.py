"""The OpenAI request shapes the server accepts, their checks, and grooves' extensions.

Every field is checked here, at the edge, so nothing out of range reaches the engine: a
``seed`` outside the 64-bit range, a NaN temperature or a malformed ``tools`` list is a 400
that names the field (``param``). Parameters grooves cannot honour are refused (400), never
silently ignored: ``logit_bias``, ``frequency_penalty``/``presence_penalty``, the legacy
``functions``, audio and predicted outputs; ``parallel_tool_calls: false`` is honoured
(at most one call is returned). Extra fields that change nothing about the output
(``user``, ``metadata``, ``store``, ...) are accepted, as many clients send them.

Extensions (``extra_body`` in the openai client), with vLLM's names where vLLM has them:
``"return_token_ids": true`` adds vLLM's ``prompt_token_ids`` (top level; per choice on
``/v1/completions``) and ``token_ids`` (per choice, per chunk when streamed), and grooves'
own ``grooves`` block (``prompt_token_ids``, ``adapter_step``; per choice
``completion_token_ids``, ``completion_logprobs``): the exact ids the model saw and produced,
so a trajectory is rebuilt without re-tokenising. ``"prompt_logprobs": k`` adds vLLM's
``prompt_logprobs`` (not when streamed). ``"ignore_eos": true`` makes every sample exactly
``max_tokens`` long (for benchmarks). docs/serve.md has the table.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs
SEED_RANGE = {"ge": -(2**63), "le": 2**63 - 1}  # what torch's generators take (plus the sample index)
_TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", code="unsupported_parameter", param=param)


class _Lenient(BaseModel):
    # Unknown fields are kept, not rejected: clients send extras; NaN and infinities are not numbers.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class FunctionSpec(_Lenient):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _text(cls, content: Any) -> str | None:
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            return "".join(p["text"] for p in content)
        raise ValueError("must be a string or a list of text parts")

    def as_dict(self) -> dict[str, Any]:
        out = self.model_dump(exclude_unset=True)
        out["content"] = self.content
        out["role"] = "system" if self.role == "developer" else self.role
        return out


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """What chat and legacy completions share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, **SEED_RANGE)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's name: always generate max_tokens (for benchmarks)
    return_token_ids: bool = False  # vLLM's name: the prompt's and each sample's token ids in the reply
    prompt_logprobs: int | None = None  # vLLM's name: each prompt token's logprob and the top k there

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Refuse what cannot be honoured (a 400 naming the parameter)."""
        if self.frequency_penalty or self.presence_penalty:
            param = "frequency_penalty" if self.frequency_penalty else "presence_penalty"
            raise unsupported(param, "not supported by grooves serve (use 0)")
        if self.logit_bias:
            raise unsupported("logit_bias", "not supported by grooves serve")
        if len(self.stop_list) > 4:
            raise ApiError(400, "stop: at most 4 strings", param="stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options")
        self._check_prompt_logprobs()

    def _check_prompt_logprobs(self) -> None:
        """vLLM's checks and messages; grooves also refuses -1 (the whole vocabulary) and more than 20."""
        k = self.prompt_logprobs
        if k is None:
            return
        if self.stream and (k > 0 or k == -1):
            raise ApiError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        if k < 0 and k != -1:
            raise ApiError(400, "`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
        if k == -1 or k > MAX_PROMPT_LOGPROBS:
            raise ApiError(400, f"prompt_logprobs: at most {MAX_PROMPT_LOGPROBS} per token on grooves serve "
                                "(-1, the whole vocabulary, is not supported)", param="prompt_logprobs")

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and not self.stream


# Fields of OpenAI's chat API that change the output and that grooves does not implement.
_REFUSED_CHAT = ("functions", "function_call", "audio", "prediction", "web_search_options")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None

    @property
    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def wants_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> str | None:
        """The function a ``tool_choice`` object names, else None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def check_supported(self) -> None:
        super().check_supported()
        for name in _REFUSED_CHAT:
            if (self.model_extra or {}).get(name) is not None:
                raise unsupported(name, "not supported by grooves serve" +
                                  (" (use tools)" if name.startswith("function") else ""))
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        self._check_tool_choice()

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function")
            if choice.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise ApiError(400, "tool_choice: use {'type': 'function', 'function': {'name': ...}}",
                               param="tool_choice")
            if function["name"] not in {t.function.name for t in self.tools or []}:
                raise ApiError(400, f"tool_choice: {function['name']!r} is not among the request's tools",
                               param="tool_choice")
        elif choice == "required" and not self.tools:
            raise ApiError(400, "tool_choice: 'required' needs tools", param="tool_choice")


class CompletionRequest(SamplingFields):
    """The legacy ``POST /v1/completions``: a raw text prompt, no chat template."""

    prompt: str | list[str] | list[int]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts, each a text or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def check_supported(self) -> None:
        super().check_supported()
        if not self.prompt or any(p == [] for p in self.prompts):
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if self.suffix:
            raise unsupported("suffix", "not supported by grooves serve")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "not supported by grooves serve (use n)")
        if self.stream and (self.echo or self.logprobs is not None):
            param = "echo" if self.echo else "logprobs"
            raise unsupported(param, "not supported with stream: true on /v1/completions")


class LoadLoRARequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body; other fields vLLM takes (``is_3d_lora_weight``) are ignored."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRARequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (vLLM's ``lora_int_id`` is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None


class AdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Alias to serve the checkpoint under.")
    checkpoint: str = Field(description="RUN@STEP or RUN@latest under the server's runs root.")
