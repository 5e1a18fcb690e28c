"""A ``grooves backend serve`` started in this process on 127.0.0.1, for examples, benchmarks and
tests: the same ``Backend`` and routes as the command, on a free port, with generated API keys.

    with LocalService("bundled:smollm2-135m-instruct", root, tenants=["alice"]) as service:
        client = tinker.ServiceClient(base_url=service.base_url, api_key=service.keys["alice"])
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from grooves.backend.tenants import Tenant


class LocalService:
    """The service on a background thread; ``keys`` maps each tenant name to its ``tml-`` key."""

    def __init__(self, spec: str, root: str | Path, tenants: list[str] = ("local",), max_queue: int = 256):
        self.spec = spec
        self.root = Path(root)
        self.keys = {name: f"tml-{name}-{secrets.token_hex(8)}" for name in tenants}
        self.max_queue = max_queue

    def __enter__(self) -> LocalService:
        from grooves.backend.app import create_app
        from grooves.backend.service import Backend
        from grooves.serve.app import ServerThread

        # the SDK loads the tokenizer from the local folder get_info names: nothing to fetch
        self._offline = os.environ.get("HF_HUB_OFFLINE")
        os.environ["HF_HUB_OFFLINE"] = "1"
        self.backend = Backend(self.spec, self.root, max_queue=self.max_queue)
        tenants = {key: Tenant(name, key) for name, key in self.keys.items()}
        self.thread = ServerThread(create_app(self.backend, tenants)).__enter__()
        host, port = self.thread.server.servers[0].sockets[0].getsockname()[:2]
        self.base_url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.thread.__exit__(*exc)
        finally:
            self.backend.close()
            if self._offline is None:
                os.environ.pop("HF_HUB_OFFLINE", None)
            else:
                os.environ["HF_HUB_OFFLINE"] = self._offline


@contextmanager
def service_client(model: str, base_url: str | None = None, api_key: str | None = None) -> Iterator:
    """A ``tinker.ServiceClient`` of the service at ``base_url``, or of one started here on
    127.0.0.1 for ``model`` (checkpoints in a temporary folder, removed at the end)."""
    import tinker

    if base_url:
        if not api_key:
            raise SystemExit("--base-url needs --api-key or $TINKER_API_KEY")
        client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
        try:
            yield client
        finally:
            client.close("success").result(timeout=60)
        return
    with tempfile.TemporaryDirectory() as root, LocalService(model, root) as local:
        print(f"started a service on {local.base_url} (checkpoints under {root}, removed at the end)")
        client = tinker.ServiceClient(base_url=local.base_url, api_key=local.keys["local"])
        try:
            yield client
        finally:
            client.close("success").result(timeout=60)
