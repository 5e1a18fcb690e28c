"""Sampling: sampling sessions and ``asample``, every field checked before the request is queued."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from tinker import types

from grooves.backend import wire
from grooves.backend.queue import Batchable
from grooves.backend.routes.common import backend_of, body, future_json, tenant_of
from grooves.backend.sampling import sample_job

router = APIRouter(prefix="/api/v1")
MAX_BATCH_ROWS = 64  # sampled rows decoded together at most (the sampler's batch)


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request):
    req = await body(request, types.CreateSamplingSessionRequest)
    backend, tenant = backend_of(request), tenant_of(request)
    backend.check_session(tenant, req.session_id)
    checkpoint = _checkpoint(request, req.model_path, req.base_model)
    return {"type": "create_sampling_session", "sampling_session_id": backend.create_sampler(tenant, checkpoint)}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    backend = backend_of(request)
    checkpoint = backend.sampler(tenant_of(request), sampler_id)
    return {"sampler_id": sampler_id, "base_model": backend.spec,
            "model_path": None if checkpoint is None else str(checkpoint.name)}


@router.post("/asample")
async def asample(request: Request):
    req = await body(request, types.SampleRequest)
    backend, tenant = backend_of(request), tenant_of(request)
    sampled = request.app.state.sampled  # (sampling session, seq_id) -> request id: a retry is the same
    key = None
    if req.sampling_session_id is not None:
        checkpoint = backend.sampler(tenant, req.sampling_session_id)
        if req.seq_id is not None:
            key = (req.sampling_session_id, req.seq_id)
            if key in sampled and sampled[key] in backend.futures:
                return future_json(backend.futures[sampled[key]], samples=req.num_samples)
    else:
        checkpoint = _checkpoint(request, req.model_path, req.base_model)
    job = sample_job(req, backend.vocab_size, backend.max_context)

    def run(futures, jobs):  # the requests for this checkpoint waiting now, decoded together
        return [("proto", wire.sample_response(*done)) for done in backend.sample(checkpoint, futures, jobs)]

    op = Batchable((checkpoint, job.stop_ids), job, job.n, MAX_BATCH_ROWS, run)
    future = backend.submit(tenant, op, metered=True)
    if key is not None:
        sampled[key] = future.request_id
    return future_json(future, samples=req.num_samples)


def _checkpoint(request: Request, model_path: str | None, base_model: str | None) -> Path | None:
    backend = backend_of(request)
    if model_path:
        return backend.resolve(tenant_of(request), model_path)
    backend.check_base(base_model or "")
    return None
