"""``base_url = "local"``: a grooves server over a model, started once per process on a free 127.0.0.1 port.

Judges and guards whose endpoint says ``local`` get their URL here (the reward builder is handed
``local_url``), so a frozen judge model runs apart from the policy without a second process.
"""

from __future__ import annotations

import threading

LOCAL_SERVERS: dict[str, str] = {}  # model spec -> base URL
_LOCK = threading.Lock()


def local_url(model: str) -> str:
    """The base URL of the one in-process server over ``model``, started on first use."""
    with _LOCK:
        if model not in LOCAL_SERVERS:
            from grooves.serve.app import ServerThread, build_server, create_app

            thread = ServerThread(create_app(build_server(model)))
            LOCAL_SERVERS[model] = thread.__enter__().base_url  # a daemon thread: ends with the process
        return LOCAL_SERVERS[model]
