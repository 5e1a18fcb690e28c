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
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port; the address "
                                      "printed is the one served).")] = 8765,
    host: Annotated[str, typer.Option(help="Interface to listen on. Loopback (the default) is this machine "
                                      "only; any other (0.0.0.0) shows your runs to the network and "
                                      "then requires the token printed at start, since labels are writes.")]
    = "127.0.0.1",
    evals: Annotated[Path, typer.Option(help="Where grooves eval wrote its results (shown on the evals "
                                        "page).")] = Path("evals"),
) -> None:
    """Runs, curves, alerts, review labels, transcripts and checkpoint comparison in the browser.

    Open the address it prints (http://127.0.0.1:8765 by default). It reads the run folders
    under --runs (./runs, or $GROOVES_RUNS) and writes only review labels (into each run's
    run.sqlite, as grooves review --label does). Start it where you train: comparing
    checkpoints reads the run's config.toml, whose relative paths are read from here.
    Ctrl-C stops it.
    """
    import secrets

    from grooves.dashboard.app import is_loopback, listen, serve
    from grooves.policy.checkpoints import runs_root

    root = runs_root(runs)
    if not root.exists():
        raise _fail(f"runs root {root} does not exist (set --runs or $GROOVES_RUNS; grooves train CONFIG "
                    f"creates it)")
    if not root.is_dir():
        raise _fail(f"runs root {root} is not a folder (set --runs or $GROOVES_RUNS)")
    if (root / "metrics.jsonl").is_file() or (root / "run.sqlite").is_file():
        raise _fail(f"{root} is a run, not a runs root: use --runs {root.resolve().parent}")
    try:  # bound here: a busy port is one clear line, and port 0 prints the port it got
        sock = listen(host, port)
    except OSError as error:
        raise _fail(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    bound = sock.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    token = None
    if not is_loopback(host):
        token = secrets.token_urlsafe(16)
        out.print(f"warning: listening on {host}, not loopback: anyone who can reach this machine can connect. "
                  "Every request needs the token below (labels are writes), and traffic is plain HTTP.",
                  highlight=False, soft_wrap=True)
    address = f"http://{shown}:{bound}/" + (f"?token={token}" if token else "")
    out.print(f"grooves dashboard on {address} over {root.resolve()} (Ctrl-C stops it)", highlight=False,
              soft_wrap=True, markup=False)
    serve(root, host=host, port=bound, evals=evals, token=token, sock=sock)
