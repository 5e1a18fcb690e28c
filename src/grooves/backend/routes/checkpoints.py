"""Checkpoints: save and load state, sampler weights, and the REST calls that list and describe
training runs and checkpoints (``RestClient``'s). Answers are built with the SDK's own types."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from tinker import types

from grooves.backend.queue import UserError
from grooves.backend.routes.common import backend_of, body, future_json, model_of, new_model_id, tenant_of

router = APIRouter(prefix="/api/v1")

MAX_PAGE = 1000


@router.post("/save_weights")
async def save_weights(request: Request):
    req = await body(request, types.SaveWeightsRequest)
    backend = backend_of(request)
    model = await model_of(request, req.model_id)
    name = req.path or f"state-{int(time.time() * 1000)}"
    future = backend.submit_for(model, req.seq_id, lambda: ("json", {
        "path": backend.save(model, "weights", name, with_optimizer=True), "type": "save_weights"}))
    return future_json(future, req.model_id)


@router.post("/save_weights_for_sampler")
async def save_for_sampler(request: Request):
    req = await body(request, types.SaveWeightsForSamplerRequest)
    backend, tenant = backend_of(request), tenant_of(request)
    model = await model_of(request, req.model_id)

    def run():
        if req.path is not None:
            path = backend.save(model, "sampler_weights", req.path, with_optimizer=False)
            return "json", {"path": path, "type": "save_weights_for_sampler"}
        sampler = backend.create_sampler(tenant, backend.publish(model))
        return "json", {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}

    return future_json(backend.submit_for(model, req.seq_id, run), req.model_id)


@router.post("/load_weights")
async def load_weights(request: Request):
    req = await body(request, types.LoadWeightsRequest)
    backend, tenant = backend_of(request), tenant_of(request)
    folder = backend.resolve(tenant, req.path)
    if req.model_id is None:  # create-via-load: a new training client from a checkpoint
        if req.session_id is None or req.model_seq_id is None:
            raise UserError("load_weights needs model_id, or session_id and model_seq_id")
        model_id = new_model_id(req.session_id, req.model_seq_id)
        backend.check_session(tenant, req.session_id)
        backend.check_base(req.base_model or backend.spec)

        def create():
            model = backend.create_from(tenant, req.session_id, req.model_seq_id, folder)
            backend.load(model, folder, req.optimizer)
            return "json", {"path": req.path, "model_id": model.model_id, "type": "load_weights"}

        backend.creating[model_id] = tenant
        return future_json(backend.submit(tenant, create), model_id)
    model = await model_of(request, req.model_id)

    def run():
        backend.load(model, folder, req.optimizer)
        return "json", {"path": req.path, "model_id": model.model_id, "type": "load_weights"}

    return future_json(backend.submit_for(model, req.seq_id, run), req.model_id)


@router.get("/training_runs")
async def list_training_runs(request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned",
                             project_id: str | None = None):
    """The caller's models, newest first (``RestClient.list_training_runs``)."""
    if not 1 <= limit <= MAX_PAGE:
        raise UserError(f"limit must be 1..{MAX_PAGE}, got {limit}")
    if offset < 0:
        raise UserError(f"offset must be >= 0, got {offset}")
    _check_scope(access_scope)
    if project_id is not None:
        raise UserError("project_id: this service has no projects; list without it")
    backend, tenant = backend_of(request), tenant_of(request)
    ids = backend.training_runs(tenant)
    runs = [types.TrainingRun.model_validate(backend.training_run(tenant, run_id))
            for run_id in ids[offset:offset + limit]]
    cursor = types.Cursor(offset=offset, limit=limit, total_count=len(ids))
    return types.TrainingRunsResponse(training_runs=runs, cursor=cursor).model_dump(mode="json")


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, request: Request, access_scope: str = "owned"):
    """One of the caller's models (``RestClient.get_training_run``, ``get_training_run_by_tinker_path``)."""
    _check_scope(access_scope)
    run = backend_of(request).training_run(tenant_of(request), run_id)
    return types.TrainingRun.model_validate(run).model_dump(mode="json")


@router.post("/weights_info")
async def weights_info(request: Request):
    """What loading a checkpoint needs (``RestClient.get_weights_info_by_tinker_path``)."""
    data = await body(request, WeightsInfoRequest)
    info = backend_of(request).weights_info(tenant_of(request), data.tinker_path)
    return types.WeightsInfoResponse.model_validate(info).model_dump(mode="json")


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, request: Request):
    return {"checkpoints": backend_of(request).list_checkpoints(tenant_of(request), run_id)}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
    backend_of(request).delete_checkpoint(tenant_of(request), f"tinker://{run_id}/{checkpoint_id}")
    return None


def _check_scope(access_scope: str) -> None:
    if access_scope not in ("owned", "accessible"):  # nothing is shared between tenants: both are the caller's
        raise UserError(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")


class WeightsInfoRequest(BaseModel):
    """The body ``RestClient.get_weights_info_by_tinker_path`` sends (the SDK has no type for it)."""

    model_config = ConfigDict(extra="forbid")
    tinker_path: str
