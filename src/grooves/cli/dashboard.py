"""``grooves dashboard``: the local web app over the runs root."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import RunsOption, _fail, out


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)


def dashboard(
    runs: RunsOption = None,
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port).")] = 8765,
    host: Annotated[str, typer.Option(help="Interface to listen on; anything but loopback shows your runs to "
                                      "the network.")] = "127.0.0.1",
    evals: Annotated[Path, typer.Option(help="Where grooves eval wrote its results (shown on the evals "
                                        "page).")] = Path("evals"),
) -> None:
    """Runs, curves, alerts, review labels, transcripts and checkpoint comparison in the browser
    (http://127.0.0.1:8765 by default). Ctrl-C stops it."""
    import socket

    from grooves.dashboard.app import serve
    from grooves.policy.checkpoints import runs_root

    root = runs_root(runs)
    if not root.is_dir():
        raise _fail(f"runs root {root} does not exist (set --runs or $GROOVES_RUNS)")
    try:  # a busy port is one clear line, not a server traceback
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        raise _fail(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    shown = f"[{host}]" if ":" in host else host
    out.print(f"grooves dashboard on http://{shown}:{port} over {root.resolve()} (Ctrl-C stops it)",
              highlight=False, soft_wrap=True)
    serve(root, host=host, port=port, evals=evals)
