"""Training: create a LoRA training client, ``forward_backward``, ``optim_step``, ``get_info``."""

from __future__ import annotations

import math

from fastapi import APIRouter, Request
from tinker import types

from grooves.backend import wire
from grooves.backend.queue import UserError
from grooves.backend.routes.common import (PROTO, backend_of, body, created_model, future_json, model_of,
                                           new_model_id, tenant_of)
from grooves.backend.sampling import MAX_SEED
from grooves.backend.storage import ATTN, MLP, UNEMBED
from grooves.policy.lora import LoRA

router = APIRouter(prefix="/api/v1")


@router.post("/create_model")
async def create_model(request: Request):
    req = await body(request, types.CreateModelRequest)
    backend, tenant = backend_of(request), tenant_of(request)
    backend.check_session(tenant, req.session_id)
    backend.check_base(req.base_model)
    if req.optimizer_config.type != "adamw":
        raise UserError(f"optimizer {req.optimizer_config.type!r} is not supported; only adamw")
    lora = lora_of(req.lora_config)
    seed = req.lora_config.seed if req.lora_config else None
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UserError(f"lora_config.seed must be 0..2**64-1, got {seed}")
    model_id = new_model_id(req.session_id, req.model_seq_id)
    backend.creating[model_id] = tenant
    future = backend.submit(tenant, lambda: ("json", {
        "model_id": backend.create_model(tenant, req.session_id, req.model_seq_id, lora, seed),
        "type": "create_model"}))
    return future_json(future, model_id)


@router.post("/get_info")
async def get_info(request: Request):
    req = await body(request, types.GetInfoRequest)
    backend = backend_of(request)
    model = await created_model(request, req.model_id)
    return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": model.lora.rank,
            "model_name": backend.spec,
            "model_data": {"arch": backend.policy.causal_lm.config.model_type, "model_name": backend.spec,
                           "tokenizer_id": str(backend.tokenizer_dir.resolve())}}


@router.post("/forward_backward")
async def forward_backward(request: Request):
    if PROTO not in request.headers.get("content-type", ""):
        raise UserError(f"forward_backward takes a protobuf body ({PROTO})", 415)
    model_id, seq_id, loss_fn, config, forward_only, datums = wire.parse_forward_backward(await request.body())
    backend = backend_of(request)
    model = await model_of(request, model_id)

    def run():
        out = backend.forward_backward(model, datums, loss_fn, config, forward_only)
        if not out.finite:
            raise UserError("the loss is not finite (NaN or infinity); the accumulated gradient was dropped")
        return "proto", wire.forward_backward_output(out, datums, loss_fn)

    return future_json(backend.submit_for(model, seq_id, run, metered=True), model_id)


@router.post("/optim_step")
async def optim_step(request: Request):
    req = await body(request, types.OptimStepRequest)
    backend = backend_of(request)
    model = await model_of(request, req.model_id)
    if not isinstance(req.optim_params, types.AdamParams):
        raise UserError("only Adam parameters (adam_params) are supported")
    check_adam(req.optim_params)
    future = backend.submit_for(model, req.seq_id, lambda: ("json", {"metrics": backend.optim_step(
        model, req.optim_params)}))
    return future_json(future, req.model_id)


def lora_of(config) -> LoRA:
    """Tinker's ``LoraConfig`` as grooves' ``LoRA`` (rank 32 on every module when absent)."""
    if config is None:
        return LoRA(rank=32, target_modules=ATTN + MLP + UNEMBED)
    targets = (ATTN if config.train_attn else []) + (MLP if config.train_mlp else []) + \
        (UNEMBED if config.train_unembed else [])
    if not targets:
        raise UserError("at least one of train_attn, train_mlp, train_unembed must be true")
    if not 1 <= config.rank <= 256:
        raise UserError(f"LoRA rank must be 1..256, got {config.rank}")
    return LoRA(rank=config.rank, target_modules=targets)


def check_adam(params) -> None:
    """Adam's settings in range, so a bad one is a 400 and never NaN weights."""
    checks = (("learning_rate", params.learning_rate >= 0, ">= 0"), ("beta1", 0 <= params.beta1 < 1, "in [0, 1)"),
              ("beta2", 0 <= params.beta2 < 1, "in [0, 1)"), ("eps", params.eps > 0, "> 0"),
              ("weight_decay", params.weight_decay >= 0, ">= 0"),
              ("grad_clip_norm", params.grad_clip_norm >= 0, ">= 0 (0: no clipping)"))
    for name, ok, allowed in checks:
        value = getattr(params, name)
        if not (math.isfinite(value) and ok):
            raise UserError(f"adam_params.{name} must be a finite number {allowed}, got {value}")
