"""``grooves serve``: an OpenAI-compatible HTTP server over one base model and many adapters.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (streaming with SSE),
``POST /v1/adapters``, ``DELETE /v1/adapters/{name}``, ``GET /health``. Errors use OpenAI's
JSON shape with 4xx codes for bad requests; unexpected failures answer 500 with a short
message (the traceback goes to the server log, never to the client).

Streaming sends text as tokens arrive, holding back what could still become a stop string
or an incomplete UTF-8 character. When the request offers tools, the reply is sent whole
at the end (it is only known to be a tool call once it is complete).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from grooves.serve.adapters import AdapterRegistry, UnknownModel
from grooves.serve.engine import Engine, Failed, Finished, GenerationRequest, QueueFull, TokenEvent
from grooves.serve.grammar import GrammarError, Grammars
from grooves.serve.protocol import (
    AdapterRequest, ApiError, ChatCompletionRequest, choice_message, chunk_body, completion_body, completion_id,
    logprobs_block,
)

log = logging.getLogger("grooves.serve")


@dataclass
class Server:
    policy: Any
    registry: AdapterRegistry
    engine: Engine
    api_key: str | None = None
    default_max_tokens: int = 256
    _grammars: Grammars | None = field(default=None, repr=False)

    @property
    def context_length(self) -> int:
        return int(getattr(self.policy.causal_lm.config, "max_position_embeddings", 2048))

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.policy.tokenizer, self.policy.causal_lm.config.vocab_size)
        return self._grammars


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="grooves", docs_url=None, redoc_url=None)
    app.state.server = server
    _install_errors_and_auth(app, server)
    _install_routes(app, server)
    return app


def _install_errors_and_auth(app: FastAPI, server: Server) -> None:
    """OpenAI-shaped errors for every failure, and the optional bearer token on /v1 routes."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(ApiError(500, "internal server error", "server_error").body(), status_code=500)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            supplied = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(supplied.encode(), server.api_key.encode()):
                error = ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                 code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)


def _install_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "queued": server.engine.queue.qsize(), "batches": server.engine.batches,
                "adapters_loaded": len(server.registry.loaded())}

    @app.get("/v1/models")
    async def models() -> dict:
        ids = await run_in_threadpool(server.registry.model_ids)
        return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "grooves"}
                                           for i in ids]}

    @app.post("/v1/adapters")
    async def add_adapter(body: AdapterRequest) -> dict:
        try:
            resolved = server.registry.add_alias(body.name, body.checkpoint)
        except UnknownModel as error:
            raise ApiError(404, str(error), code="model_not_found", param="checkpoint") from None
        except ValueError as error:
            raise ApiError(400, str(error), param="name") from None
        return {"id": body.name, "object": "model", "checkpoint": body.checkpoint, "step": resolved.step}

    @app.delete("/v1/adapters/{name}")
    async def remove_adapter(name: str) -> dict:
        try:
            await asyncio.wrap_future(server.engine.control(lambda: server.registry.remove(name)))
        except UnknownModel as error:
            raise ApiError(404, str(error), code="model_not_found") from None
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        return {"id": name, "object": "model", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        generation, events = await _prepare(server, body)
        try:
            server.engine.submit(generation)
        except QueueFull:
            raise ApiError(429, "the server is busy; retry shortly", "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        if body.stream:
            return StreamingResponse(_stream(server, body, generation.prompt_ids, events),
                                     media_type="text/event-stream")
        while True:
            event = await events.get()
            if isinstance(event, Finished):
                return completion_body(body, server.policy, generation.prompt_ids, event.outputs, event.adapter_step)
            if isinstance(event, Failed):
                raise _as_api_error(event.error)


async def _prepare(server: Server, body: ChatCompletionRequest) -> tuple[GenerationRequest, asyncio.Queue]:
    """Validate and tokenise a request; build its generation request and its event queue."""
    try:
        server.registry.resolve(body.model)
    except UnknownModel as error:
        raise ApiError(404, str(error), code="model_not_found", param="model") from None
    prompt_ids = await run_in_threadpool(server.policy.chat_ids, body.messages, body.tools)
    room = server.context_length - len(prompt_ids)
    max_tokens = body.max_completion_tokens or body.max_tokens or min(server.default_max_tokens, room)
    if max_tokens > room:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: more than "
                            f"the model's {server.context_length}-token context", code="context_length_exceeded",
                       param="max_tokens")
    constraint = await run_in_threadpool(_constraint, server, body)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    generation = GenerationRequest(
        model=body.model, prompt_ids=prompt_ids, deliver=lambda e: loop.call_soon_threadsafe(events.put_nowait, e),
        n=body.n, temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, stop=body.stop_list,
        seed=body.seed, top_logprobs=body.top_logprobs or 0, constraint=constraint, stream=body.stream,
        ignore_eos=body.ignore_eos)
    return generation, events


def _constraint(server: Server, body: ChatCompletionRequest):
    """A factory of per-sample grammar constraints for forced tool calls and JSON formats, or None."""
    try:
        choice, fmt = body.tool_choice, body.response_format or {}
        if body.tools and (choice == "required" or isinstance(choice, dict)):
            name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
            server.grammars.tool_call(body.tools, name)  # compile (and validate) now, not in the worker
            return lambda: server.grammars.tool_call(body.tools, name)
        if fmt.get("type") == "json_object":
            server.grammars.json_object()
            return server.grammars.json_object
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                               param="response_format")
            server.grammars.for_schema(schema)
            return lambda: server.grammars.for_schema(schema)
        if fmt and fmt.get("type") != "text":
            raise ApiError(400, "response_format.type must be text, json_object or json_schema",
                           param="response_format")
    except GrammarError as error:
        raise ApiError(400, str(error), param="response_format") from None
    return None


def _as_api_error(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, UnknownModel):
        return ApiError(404, str(error), code="model_not_found", param="model")
    if isinstance(error, ValueError):
        return ApiError(400, str(error))
    log.error("generation failed", exc_info=error)
    return ApiError(500, "generation failed", "server_error")


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


async def _stream(server: Server, body: ChatCompletionRequest, prompt_ids: list[int],
                  events: asyncio.Queue) -> AsyncIterator[str]:
    chunk_id, created = completion_id(), int(time.time())
    texts = [TextStream(server.policy, body.stop_list) for _ in range(body.n)]

    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    for index in range(body.n):
        yield sse(chunk_body(body, chunk_id, created, index, {"role": "assistant", "content": ""}))
    while True:
        event = await events.get()
        if isinstance(event, TokenEvent):
            if body.wants_tools:
                continue  # sent whole at the end
            delta = texts[event.index].push(event.token)
            logprobs = None
            if body.logprobs:
                text = server.policy.tokenizer.decode([event.token])
                logprobs = {"content": [{"token": text, "logprob": event.logprob, "bytes": list(text.encode()),
                                         "top_logprobs": []}]}
            if delta or logprobs:
                yield sse(chunk_body(body, chunk_id, created, event.index, {"content": delta}, logprobs=logprobs))
        elif isinstance(event, Finished):
            for index, output in enumerate(event.outputs):
                message, finish = choice_message(body, output.text, output.finish_reason)
                delta = dict(message) if body.wants_tools else {"content": texts[index].finish(output.text)}
                delta.pop("role", None)
                chunk = chunk_body(body, chunk_id, created, index, delta, finish_reason=finish)
                if body.return_token_ids:
                    chunk["choices"][0]["grooves"] = {"completion_token_ids": output.token_ids,
                                                      "completion_logprobs": output.logprobs}
                    chunk["grooves"] = {"prompt_token_ids": prompt_ids, "adapter_step": event.adapter_step}
                if body.logprobs and body.wants_tools:
                    chunk["choices"][0]["logprobs"] = logprobs_block(server.policy, output)
                yield sse(chunk)
            yield "data: [DONE]\n\n"
            return
        else:
            error = _as_api_error(event.error)
            yield sse(error.body())
            yield "data: [DONE]\n\n"
            return


# --- running it -------------------------------------------------------------------------


def build_server(model: str, runs=None, api_key: str | None = None, aliases: dict[str, str] | None = None,
                 device: str = "cpu", max_batch_rows: int = 32, max_queue: int = 64, max_loaded: int = 8,
                 batch_window_s: float = 0.005) -> Server:
    from grooves.policy import Policy

    policy = Policy.load(model, device=device)
    registry = AdapterRegistry(policy, runs, aliases, max_loaded=max_loaded)
    engine = Engine(policy, registry, max_batch_rows=max_batch_rows, max_queue=max_queue,
                    batch_window_s=batch_window_s).start()
    return Server(policy, registry, engine, api_key=api_key)


class ServerThread:
    """Runs an app with uvicorn on a background thread (tests, in-process rollouts)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="grooves-http", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    @property
    def base_url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
