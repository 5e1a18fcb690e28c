"""vLLM's runtime-LoRA routes, over the same adapter registry as ``POST /v1/adapters``.

``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`` loads a PEFT folder
now (a load that fails leaves nothing behind) and serves it as the model ``lora_name``;
``POST /v1/unload_lora_adapter {"lora_name"}`` unloads it. As in vLLM: success is a 200 with a
plain-text sentence; an error is ``{"error": {"message", "type", "param", "code"}}`` with
``code`` the HTTP status as a number and ``type`` vLLM's (``InvalidUserInput``,
``NotFoundError``, ``InternalServerError``); loading a name that is loaded is refused unless
``load_inplace`` is true, which reloads the folder under the same name. grooves adds one
refusal vLLM does not have: a path outside the allowed roots is a 403 ``PermissionDeniedError``.
vLLM lists each loaded LoRA in ``/v1/models`` with ``root`` (its path) and ``parent`` (the
base); so does grooves.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from grooves.serve.adapters import LoRAError
from grooves.serve.engine import EngineStopped
from grooves.serve.protocol import ApiError, LoadLoRARequest, UnloadLoRARequest
from grooves.serve.server import Server, stopped_error

log = logging.getLogger("grooves.serve")


def model_card(server: Server, model_id: str) -> dict:
    card = {"id": model_id, "object": "model", "created": 0, "owned_by": "grooves"}
    lora = server.registry.loras.get(model_id)
    if lora is not None:
        card.update(root=str(lora.path), parent=server.registry.base_name)
    return card


def _vllm_error(error: LoRAError) -> ApiError:
    return ApiError(error.status, str(error), error.kind, code=error.status)  # vLLM's code: the status, a number


async def _on_engine(server: Server, fn) -> None:
    """Run a model change on the engine's thread, between batches; errors come back as vLLM's."""
    try:
        await asyncio.wrap_future(server.engine.control(fn))
    except LoRAError as error:
        raise _vllm_error(error) from None
    except EngineStopped:
        raise stopped_error() from None
    except Exception as error:  # PEFT could not load the folder (another base, a broken file): vLLM's 500
        log.warning("loading a LoRA adapter failed: %s", error)
        raise ApiError(500, str(error), "InternalServerError", code=500) from None


def install_lora_routes(app: FastAPI, server: Server) -> None:
    registry = server.registry

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> Response:
        try:
            folder = await run_in_threadpool(registry.lora_folder, body.lora_name, body.lora_path)
        except LoRAError as error:
            raise _vllm_error(error) from None
        await _on_engine(server, lambda: registry.load_lora(body.lora_name, folder, body.load_inplace))
        log.info("loaded LoRA adapter %r from %s", body.lora_name, folder)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> Response:
        if not body.lora_name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput",
                           code=400)
        await _on_engine(server, lambda: registry.unload_lora(body.lora_name))
        log.info("removed LoRA adapter %r", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", status_code=200)
