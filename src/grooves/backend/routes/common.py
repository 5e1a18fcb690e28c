"""What every route module needs: the service and the caller, checked bodies, futures, models."""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from grooves.backend.edge import parse_json
from grooves.backend.queue import Future, UserError
from grooves.backend.service import Backend, TrainingModel

LONG_POLL_S = 10.0
PROTO = "application/x-protobuf"
MAX_SEQ_ID = 999_999_999  # a model id is SESSION:train:N with N of at most 9 digits (storage.MODEL_ID)


def backend_of(request: Request) -> Backend:
    return request.app.state.backend


def tenant_of(request: Request) -> str:
    return request.state.tenant  # set by the edge from the API key


async def body(request: Request, model_type):
    """The JSON body validated with one of the ``tinker`` package's own request types."""
    data = parse_json(await request.body())
    try:
        return model_type.model_validate(data)
    except Exception as exc:  # pydantic's ValidationError: say which field
        raise UserError(f"invalid {model_type.__name__}: {exc}") from None


def new_model_id(session_id: str, model_seq_id: int) -> str:
    if not 0 <= model_seq_id <= MAX_SEQ_ID:
        raise UserError(f"model_seq_id must be 0..{MAX_SEQ_ID}, got {model_seq_id}")
    return f"{session_id}:train:{model_seq_id}"


def future_json(future: Future, model_id: str | None = None, samples: int = 0) -> dict:
    out = {"request_id": future.request_id, **({"model_id": model_id} if model_id else {})}
    if samples:  # the SDK stamps these on the returned sequences
        out["sample_sequence_ids"] = [f"{future.request_id}:{i}" for i in range(samples)]
    return out


async def model_of(request: Request, model_id: str) -> TrainingModel:
    """The caller's model; one an earlier run of the service made comes back from its saved state."""
    backend, tenant = backend_of(request), tenant_of(request)
    if backend.restorable(tenant, model_id):
        future = backend.submit(tenant, lambda: backend.restore(tenant, model_id))
        while not future.done.is_set():
            await asyncio.sleep(0.02)
        if future.error is not None:
            raise UserError(future.error[0], 410 if future.error[1] == "user" else 500)
    return backend.model(tenant, model_id)


async def created_model(request: Request, model_id: str) -> TrainingModel:
    """The model; a get_info right after create_model may arrive before the worker made it."""
    backend = backend_of(request)
    deadline = time.monotonic() + LONG_POLL_S
    while True:
        try:
            return await model_of(request, model_id)
        except UserError:
            if backend.creating.get(model_id) != tenant_of(request) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
