"""One training process per run folder.

Two processes writing one run interleave their steps in ``metrics.jsonl`` and store every
trajectory twice. A training process holds an exclusive lock on ``RUN/.lock`` (an OS file
lock, so it is released when the process dies, however it dies) for as long as it trains;
``RUN/.lock.owner`` says who holds it, so the second process can name the first.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from filelock import FileLock, Timeout


class RunLockedError(RuntimeError):
    """Another process is training this run."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._lock = FileLock(str(self.run_dir / ".lock"), timeout=0)
        self._owner = self.run_dir / ".lock.owner"

    def __enter__(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            raise RunLockedError(f"{self.run_dir} is being trained by another process ({self._holder()}); "
                                 f"wait for it to finish or stop it first") from None
        self._owner.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        return self

    def __exit__(self, *exc) -> None:
        self._owner.unlink(missing_ok=True)
        self._lock.release()

    def _holder(self) -> str:
        try:
            owner = json.loads(self._owner.read_text())
        except (OSError, ValueError):
            return "PID unknown"
        return f"PID {owner['pid']} on {owner['host']}, since {owner['since']}"
