"""``grooves backend serve``: the training service that the official ``tinker`` SDK trains on.

Needs the ``backend`` extra (``pip install 'grooves[backend]'``); see docs/backend.md.
"""

from __future__ import annotations

import logging
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
    prices: Annotated[Path | None, typer.Option(help="Prices (TOML: prompt, sample, train in USD per million "
                                                "tokens); tenants' budget_usd is checked against them.")] = None,
    runs: RunsOption = None,
) -> None:
    """Serve the Tinker training API on MODEL: each training client is its own LoRA on one frozen
    base; checkpoints live under RUNS/backend/<tenant>/."""
    import uvicorn

    from grooves.backend.tenants import KeysError, load_tenants
    from grooves.policy.checkpoints import runs_root

    from grooves.backend.ledger import load_prices

    try:
        tenants = load_tenants(keys)
        price_list = load_prices(prices)
    except (KeysError, ValueError) as error:
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
        backend = Backend(model, root, max_queue=max_queue, prices=price_list,
                          budgets={t.name: t.budget_usd for t in tenants.values()})
    except (*_user_errors(), ValueError) as error:
        sock.close()
        raise _fail(str(error)) from None
    _log_to_stderr()
    bound_host, bound_port = sock.getsockname()[:2]
    err.print(f"[bold]grooves backend[/]: training LoRAs on {model} for {len(tenants)} tenant(s) on "
              f"http://{bound_host}:{bound_port} (checkpoints under {root})", highlight=False)
    config = uvicorn.Config(create_app(backend, tenants), log_level="warning", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        backend.close()


def _log_to_stderr() -> None:
    """The service's log on stderr: every refusal with its reason, a client gone, one line each."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    service_log = logging.getLogger("grooves.backend")
    service_log.addHandler(handler)
    service_log.setLevel(logging.INFO)


@app.command("usage")
def usage_command(
    since: Annotated[str | None, typer.Option(help="Only usage since then: a date (2026-12-03), a time "
                                              "(2026-12-03T14:00) or an age (30m, 12h, 7d).")] = None,
    prices: Annotated[Path | None, typer.Option(help="Prices (TOML: prompt, sample, train in USD per million "
                                                "tokens) to show the cost.")] = None,
    runs: RunsOption = None,
) -> None:
    """Tokens (and cost) per tenant and model from the service's metering ledger."""
    from rich.table import Table

    from grooves.backend.ledger import Ledger, load_prices
    from grooves.cli.common import out
    from grooves.policy.checkpoints import runs_root

    path = runs_root(runs) / "backend" / "ledger.sqlite"
    if not path.is_file():
        raise _fail(f"no ledger at {path}: has grooves backend serve run with this runs root?")
    try:
        price_list = load_prices(prices)
        start = _since(since)
    except ValueError as error:
        raise _fail(str(error)) from None
    ledger = Ledger(path)
    rows = ledger.usage(start)
    ledger.close()
    table = Table("tenant", "model", "requests", "prompt", "sampled", "trained",
                  *(["cost (USD)"] if prices else []))
    for tenant, model, requests, prompt, sampled, trained in rows:
        cost = [f"{price_list.cost(prompt, sampled, trained):.6f}"] if prices else []
        table.add_row(tenant, model, str(requests), str(prompt), str(sampled), str(trained), *cost)
    out.print(table)
    if not rows:
        out.print("no usage recorded" + (f" since {since}" if since else ""))


def _since(value: str | None) -> float | None:
    import re
    import time
    from datetime import datetime, timezone

    if value is None:
        return None
    match = re.fullmatch(r"(\d+)([mhd])", value)
    if match:
        return time.time() - int(match.group(1)) * {"m": 60, "h": 3600, "d": 86400}[match.group(2)]
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"--since {value!r}: use a date (2026-12-03), a time (2026-12-03T14:00) or an age "
                         "(30m, 12h, 7d)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()
