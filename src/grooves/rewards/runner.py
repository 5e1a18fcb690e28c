"""Where reward components run: one background event loop, a concurrency limit, escapes.

One long-lived loop (rather than ``asyncio.run`` per call) keeps async HTTP clients valid
from one step to the next, and works when the caller has its own loop running. Sync
functions run in worker threads. A KeyboardInterrupt or SystemExit raised inside the loop
would stop the loop itself and leave the caller waiting forever, so it travels as
``Escaped`` and is raised again, as itself, in the caller's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar, Token
from typing import Any

_limit: ContextVar[asyncio.Semaphore | None] = ContextVar("grooves_reward_limit", default=None)


@asynccontextmanager
async def limited():
    """Hold one of the scoring reward's ``max_concurrency`` slots (no limit outside ``ascore``)."""
    semaphore = _limit.get()
    if semaphore is None:
        yield
        return
    async with semaphore:
        yield


class Escaped(Exception):
    """Carries a KeyboardInterrupt or SystemExit out of the rewards' loop to the caller's thread."""

    def __init__(self, original: BaseException):
        super().__init__(repr(original))
        self.original = original


async def in_thread(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``asyncio.to_thread`` that brings a KeyboardInterrupt/SystemExit back as ``Escaped``."""
    def run():
        try:
            return fn(*args, **kwargs)
        except Exception:
            raise
        except BaseException as error:
            raise Escaped(error) from None

    return await asyncio.to_thread(run)


async def escaping(awaitable) -> Any:
    try:
        return await awaitable
    except (KeyboardInterrupt, SystemExit) as error:
        raise Escaped(error) from None



def limit_to(slots: asyncio.Semaphore) -> Token:
    """Set the limit for what runs in the current context (the reward's slots, which its other
    scorings share); reset with ``token.var.reset(token)``."""
    return _limit.set(slots)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="grooves-rewards", daemon=True).start()
        return _loop


def start_coroutine(coroutine) -> concurrent.futures.Future:
    """Start ``coroutine`` on the rewards' background loop; do not wait for it."""
    return asyncio.run_coroutine_threadsafe(coroutine, _background_loop())


def _give_back_threads() -> None:
    if "torch" in sys.modules:  # without torch, no pool of torch's to give back
        from grooves.policy.openmp import release_pool  # here, not above: the policy package loads torch

        release_pool()


def run_coroutine(coroutine) -> Any:
    """Run ``coroutine`` on the rewards' background loop and wait for its result.

    The caller waits, so it first gives back its OpenMP threads (``grooves.policy.openmp``): a judge
    served in this process (``base_url = "local"``) decodes on its own thread meanwhile, and after a
    trainer's sampling or update on this thread it decoded 1.4-1.6x slower (docs/benchmarks.md)."""
    _give_back_threads()
    future = asyncio.run_coroutine_threadsafe(coroutine, _background_loop())
    try:
        return future.result()
    except Escaped as escaped:
        raise escaped.original from None
