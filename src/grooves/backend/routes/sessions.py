"""The handshake, sessions, telemetry, and the futures the SDK polls for every operation's result."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from tinker import types

from grooves.backend.routes.common import LONG_POLL_S, PROTO, backend_of, body, tenant_of

router = APIRouter(prefix="/api/v1")

# Flags the SDK reads at start; the ones that would need routes this service lacks are off.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False, "custom_loss_server_side": False,
}


@router.post("/client/config")
async def client_config():
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def client_dynamic_config():
    return {}


@router.get("/healthz")
async def healthz():
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(request: Request):
    backend = backend_of(request)
    return {"supported_models": [{"model_name": name, "max_context_length": backend.max_context,
                                  "trainable": True, "sampleable": True} for name in backend.names]}


@router.post("/create_session")
async def create_session(request: Request):
    await body(request, types.CreateSessionRequest)
    return {"type": "create_session", "session_id": backend_of(request).create_session(tenant_of(request))}


@router.post("/session_heartbeat")
async def heartbeat(request: Request):
    req = await body(request, types.SessionHeartbeatRequest)
    backend_of(request).check_session(tenant_of(request), req.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish(session_id: str, request: Request):
    backend_of(request).check_session(tenant_of(request), session_id)
    return None


@router.post("/telemetry")
async def telemetry():
    return {"status": "accepted"}


@router.post("/retrieve_future")
async def retrieve_future(request: Request):
    """Held open up to ``LONG_POLL_S``, then "try again"."""
    req = await body(request, types.FutureRetrieveRequest)
    future = backend_of(request).future(tenant_of(request), req.request_id)
    deadline = time.monotonic() + LONG_POLL_S
    while not future.done.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if not future.done.is_set():
        return {"type": "try_again", "request_id": future.request_id, "queue_state": "active"}
    if future.error is not None:
        return {"error": future.error[0], "category": future.error[1]}
    kind, payload = future.result
    return Response(payload, media_type=PROTO) if kind == "proto" else payload


@router.post("/cancel_future")
async def cancel_future():
    return None
