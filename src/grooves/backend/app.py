"""The HTTP app: the subset of the Tinker API that the official SDK uses to train and sample.

Every route needs an ``X-API-Key`` from the keys file (401 otherwise; ``grooves.backend.edge``).
Operations on a model (create, forward_backward, optim_step, save, load, sample) answer at once
with a request id; the SDK polls ``/api/v1/retrieve_future``, which is held open up to
``LONG_POLL_S`` and then says "try again". JSON bodies are validated with the ``tinker``
package's own request types; a body that does not validate gets 400 with pydantic's message.
The routes live in ``grooves.backend.routes``, one module per part of the API.
"""

from __future__ import annotations

from fastapi import FastAPI

from grooves.backend.edge import install_edge
from grooves.backend.routes.common import LONG_POLL_S
from grooves.backend.service import Backend
from grooves.backend.tenants import Tenant

__all__ = ["LONG_POLL_S", "create_app"]


def create_app(backend: Backend, tenants: dict[str, Tenant]) -> FastAPI:
    from grooves.backend.routes import checkpoints, sampling, sessions, training

    app = FastAPI(title="grooves backend", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.sampled = {}  # (sampling session, seq_id) -> request id, so a retried sample runs once
    install_edge(app, tenants)
    for module in (sessions, training, checkpoints, sampling):
        app.include_router(module.router)
    return app
