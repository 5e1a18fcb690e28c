"""The HTTP routes: the subset of the Tinker API that the official SDK uses to train and sample.

Every route needs an ``X-API-Key`` from the keys file (401 otherwise). Operations on a model
(create, forward_backward, optim_step, save, load, sample) answer at once with a request id; the
SDK polls ``/api/v1/retrieve_future``, which is held open up to ``LONG_POLL_S`` and then says
"try again". JSON bodies are validated with the ``tinker`` package's own request types; a body
that does not validate gets 400 with pydantic's message.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from grooves.backend.service import ATTN, MLP, UNEMBED, Backend, UserError
from grooves.backend.tenants import Tenant
from grooves.backend import wire
from grooves.policy.lora import LoRA
from grooves.training.trainer import AdamParams

LONG_POLL_S = 10.0
PROTO = "application/x-protobuf"

# Flags the SDK reads at start; the ones that would need routes this service lacks are off.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False, "custom_loss_server_side": False,
}


def create_app(backend: Backend, tenants: dict[str, Tenant]) -> FastAPI:
    from tinker import types

    app = FastAPI(title="grooves backend", docs_url=None, redoc_url=None, openapi_url=None)
    sampled: dict[tuple[str, int], str] = {}  # (sampling session, seq_id) -> request id: retries

    @app.middleware("http")
    async def guard(request: Request, call_next):
        tenant = tenants.get(request.headers.get("x-api-key", ""))
        if tenant is None:
            return JSONResponse({"detail": "missing or unknown X-API-Key"}, status_code=401)
        if int(request.headers.get("content-length") or 0) > wire.MAX_BODY_BYTES:
            return JSONResponse({"detail": f"body over {wire.MAX_BODY_BYTES} bytes"}, status_code=413)
        if request.headers.get("content-encoding"):
            return JSONResponse({"detail": "compressed bodies are not supported"}, status_code=415)
        request.state.tenant = tenant.name
        return await call_next(request)

    @app.exception_handler(UserError)
    async def refused(request: Request, exc: UserError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    async def body(request: Request, model_type):
        try:
            data = await request.json()
        except ValueError:
            raise UserError("the body is not JSON") from None
        try:
            return model_type.model_validate(data)
        except Exception as exc:  # pydantic's ValidationError: say which field
            raise UserError(f"invalid {model_type.__name__}: {exc}") from None

    def future_json(future, model_id: str | None = None, samples: int = 0) -> dict:
        out = {"request_id": future.request_id, **({"model_id": model_id} if model_id else {})}
        if samples:  # the SDK stamps these on the returned sequences
            out["sample_sequence_ids"] = [f"{future.request_id}:{i}" for i in range(samples)]
        return out

    # --- handshake, sessions, telemetry -------------------------------------------------

    @app.post("/api/v1/client/config")
    async def client_config():
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return {}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": backend.spec, "max_context_length": backend.max_context,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await body(request, types.CreateSessionRequest)
        return {"type": "create_session", "session_id": backend.create_session(request.state.tenant)}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        req = await body(request, types.SessionHeartbeatRequest)
        backend.check_session(request.state.tenant, req.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        backend.check_session(request.state.tenant, session_id)
        return None

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    # --- training ---------------------------------------------------------------------------

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        req = await body(request, types.CreateModelRequest)
        tenant = request.state.tenant
        backend.check_session(tenant, req.session_id)
        backend.check_base(req.base_model)
        if req.optimizer_config.type != "adamw":
            raise UserError(f"optimizer {req.optimizer_config.type!r} is not supported; only adamw")
        lora = _lora(req.lora_config)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        backend.creating[model_id] = tenant
        future = backend.submit(tenant, lambda: ("json", {
            "model_id": backend.create_model(tenant, req.session_id, req.model_seq_id, lora,
                                             req.lora_config.seed if req.lora_config else None),
            "type": "create_model"}))
        return future_json(future, model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        req = await body(request, types.GetInfoRequest)
        model = await _wait_model(request.state.tenant, req.model_id)
        return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": model.lora.rank,
                "model_name": backend.spec,
                "model_data": {"arch": backend.policy.causal_lm.config.model_type, "model_name": backend.spec,
                               "tokenizer_id": str(backend.tokenizer_dir.resolve())}}

    async def _model(tenant: str, model_id: str):
        """The caller's model; one an earlier run of the service made comes back from its saved state."""
        if backend.restorable(tenant, model_id):
            future = backend.submit(tenant, lambda: backend.restore(tenant, model_id))
            while not future.done.is_set():
                await asyncio.sleep(0.02)
            if future.error is not None:
                raise UserError(future.error[0], 410 if future.error[1] == "user" else 500)
        return backend.model(tenant, model_id)

    async def _wait_model(tenant: str, model_id: str):
        """The model; a get_info right after create_model may arrive before the worker made it."""
        deadline = time.monotonic() + LONG_POLL_S
        while True:
            try:
                return await _model(tenant, model_id)
            except UserError:
                if backend.creating.get(model_id) != tenant or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        if PROTO not in request.headers.get("content-type", ""):
            raise UserError(f"forward_backward takes a protobuf body ({PROTO})", 415)
        model_id, seq_id, loss_fn, config, forward_only, datums = wire.parse_forward_backward(await request.body())
        model = await _model(request.state.tenant, model_id)

        def run():
            out = backend.forward_backward(model, datums, loss_fn, config, forward_only)
            if not out.finite:
                raise UserError("the loss is not finite (NaN or infinity); the accumulated gradient was dropped")
            return "proto", wire.forward_backward_output(out, datums, loss_fn)

        return future_json(backend.submit_ordered(model, seq_id, run, metered=True), model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        req = await body(request, types.OptimStepRequest)
        model = await _model(request.state.tenant, req.model_id)
        if not isinstance(req.optim_params, types.AdamParams):
            raise UserError("only Adam parameters (adam_params) are supported")
        p = req.optim_params
        adam = AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
        future = backend.submit_ordered(model, req.seq_id,
                                        lambda: ("json", {"metrics": backend.optim_step(model, adam)}))
        return future_json(future, req.model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        req = await body(request, types.SaveWeightsRequest)
        model = await _model(request.state.tenant, req.model_id)
        name = req.path or f"state-{int(time.time() * 1000)}"
        future = backend.submit_ordered(model, req.seq_id, lambda: ("json", {
            "path": backend.save(model, "weights", name, with_optimizer=True), "type": "save_weights"}))
        return future_json(future, req.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        req = await body(request, types.SaveWeightsForSamplerRequest)
        tenant = request.state.tenant
        model = await _model(tenant, req.model_id)

        def run():
            if req.path is not None:
                path = backend.save(model, "sampler_weights", req.path, with_optimizer=False)
                return "json", {"path": path, "type": "save_weights_for_sampler"}
            sampler = backend.create_sampler(tenant, backend.publish(model))
            return "json", {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}

        return future_json(backend.submit_ordered(model, req.seq_id, run), req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        req = await body(request, types.LoadWeightsRequest)
        tenant = request.state.tenant
        folder = backend.resolve(tenant, req.path)
        if req.model_id is None:  # create-via-load: a new training client from a checkpoint
            if req.session_id is None or req.model_seq_id is None:
                raise UserError("load_weights needs model_id, or session_id and model_seq_id")
            backend.check_session(tenant, req.session_id)
            backend.check_base(req.base_model or backend.spec)

            def create():
                model = backend.create_from(tenant, req.session_id, req.model_seq_id, folder)
                backend.load(model, folder, req.optimizer)
                return "json", {"path": req.path, "model_id": model.model_id, "type": "load_weights"}

            model_id = f"{req.session_id}:train:{req.model_seq_id}"
            backend.creating[model_id] = tenant
            return future_json(backend.submit(tenant, create), model_id)
        model = await _model(tenant, req.model_id)

        def run():
            backend.load(model, folder, req.optimizer)
            return "json", {"path": req.path, "model_id": model.model_id, "type": "load_weights"}

        return future_json(backend.submit_ordered(model, req.seq_id, run), req.model_id)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request):
        return {"checkpoints": backend.list_checkpoints(request.state.tenant, run_id)}

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        backend.delete_checkpoint(request.state.tenant, f"tinker://{run_id}/{checkpoint_id}")
        return None

    # --- sampling --------------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = await body(request, types.CreateSamplingSessionRequest)
        tenant = request.state.tenant
        backend.check_session(tenant, req.session_id)
        checkpoint = _checkpoint(tenant, req.model_path, req.base_model)
        return {"type": "create_sampling_session", "sampling_session_id": backend.create_sampler(tenant, checkpoint)}

    def _checkpoint(tenant: str, model_path: str | None, base_model: str | None):
        if model_path:
            return backend.resolve(tenant, model_path)
        backend.check_base(base_model or "")
        return None

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        checkpoint = backend.sampler(request.state.tenant, sampler_id)
        return {"sampler_id": sampler_id, "base_model": backend.spec,
                "model_path": None if checkpoint is None else str(checkpoint.name)}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        req = await body(request, types.SampleRequest)
        tenant = request.state.tenant
        if req.sampling_session_id is not None:
            checkpoint = backend.sampler(tenant, req.sampling_session_id)
            key = (req.sampling_session_id, req.seq_id)
            if req.seq_id is not None and key in sampled and sampled[key] in backend.futures:
                return future_json(backend.futures[sampled[key]], samples=req.num_samples)
        else:
            checkpoint, key = _checkpoint(tenant, req.model_path, req.base_model), None
        sampling, prompt = _sampling(req), _prompt(req)
        future = backend.submit(tenant, lambda: ("proto", wire.sample_response(
            *backend.sample(checkpoint, prompt, req.num_samples, sampling, bool(req.prompt_logprobs)))),
            metered=True)
        if key is not None and req.seq_id is not None:
            sampled[key] = future.request_id
        return future_json(future, samples=req.num_samples)

    # --- futures ---------------------------------------------------------------------------

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        req = await body(request, types.FutureRetrieveRequest)
        future = backend.future(request.state.tenant, req.request_id)
        deadline = time.monotonic() + LONG_POLL_S
        while not future.done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if not future.done.is_set():
            return {"type": "try_again", "request_id": future.request_id, "queue_state": "active"}
        if future.error is not None:
            return {"error": future.error[0], "category": future.error[1]}
        kind, payload = future.result
        return Response(payload, media_type=PROTO) if kind == "proto" else payload

    @app.post("/api/v1/cancel_future")
    async def cancel_future():
        return None

    return app


def _lora(config) -> LoRA:
    if config is None:
        return LoRA(rank=32, target_modules=ATTN + MLP + UNEMBED)
    targets = (ATTN if config.train_attn else []) + (MLP if config.train_mlp else []) + \
        (UNEMBED if config.train_unembed else [])
    if not targets:
        raise UserError("at least one of train_attn, train_mlp, train_unembed must be true")
    if not 1 <= config.rank <= 256:
        raise UserError(f"LoRA rank must be 1..256, got {config.rank}")
    return LoRA(rank=config.rank, target_modules=targets)


def _sampling(req):
    from grooves.policy.sampler import Sampling

    params = req.sampling_params
    unsupported = [name for name, on in (("topk_prompt_logprobs", req.topk_prompt_logprobs > 0),
                                         ("topk_sample_logprobs", req.topk_sample_logprobs > 0),
                                         ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                         ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0),
                                         ("top_k", params.top_k not in (-1, 0))) if on]
    if unsupported:
        raise UserError(f"not supported by this service: {', '.join(unsupported)}")
    if not 1 <= req.num_samples <= 64:
        raise UserError(f"num_samples must be 1..64, got {req.num_samples}")
    stop = params.stop
    if stop is not None and not isinstance(stop, str) and len(stop) == 0:
        raise UserError("stop=[] (no stop at all) is not supported; generation always stops at the end-of-turn token")
    if isinstance(stop, str):
        stop = (stop,)
    elif stop is not None and all(isinstance(s, int) for s in stop):
        raise UserError("stop token ids are not supported yet; pass stop strings (the end-of-turn token "
                        "always stops)")
    try:
        return Sampling(temperature=params.temperature, top_p=params.top_p, max_new_tokens=params.max_tokens or 64,
                        stop=tuple(stop or ()), seed=params.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def _prompt(req) -> list[int]:
    try:
        return req.prompt.to_ints()
    except Exception as exc:
        raise UserError(f"the prompt must be token chunks only: {exc}") from None
