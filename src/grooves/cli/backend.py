"""``grooves backend serve``: the training service that the official ``tinker`` SDK trains on.

Needs the ``backend`` extra (``pip install 'grooves[backend]'``); see docs/backend.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, _user_errors, err

app = typer.Typer(help="The training service: the Tinker API over grooves' trainer.", no_args_is_help=True)


@app.command("serve")
def serve_command(
    keys: Annotated[Path, typer.Option("--keys", help="Tenants and their API keys: a TOML file with one "
                                       "table per tenant, tenants.NAME, holding key = \"tml-...\" and an "
                                       "optional budget_usd.")],
    model: Annotated[str, typer.Option(help="Base model spec every tenant trains LoRAs on.")]
    = "bundled:smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 = any free port).")] = 8100,
    max_queue: Annotated[int, typer.Option(min=1, help="Operations queued at once (429 beyond).")] = 256,
    runs: RunsOption = None,
) -> None:
    """Serve the Tinker training API on MODEL: each training client is its own LoRA on one frozen
    base; checkpoints live under RUNS/backend/<tenant>/."""
    import uvicorn

    from grooves.backend.tenants import KeysError, load_tenants
    from grooves.policy.checkpoints import runs_root

    try:
        tenants = load_tenants(keys)
    except KeysError as error:
        raise _fail(str(error)) from None
    try:
        import tinker  # noqa: F401  (the protobuf schema and request types come from the SDK)
    except ImportError:
        raise _fail("grooves backend needs the tinker SDK: pip install 'grooves[backend]'") from None
    from grooves.backend.app import create_app
    from grooves.backend.service import Backend
    from grooves.serve.app import bind

    try:  # the port first: a busy one fails in a second, not after the model has loaded
        sock = bind(host, port)
    except OSError as error:
        raise _fail(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    root = runs_root(runs) / "backend"
    try:
        backend = Backend(model, root, max_queue=max_queue)
    except (*_user_errors(), ValueError) as error:
        sock.close()
        raise _fail(str(error)) from None
    bound_host, bound_port = sock.getsockname()[:2]
    err.print(f"[bold]grooves backend[/]: training LoRAs on {model} for {len(tenants)} tenant(s) on "
              f"http://{bound_host}:{bound_port} (checkpoints under {root})", highlight=False)
    config = uvicorn.Config(create_app(backend, tenants), log_level="warning", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        backend.close()
