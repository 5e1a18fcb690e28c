"""The server's edge: the API key, the body size limit, one log line per request, and every
error (unknown routes and unreadable bodies included) in OpenAI's JSON shape.

The request log line carries the route, model, token counts, status and latency; never the
prompt, the reply or the key. Handlers add the model and token counts to
``request.state.record``.
"""

from __future__ import annotations

import hmac
import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from grooves.serve.protocol import ApiError
from grooves.serve.server import Server

log = logging.getLogger("grooves.serve")

_VLLM_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_OPEN_PATHS = ("/health",)  # the only route without the key: load balancers probe it
_TYPE_TAG = re.compile(r"[\[\-]|^(str|int|float|bool|dict|list|none)$")  # pydantic's union branch names


class Edge:
    """ASGI middleware in front of the app: key, size limit, request log."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), [500]
        record: dict = {}
        scope.setdefault("state", {})["record"] = record

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await JSONResponse(refusal.body(), refusal.status, refusal.headers)(scope, receive, send_status)
            else:
                await self.app(scope, self._limited(receive), send_status)
        finally:
            fields = " ".join(f"{k}={v}" for k, v in record.items())
            log.info("%s %s %s%sstatus=%d %.0fms", scope["method"], scope["path"], fields, " " if fields else "",
                     status[0], 1000 * (time.monotonic() - started))

    def _refusal(self, scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.server.api_key and scope["path"] not in _OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                     self.server.api_key.encode()):
                return ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                code="invalid_api_key")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.server.max_body_bytes:
            return _too_large(self.server.max_body_bytes)
        return None

    def _limited(self, receive):
        """``receive`` that stops a body without a Content-Length once it passes the limit."""
        seen = [0]

        async def limited():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.server.max_body_bytes:
                    raise HTTPException(413, _too_large(self.server.max_body_bytes).message)
            return message

        return limited


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of {limit} bytes",
                    code="request_too_large")


def install_edge(app: FastAPI, server: Server) -> None:
    app.add_middleware(Edge, server=server)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return JSONResponse(ApiError(400, f"the body is not valid JSON: {first['msg']}").body(), 400)
        param = param_path(first.get("loc", ()))
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        if request.url.path in _VLLM_ROUTES:  # vLLM's shape there: its type name, the status as the code
            return JSONResponse(ApiError(400, message, "BadRequestError", code=400, param=param).body(), 400)
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:
        message = {404: f"unknown route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(error.status_code, error.detail)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(error.status_code)
        return JSONResponse(ApiError(error.status_code, str(message), code=code).body(),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(ApiError(500, "internal server error", "server_error").body(), status_code=500)


def param_path(loc) -> str | None:
    """A pydantic error location as OpenAI's ``param``: ``("body", "tools", 0, "type")`` -> ``tools[0].type``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.search(str(part)):
            out += f".{part}" if out else str(part)
    return out or None
