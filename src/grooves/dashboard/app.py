"""The dashboard's HTTP side: a JSON API over the runs root and the static page that reads it.

Routes: ``GET /`` (the page), ``GET /static/...``, ``GET /favicon.ico``, ``GET /api/runs``,
``GET /api/events`` (the runs list as server-sent events), ``GET /api/runs/{run}``,
``GET /api/runs/{run}/events`` (the run as server-sent events while it trains),
``GET /api/runs/{run}/review``, ``POST /api/runs/{run}/labels``,
``GET /api/runs/{run}/samples/{id}``, ``POST /api/runs/{run}/compare``, ``GET /api/evals``,
``GET /api/evals/{name}/chart``.
Every answer carries a Content-Security-Policy that lets only the package's own script run
and forbids framing (no clickjacking a label).

Every request passes ``RequestFilter`` first. Bound to loopback, the app answers only requests
whose ``Host`` is a loopback name, so a web page elsewhere cannot read runs through DNS rebinding.
A POST (a label, a comparison) must come from the dashboard's own page: a browser's
``Origin`` must be this server, the body must be JSON (``Content-Type: application/json``,
which a cross-site form or a no-preflight ``fetch`` cannot send) and at most ``MAX_BODY``
bytes. Bound to any other interface, every request also needs the token the command printed
(``/?token=...`` sets it as a cookie), since labels are writes.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import json
import socket
import threading
from http.cookies import SimpleCookie
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

import grooves.dashboard.compare as comparing
import grooves.dashboard.live as live
import grooves.dashboard.runs as reading
from grooves.workflows.review import ReviewError

MAX_BODY = 64 * 1024
"""Bytes a POST body may have: a label with its note is well under 3 KiB."""
MAX_ID = 2**63 - 1  # SQLite's largest integer: beyond it a lookup is an OverflowError, not "no such sample"
COOKIE = "grooves_dashboard_token"
HEADERS = [  # on every answer: only the package's own script runs, and no other site may frame the page
    (b"content-security-policy", b"default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                                 b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),  # a framed page could be clicked into labelling (clickjacking)
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class LabelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: int = Field(ge=0, le=MAX_ID, description="The sample's trajectory id (as grooves review shows it).")
    label: Literal["hack", "good", "bad"] = Field(description="The verdict.")
    note: str = Field("", max_length=2000, description="Why, in a few words.")


class CompareRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    a: str = Field(max_length=300, description="'base', a step of this run, or RUN@STEP.")
    b: str = Field(max_length=300, description="'base', a step of this run, or RUN@STEP.")


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (``127.0.0.2`` and ``[::1]`` included)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def hostname(header: str) -> str:
    """The host part of a ``Host`` header: ``127.0.0.1:8765`` -> ``127.0.0.1``, ``[::1]:80`` -> ``[::1]``."""
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class RequestFilter:
    """ASGI middleware that refuses, before any route runs: a non-loopback ``Host`` (when
    ``check_host``), a missing or wrong token (when ``token``), and a POST that is not the
    page's own JSON (a foreign ``Origin``, another content type, a body over ``MAX_BODY``)."""

    def __init__(self, app, check_host: bool, token: str | None):
        self.app, self.check_host, self.token = app, check_host, token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = _with_headers(send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.check_host and not is_loopback(hostname(host)):
            return await _answer(send, 403, f"host {hostname(host)!r} is not served; open http://127.0.0.1")
        if self.token is not None:
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [""])[0]
            if scope["path"] == "/" and given:
                if not hmac.compare_digest(given.encode(), self.token.encode()):
                    return await _answer(send, 401, "wrong token: open the address grooves dashboard printed")
                # The token moves into a cookie the page's requests carry, and out of the address bar.
                cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
                return await _answer(send, 303, "", [(b"location", b"/"), (b"set-cookie", cookie.encode())])
            cookies = SimpleCookie()
            try:
                cookies.load(headers.get("cookie", ""))
            except Exception:  # a malformed Cookie header is no token
                cookies = SimpleCookie()
            held = cookies[COOKIE].value if COOKIE in cookies else ""
            if not hmac.compare_digest(held.encode(), self.token.encode()):
                return await _answer(send, 401, "this dashboard needs its token: open the address grooves "
                                                "dashboard printed (http://HOST:PORT/?token=...)")
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            problem = _foreign(headers, host)
            if problem:
                return await _answer(send, 403 if "origin" in problem or "site" in problem else 415, problem)
            try:
                declared = int(headers.get("content-length", "0"))
            except ValueError:
                return await _answer(send, 400, "Content-Length is not a number")
            if declared > MAX_BODY:
                return await _answer(send, 413, f"the body is over {MAX_BODY} bytes")
            body = bytearray()
            while True:  # read it here (a chunked body has no Content-Length to trust) and hand it on
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > MAX_BODY:
                    return await _answer(send, 413, f"the body is over {MAX_BODY} bytes")
                if not message.get("more_body", False):
                    break
            receive = _replay(bytes(body), receive)
        return await self.app(scope, receive, send)


def _foreign(headers: dict[str, str], host: str) -> str | None:
    """Why a POST is not the page's own, or None. Browsers send ``Origin`` on every POST and
    ``Sec-Fetch-Site``; clients such as curl send neither and are let through."""
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
            return f"origin {origin!r} may not post here: use the dashboard's own page"
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return f"a {site} request may not post here: use the dashboard's own page"
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        declared = f"it was declared {kind!r}" if kind else "no Content-Type was declared"
        return f"the body must be JSON (Content-Type: application/json); {declared}"
    return None


def _with_headers(send):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *HEADERS]}
        await send(message)

    return sending


def _replay(body: bytes, receive):
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _answer(send, status: int, error: str, headers: list | None = None) -> None:
    body = json.dumps({"error": error}).encode() if error else b""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def create_app(root: Path, *, evals: Path | None = None, check_host: bool = True,
               token: str | None = None) -> FastAPI:
    """The app over the runs ``root``; ``evals`` is where ``grooves eval`` wrote its folders.
    ``check_host`` answers loopback ``Host`` names only; ``token`` is required of every request."""
    root = Path(root)
    evals = Path(evals) if evals is not None else Path("evals")
    app = FastAPI(title="grooves dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    static = resources.files("grooves.dashboard").joinpath("static")
    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    app.add_middleware(RequestFilter, check_host=check_host, token=token)

    _error_handlers(app)
    _run_routes(app, root, static)
    _eval_routes(app, root, evals)
    app.state.root = root
    return app


def _error_handlers(app: FastAPI) -> None:
    """Errors as ``{"error": ...}`` with their status; an unexpected one is a 500 with one line."""
    @app.exception_handler(reading.RunNotFound)
    async def not_found(_request, error):
        return JSONResponse({"error": str(error)}, status_code=404)

    @app.exception_handler(ReviewError)
    async def bad_review(_request, error):
        return JSONResponse({"error": str(error)}, status_code=400)

    @app.exception_handler(comparing.CompareError)
    async def bad_compare(_request, error):
        return JSONResponse({"error": str(error)}, status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(_request, error):  # the page shows a line; the traceback goes to the server's log
        return JSONResponse({"error": f"internal error ({type(error).__name__}: {error}); see the dashboard's log"},
                            status_code=500)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request, error):
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        return JSONResponse({"error": problems}, status_code=422)


def _run_routes(app: FastAPI, root: Path, static) -> None:
    """The page, the runs, a run's curves, live events, review, labels and transcripts."""
    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return static.joinpath("index.html").read_text()

    @app.get("/api/runs")
    def runs() -> dict:
        return {"root": str(root), "runs": reading.list_runs(root)}

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon():  # browsers ask for it even with the page's <link rel=icon>
        return FileResponse(str(static.joinpath("favicon.svg")), media_type="image/svg+xml")

    @app.get("/api/events")
    def runs_events(request: Request) -> StreamingResponse:
        return _events(live.runs_events(root, request.is_disconnected))

    @app.get("/api/runs/{run}")
    def run(run: str) -> dict:
        return live.detail(root, run)

    @app.get("/api/runs/{run}/events")
    def run_events(request: Request, run: str, since: Annotated[str | None, Query(max_length=400)] = None):
        reading.run_dir(root, run)  # an unknown run is a 404 here, not a stream that ends at once
        return _events(live.run_events(root, run, since, request.is_disconnected))

    @app.get("/api/runs/{run}/review")
    def review(run: str, step: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
               split: Literal["train", "val"] = "train", k: int = 3,
               seed: Annotated[int, Query(ge=0, le=2**32 - 1)] = 0) -> dict:
        if not 1 <= k <= 50:
            raise ReviewError("k must be between 1 and 50")
        return reading.step_review(root, run, step, split, k, seed)

    @app.post("/api/runs/{run}/labels")
    def label(run: str, body: LabelRequest) -> dict:
        return reading.label_sample(root, run, body.id, body.label, body.note)

    @app.get("/api/runs/{run}/samples/{ident}")
    def sample(run: str, ident: Annotated[int, PathParam(ge=0, le=MAX_ID)]) -> dict:
        return reading.transcript(root, run, ident, _tokenizer(reading.run_base_spec(root, run)))


def _eval_routes(app: FastAPI, root: Path, evals: Path) -> None:
    """``grooves eval`` results and checkpoint comparisons (one at a time: each loads models)."""
    compare_lock = threading.Lock()

    @app.get("/api/evals")
    def evaluations() -> dict:
        return {"root": str(evals), "evals": reading.list_evals(evals)}

    @app.get("/api/evals/{name}/chart")
    def eval_chart(name: str):
        return FileResponse(reading.eval_chart(evals, name), media_type="image/png")

    @app.post("/api/runs/{run}/compare")
    def compare(run: str, body: CompareRequest) -> dict:
        from grooves.policy.checkpoints import CheckpointError
        from grooves.policy.models import ModelSpecError

        with compare_lock:
            try:
                return comparing.compare(root, run, body.a, body.b)
            except (CheckpointError, ModelSpecError, FileNotFoundError) as error:
                raise comparing.CompareError(str(error)) from None


def _events(stream) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


@functools.lru_cache(maxsize=4)
def _tokenizer(spec: str | None):
    """The run's tokenizer, to show token spans as text; None (counts only) when it cannot load."""
    if spec is None:
        return None
    from grooves.policy.models import ModelSpecError, byte_tokenizer, bundled_folder

    try:
        if spec == "tiny" or spec.startswith("tiny:"):
            return byte_tokenizer()
        from transformers import AutoTokenizer

        folder = bundled_folder(spec) if spec == "bundled" or spec.startswith("bundled:") else Path(spec)
        return AutoTokenizer.from_pretrained(folder) if Path(folder).is_dir() else None
    except (ModelSpecError, OSError, ValueError):
        return None


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: any free port), so a busy port is an OSError here and
    the address printed is the one served."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait for TIME_WAIT
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def serve(root: Path, host: str = "127.0.0.1", port: int = 8765, evals: Path | None = None, *,
          token: str | None = None, sock: socket.socket | None = None) -> None:
    """Serve until Ctrl-C, on ``sock`` when given (see ``listen``), else on ``host:port``."""
    import uvicorn

    loopback = is_loopback(host)
    if not loopback and token is None:
        raise ValueError(f"serving on {host} (not loopback) needs a token: labels are writes")
    app = create_app(root, evals=evals, check_host=loopback, token=None if loopback else token)
    # Ctrl-C closes open event streams after a second instead of waiting for the pages to leave.
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    server.run(sockets=[sock] if sock is not None else None)
