"""What the HTTP layer shares: the server's parts, handing work to the engine, waiting for it,
and noticing a client that has gone so its generation stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from urllib.parse import quote

from grooves.serve.adapters import AdapterRegistry, UnknownModel
from grooves.serve.engine import Cancelled, Engine, EngineStopped, Event, GenerationRequest, QueueFull
from grooves.serve.grammar import Grammars
from grooves.serve.protocol import ApiError

log = logging.getLogger("grooves.serve")

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt that fits a small model's context
SERVED_HEADER = "X-Grooves-Checkpoint"  # which weights answered: RUN@STEP, a runtime LoRA's name or the base
CLIENT_GONE = 499  # nginx's "client closed request": the log line's status when nobody was left to answer


@dataclass
class Server:
    policy: Any
    registry: AdapterRegistry
    engine: Engine
    api_key: str | None = None
    default_max_tokens: int = 256
    max_body_bytes: int = MAX_BODY_BYTES
    capture: Any = None  # a CaptureStore (serve --capture): completions recorded for grooves learn
    _grammars: Grammars | None = field(default=None, repr=False)

    @property
    def context_length(self) -> int:
        return int(getattr(self.policy.causal_lm.config, "max_position_embeddings", 2048))

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(self.policy.tokenizer, self.policy.causal_lm.config.vocab_size)
        return self._grammars

    def resolve(self, model: str):
        try:
            return self.registry.resolve(model)
        except UnknownModel as error:
            raise ApiError(404, str(error), code="model_not_found", param="model") from None

    @cached_property
    def longest_token(self) -> int:
        """Characters in the vocabulary's longest token: a text of C characters has at least C / this many."""
        tokenizer = self.policy.tokenizer
        return max(len(piece or "") for piece in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))

    def check_text(self, chars: int, param: str = "messages") -> None:
        """Refuse a prompt whose text alone cannot fit the context, before paying to tokenise it."""
        at_least = chars // max(self.longest_token, 1)
        if at_least > self.context_length:
            raise ApiError(400, f"the prompt has at least {at_least} tokens ({chars} characters): more than the "
                                f"model's {self.context_length}-token context", code="context_length_exceeded",
                           param=param)

    def check_room(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.context_length:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}: more "
                                f"than the model's {self.context_length}-token context",
                           code="context_length_exceeded", param="max_tokens")


def event_queue() -> tuple[asyncio.Queue, Any]:
    """A queue for the engine's events and the thread-safe callback that fills it."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    return events, lambda event: loop.call_soon_threadsafe(events.put_nowait, event)


def submit(server: Server, generation: GenerationRequest) -> None:
    try:
        server.engine.submit(generation)
    except QueueFull:
        raise ApiError(429, "the server is busy; retry shortly", "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": "1"}) from None
    except EngineStopped:
        raise stopped_error() from None


async def next_event(server: Server, events: asyncio.Queue, gone: list[bool] | None = None) -> Event | None:
    """The engine's next event for a request; a stopped engine ends the wait instead of hanging it,
    and so does a client that has gone (``gone`` from ``watch_client``): then None."""
    while True:
        try:
            return await asyncio.wait_for(events.get(), timeout=1.0 if gone is None else 0.1)
        except asyncio.TimeoutError:
            if gone is not None and gone[0]:
                return None
            if not server.engine.running and events.empty():
                raise stopped_error() from None


def stopped_error() -> ApiError:
    return ApiError(503, "the server's engine is not running (shutting down)", "server_error",
                    code="engine_stopped")


def served_headers(served: str) -> dict[str, str]:
    """The header naming the weights that answered; a runtime LoRA's name is the caller's text, so
    anything but plain printable ASCII is percent-encoded (no header injection, no encoding error)."""
    return {SERVED_HEADER: quote(served, safe="@:/._-+~=")}


@contextlib.asynccontextmanager
async def watch_client(receive, cancelled: threading.Event):
    """While the body runs, a client that disconnects sets ``cancelled`` (the engine then drops its
    rows); on the way out it is set anyway, since no one waits for more tokens. Yields a list that
    holds True once the client is known to be gone."""
    gone = [False]

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone[0] = True
        cancelled.set()

    task = asyncio.create_task(watch())
    try:
        yield gone
    finally:
        task.cancel()
        cancelled.set()


def as_api_error(error: Exception) -> ApiError:
    """An engine failure as the client sees it: 4xx for its own mistakes, 500 (logged) for ours."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, UnknownModel):
        return ApiError(404, str(error), code="model_not_found", param="model")
    if isinstance(error, EngineStopped):
        return stopped_error()
    if isinstance(error, Cancelled):
        return ApiError(CLIENT_GONE, "the client went away", code="client_closed_request")
    log.error("generation failed", exc_info=error)
    return ApiError(500, "generation failed (the server log has the details)", "server_error")
