"""The dashboard's HTTP side: a JSON API over the runs root and the static page that reads it.

Routes: ``GET /`` (the page), ``GET /static/...``, ``GET /api/runs``, ``GET /api/runs/{run}``,
``GET /api/runs/{run}/review``, ``POST /api/runs/{run}/labels``,
``GET /api/runs/{run}/samples/{id}``, ``POST /api/runs/{run}/compare``, ``GET /api/evals``,
``GET /api/evals/{name}/chart``.

It binds to 127.0.0.1 by default, and then answers only requests whose ``Host`` is a loopback
name, so a web page elsewhere cannot read runs through DNS rebinding; labels are accepted only
as JSON, which a cross-site form cannot send.
"""

from __future__ import annotations

import functools
import threading
from importlib import resources
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from grooves.dashboard import compare as comparing
from grooves.dashboard import runs as reading
from grooves.training.review import ReviewError

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


class LabelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: int = Field(description="The sample's trajectory id (as grooves review shows it).")
    label: Literal["hack", "good", "bad"] = Field(description="The verdict.")
    note: str = Field("", max_length=2000, description="Why, in a few words.")


class CompareRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    a: str = Field(description="'base', a step of this run, or RUN@STEP.")
    b: str = Field(description="'base', a step of this run, or RUN@STEP.")


def create_app(root: Path, *, evals: Path | None = None, check_host: bool = True) -> FastAPI:
    """The app over the runs ``root``; ``evals`` is where ``grooves eval`` wrote its folders."""
    root = Path(root)
    evals = Path(evals) if evals is not None else Path("evals")
    app = FastAPI(title="grooves dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    static = resources.files("grooves.dashboard").joinpath("static")
    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    compare_lock = threading.Lock()  # one comparison at a time: each loads models

    if check_host:
        @app.middleware("http")
        async def loopback_only(request: Request, call_next):
            host = hostname(request.headers.get("host", ""))
            if host not in LOOPBACK:
                return JSONResponse({"error": f"host {host!r} is not served; open http://127.0.0.1"},
                                    status_code=403)
            return await call_next(request)

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

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return static.joinpath("index.html").read_text()

    @app.get("/api/runs")
    def runs() -> dict:
        return {"root": str(root), "runs": reading.list_runs(root)}

    @app.get("/api/runs/{run}")
    def run(run: str) -> dict:
        return reading.run_detail(root, run)

    @app.get("/api/runs/{run}/review")
    def review(run: str, step: int | None = None, split: Literal["train", "val"] = "train", k: int = 3,
               seed: int = 0) -> dict:
        if not 1 <= k <= 50:
            raise ReviewError("k must be between 1 and 50")
        return reading.step_review(root, run, step, split, k, seed)

    @app.post("/api/runs/{run}/labels")
    def label(run: str, body: LabelRequest) -> dict:
        return reading.label_sample(root, run, body.id, body.label, body.note)

    @app.get("/api/runs/{run}/samples/{ident}")
    def sample(run: str, ident: int) -> dict:
        return reading.transcript(root, run, ident, _tokenizer(reading.run_base_spec(root, run)))

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

    app.state.root = root
    return app


def hostname(header: str) -> str:
    """The host part of a ``Host`` header: ``127.0.0.1:8765`` -> ``127.0.0.1``, ``[::1]:80`` -> ``[::1]``."""
    if header.startswith("["):
        return header.split("]", 1)[0] + "]"
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


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


def serve(root: Path, host: str = "127.0.0.1", port: int = 8765, evals: Path | None = None) -> None:
    """Serve until Ctrl-C."""
    import uvicorn

    uvicorn.run(create_app(root, evals=evals, check_host=host in LOOPBACK), host=host, port=port,
                log_level="warning")
