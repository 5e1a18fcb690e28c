"""The service's edge, in front of every route: the API key, the limits on a body (its size
whatever the transfer encoding, its JSON nesting depth), and one log line for every refusal
(4xx and 5xx, with the reason the client gets) and for a client that went away mid-request.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from grooves.backend import wire
from grooves.backend.queue import UserError

log = logging.getLogger("grooves.backend")

MAX_JSON_DEPTH = 32  # the SDK's deepest body (a sample request's prompt tokens) nests 5 levels
# a JSON string (skipped whole, so brackets inside it do not count) or a bracket
_STRUCTURE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_OPENERS = (ord("["), ord("{"))


def refuse(method: str, path: str, status: int, detail: str) -> JSONResponse:
    """The error the client gets, logged with its reason."""
    log.warning("%s %s -> %d: %s", method, path, status, detail)
    return JSONResponse({"detail": detail}, status_code=status)


class Edge:
    """ASGI middleware: who calls (``X-API-Key``), and bodies no larger than ``wire.MAX_BODY_BYTES``."""

    def __init__(self, app, tenants: dict):
        self.app, self.tenants = app, tenants

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        tenant = self.tenants.get(headers.get("x-api-key", ""))
        length = headers.get("content-length", "0").strip()
        if tenant is None:
            refusal = (401, "missing or unknown X-API-Key")
        elif not length.isdigit():
            refusal = (400, f"Content-Length {length[:40]!r} is not a number")
        elif int(length) > wire.MAX_BODY_BYTES:
            refusal = (413, f"body over {wire.MAX_BODY_BYTES} bytes")
        elif headers.get("content-encoding"):
            refusal = (415, "compressed bodies are not supported")
        else:
            scope.setdefault("state", {})["tenant"] = tenant.name
            await self.app(scope, _limited(receive), send)
            return
        await refuse(scope["method"], scope["path"], *refusal)(scope, receive, send)


def _limited(receive):
    """``receive`` that stops a body (chunked ones too) once it passes the limit: 413."""
    seen = 0

    async def limited():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > wire.MAX_BODY_BYTES:
                raise UserError(f"body over {wire.MAX_BODY_BYTES} bytes", 413)
        return message

    return limited


def parse_json(raw: bytes):
    """A body's JSON, nested at most ``MAX_JSON_DEPTH`` deep (deeper is refused before parsing)."""
    depth = 0
    for match in _STRUCTURE.finditer(raw):
        char = match.group()[0]
        if char in _OPENERS:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise UserError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
        elif char != ord('"'):
            depth -= 1
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise UserError("the body is not JSON") from None


def install_edge(app: FastAPI, tenants: dict) -> None:
    """The edge middleware and the handlers that turn every error into a logged ``{"detail": ...}``."""
    app.add_middleware(Edge, tenants=tenants)

    @app.exception_handler(UserError)
    async def refused(request: Request, exc: UserError):
        return refuse(request.method, request.url.path, exc.status, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return refuse(request.method, request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return refuse(request.method, request.url.path, 400, f"invalid request: {problems}")

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, exc: ClientDisconnect):
        log.info("%s %s: the client disconnected before its request was read", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it; uvicorn drops it

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        # one line here; uvicorn logs the traceback of a bug after the response
        log.error("%s %s -> 500: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)
