"""``grooves serve``: an OpenAI-compatible HTTP server over one base model and many adapters.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions`` (streaming
with SSE), ``POST /v1/completions`` (legacy), ``POST /v1/adapters``,
``DELETE /v1/adapters/{name}``, vLLM's ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (``lora.py``), ``GET /health``. The edge (``edge.py``) checks
the key and the body size, logs one line per request and answers every error in OpenAI's JSON
shape; streaming is in ``streaming.py``, the legacy API in ``legacy.py``.

Every reply names the weights that answered (``system_fingerprint`` and the
``X-Grooves-Checkpoint`` header: ``RUN@STEP`` for a checkpoint, ``RUN@latest`` included, a
runtime LoRA's name, or the base spec); the name is resolved once, when the request arrives,
and that checkpoint serves it. A client that goes away stops its generation.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from grooves.serve.adapters import AdapterRegistry, UnknownModel
from grooves.serve.edge import install_edge
from grooves.serve.engine import Engine, EngineStopped, Failed, Finished, GenerationRequest
from grooves.serve.grammar import GrammarError
from grooves.serve.legacy import completions
from grooves.serve.lora import install_lora_routes, model_card
from grooves.serve.protocol import AdapterRequest, ApiError, ChatCompletionRequest, CompletionRequest
from grooves.serve.responses import completion_body
from grooves.serve.server import (
    CLIENT_GONE, MAX_BODY_BYTES, Server, as_api_error, event_queue, next_event, stopped_error, served_headers, submit,
    watch_client,
)
from grooves.serve.streaming import CancellingStream, chat_stream
from grooves.serve.tokens import prompt_logprobs, scored_prompt

__all__ = ["Server", "ServerThread", "bind", "build_server", "create_app", "serve_forever"]

log = logging.getLogger("grooves.serve")


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="grooves", docs_url=None, redoc_url=None)
    app.state.server = server
    install_edge(app, server)
    _install_routes(app, server)
    install_lora_routes(app, server)
    return app


def _install_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health():
        running = server.engine.running
        body = {"status": "ok" if running else "engine stopped", "engine": "running" if running else "stopped",
                "queued": server.engine.queue.qsize(), "batches": server.engine.batches,
                "adapters_loaded": len(server.registry.loaded()),
                "generated_tokens": server.engine.generated_tokens,
                "cancelled_requests": server.engine.cancelled_requests}
        return JSONResponse(body, status_code=200 if running else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        ids = await run_in_threadpool(server.registry.model_ids)
        return {"object": "list", "data": [model_card(server, i) for i in ids]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        await run_in_threadpool(server.resolve, model_id)
        return model_card(server, model_id)

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
        except EngineStopped:
            raise stopped_error() from None
        except ValueError as error:
            raise ApiError(400, str(error)) from None
        return {"id": name, "object": "model", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _chat(server, body, request)

    @app.post("/v1/completions")
    async def legacy_completions(body: CompletionRequest, request: Request):
        return await completions(server, body, request)


async def _chat(server: Server, body: ChatCompletionRequest, request: Request) -> Response:
    """One chat completion: streamed, or whole once done; nothing more is made for a client that left."""
    record = request.state.record
    generation, events = await _prepare(server, body)
    record.update(model=body.model, prompt_tokens=len(generation.prompt_ids))
    submit(server, generation)
    served = generation.resolved.served
    headers = served_headers(served)
    if body.stream:
        stream = chat_stream(server, body, generation.prompt_ids, events, record, served)
        return CancellingStream(stream, generation.cancelled, media_type="text/event-stream", headers=headers)
    async with watch_client(request.receive, generation.cancelled) as gone:
        event = None
        while not isinstance(event, Finished):
            event = await next_event(server, events, gone)
            if event is None:
                return Response(status_code=CLIENT_GONE)
            if isinstance(event, Failed):
                raise as_api_error(event.error)
    record["completion_tokens"] = sum(len(o.token_ids) for o in event.outputs)
    scored = None
    if body.wants_prompt_logprobs:
        ids = generation.prompt_ids
        scored = prompt_logprobs(server.policy.tokenizer, ids,
                                 await scored_prompt(server, generation.resolved, ids, body.prompt_logprobs))
    if server.capture is not None:  # opt-in (--capture): the request's text goes to the capture store only
        await run_in_threadpool(_capture, server, body, generation.prompt_ids, event.outputs, served)
    return JSONResponse(completion_body(body, server.policy, generation.prompt_ids, event.outputs,
                                        event.adapter_step, served, scored), headers=headers)


def _capture(server: Server, body: ChatCompletionRequest, prompt_ids: list[int], outputs, served: str) -> None:
    """Record a served completion; a capture that fails is logged and never costs the reply."""
    try:
        server.capture.record(body.model, served, body.message_dicts, body.tool_schemas, prompt_ids,
                              [{"text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason}
                               for o in outputs])
    except Exception as error:  # noqa: BLE001 - a full disk must not fail the user's request
        log.error("capture failed: %s", type(error).__name__)


async def _prepare(server: Server, body: ChatCompletionRequest) -> tuple[GenerationRequest, asyncio.Queue]:
    """Validate and tokenise a request; build its generation request and its event queue."""
    body.check_supported()
    resolved = server.resolve(body.model)
    server.check_text(sum(len(m.content or "") for m in body.messages))
    prompt_ids = await run_in_threadpool(server.policy.chat_ids, body.message_dicts, body.tool_schemas)
    room = server.context_length - len(prompt_ids)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, min(server.default_max_tokens, room))
    server.check_room(len(prompt_ids), max_tokens)
    constraint = await run_in_threadpool(_constraint, server, body)
    events, put = event_queue()
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
    generation = GenerationRequest(
        model=body.model, prompt_ids=prompt_ids, deliver=put, n=body.n, temperature=body.temperature,
        top_p=body.top_p, max_tokens=max_tokens, stop=body.stop_list, seed=body.seed, top_logprobs=top_logprobs,
        constraint=constraint, stream=body.stream, ignore_eos=body.ignore_eos, resolved=resolved)
    return generation, events


def _constraint(server: Server, body: ChatCompletionRequest):
    """A factory of per-sample grammar constraints for forced tool calls and JSON formats, or None."""
    choice, fmt = body.tool_choice, body.response_format or {}
    tools = body.tool_schemas
    if tools and (choice == "required" or isinstance(choice, dict)):
        name = body.forced_tool
        _compiled(server, "tool_choice", lambda: server.grammars.tool_call(tools, name))
        return lambda: server.grammars.tool_call(tools, name)
    if fmt.get("type") == "json_object":
        _compiled(server, "response_format", server.grammars.json_object)
        return server.grammars.json_object
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        _compiled(server, "response_format", lambda: server.grammars.for_schema(schema))
        return lambda: server.grammars.for_schema(schema)
    if fmt and fmt.get("type") != "text":
        raise ApiError(400, "response_format.type must be text, json_object or json_schema", param="response_format")
    return None


def _compiled(server: Server, param: str, make) -> None:
    """Compile (and so validate) a grammar now, on the request's thread, not in the worker."""
    try:
        make()
    except GrammarError as error:
        raise ApiError(400, str(error), param=param) from None


# --- running it -------------------------------------------------------------------------


def build_server(model: str, runs=None, api_key: str | None = None, aliases: dict[str, str] | None = None,
                 device: str = "cpu", max_batch_rows: int = 32, max_queue: int = 64, max_loaded: int = 8,
                 batch_window_s: float = 0.005, max_body_bytes: int = MAX_BODY_BYTES,
                 lora_roots: list | None = None, capture=None) -> Server:
    """``lora_roots``: the folders ``load_lora_adapter`` may load from (default: the runs root);
    ``capture``: a ``CaptureStore`` that records every non-streamed chat completion (opt-in)."""
    from grooves.policy import Policy

    policy = Policy.load(model, device=device)
    registry = AdapterRegistry(policy, runs, aliases, max_loaded=max_loaded, lora_roots=lora_roots)
    engine = Engine(policy, registry, max_batch_rows=max_batch_rows, max_queue=max_queue,
                    batch_window_s=batch_window_s).start()
    return Server(policy, registry, engine, api_key=api_key, max_body_bytes=max_body_bytes, capture=capture)


GRACE_S = 5  # on shutdown, open connections get this long before they are closed


class _Uvicorn(uvicorn.Server):
    """uvicorn that halts the engine as soon as shutdown begins: requests waiting on it get their
    503 at once and close, instead of holding the shutdown for as long as generation takes."""

    def __init__(self, config: uvicorn.Config, engine: Engine | None):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None) -> None:
        if self.engine is not None:
            self.engine.halt()
        await super().shutdown(sockets)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound now: a busy port fails here (OSError), before anything is served."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no conflict
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_forever(server: Server, sock: socket.socket) -> None:
    """Serve on a bound socket until SIGINT or SIGTERM; the engine stops with the server."""
    config = uvicorn.Config(create_app(server), log_level="warning", timeout_graceful_shutdown=GRACE_S)
    try:
        _Uvicorn(config, server.engine).run(sockets=[sock])
    finally:
        server.engine.halt()


class ServerThread:
    """Runs an app with uvicorn on a background thread (tests, in-process rollouts)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_S)
        self.server = _Uvicorn(config, engine=None)
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
