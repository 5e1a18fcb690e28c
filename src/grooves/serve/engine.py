"""The serving engine: a bounded request queue and one worker thread that batches.

Requests that arrive within ``batch_window_s`` of each other are decoded as one batch (up
to ``max_batch_rows`` samples), whatever adapters they name: each row runs with its own
adapter in one forward of the base (``grooves.policy.lora_batch``). The worker thread is the
only one that touches the model, so adapter loading and unloading also run there, between
batches. A full queue raises ``QueueFull`` at once (the server answers 429); nothing waits
unboundedly.

Each sample gets its own random generator (seeded from the request's ``seed`` plus the
sample's index), so a seeded request gives the same text whatever else shares its batch.

A request whose client has gone (``cancelled`` set by the HTTP layer) is skipped if still
queued, and its rows leave the running batch at their next token; ``generated_tokens`` counts
every token made, so a test can see generation stop.

The worker survives any exception: a request whose rows cannot be built fails alone, a
failed batch fails its own requests, and the thread goes on. ``halt()`` (shutdown) makes
the running batch stop at its next token and fails everything still queued, so no client
waits on a worker that is gone; ``submit`` then raises ``EngineStopped``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from grooves.policy.decoding import Constraint, Row, RowOutput, decode
from grooves.policy.openmp import release_pool
from grooves.serve.adapters import AdapterRegistry, Resolved

QueueFull = queue.Full
log = logging.getLogger("grooves.serve")


class EngineStopped(RuntimeError):
    """The engine is not running (shut down): the request was not, or not fully, served."""


class _Halted(Exception):
    """Raised from the token callback to end a batch at once when the engine halts."""


class Cancelled(RuntimeError):
    """The request's client went away before it was served."""


@dataclass
class TokenEvent:
    index: int  # which of the request's n samples
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob) when streamed with top_logprobs


@dataclass
class Finished:
    outputs: list[RowOutput]
    adapter_step: int | None


@dataclass
class Failed:
    error: Exception


Event = TokenEvent | Finished | Failed


@dataclass
class GenerationRequest:
    model: str
    prompt_ids: list[int]
    deliver: Callable[[Event], None]  # called from the worker thread
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    constraint: Callable[[], Constraint] | None = None  # a fresh constraint for each sample
    stream: bool = False
    ignore_eos: bool = False
    resolved: Resolved | None = None  # the model pinned when the request arrived; None: resolve ``model`` here
    cancelled: threading.Event = field(default_factory=threading.Event)  # set when the client is gone
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class _Control:
    fn: Callable[[], Any]
    future: Future


class Engine:
    def __init__(self, policy, registry: AdapterRegistry, max_batch_rows: int = 32, max_queue: int = 64,
                 batch_window_s: float = 0.005):
        self.policy = policy
        self.registry = registry
        self.max_batch_rows = max_batch_rows
        self.batch_window_s = batch_window_s
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grooves-engine", daemon=True)
        self.batches = 0  # counters for tests and /health
        self.largest_batch = 0
        self.generated_tokens = 0
        self.cancelled_requests = 0

    def start(self) -> Engine:
        release_pool()  # the caller loaded the model; the worker thread decodes (grooves.policy.openmp)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def halt(self) -> None:
        """Stop without waiting: the running batch ends at its next token, queued requests fail."""
        self._stopping.set()

    def stop(self) -> None:
        self.halt()
        self._thread.join(timeout=30)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises QueueFull when the queue is full, EngineStopped when not running."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        self.queue.put_nowait(request)

    def control(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the worker thread between batches (model changes must happen there)."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        future: Future = Future()
        self.queue.put(_Control(fn, future), timeout=30)
        return future

    # --- the worker thread ---------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                first = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._serve(first)
            if self.queue.empty():
                release_pool()  # idle: another thread's computing gets the CPUs' threads (grooves.policy.openmp)
        self._drain()

    def _serve(self, first) -> None:
        """One round: a batch and the controls gathered with it. Nothing raised here ends the thread."""
        batch, controls = [first], []
        try:
            batch, controls = self._gather(first)
            if batch:
                self._run_batch(batch)
        except Exception as error:  # a bug, not a bad request: fail this round's requests, keep serving
            log.exception("the engine failed a batch")
            for request in batch:
                if isinstance(request, GenerationRequest):
                    _deliver(request, Failed(error))
        for control in controls:
            try:
                control.future.set_result(control.fn())
            except Exception as error:
                control.future.set_exception(error)

    def _drain(self) -> None:
        """After a halt: fail whatever is still queued, so no caller waits for ever."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            stopped = EngineStopped("the server is shutting down")
            if isinstance(item, _Control):
                item.future.set_exception(stopped)
            else:
                _deliver(item, Failed(stopped))

    def _gather(self, first) -> tuple[list[GenerationRequest], list[_Control]]:
        """The first item plus whatever arrives within the batch window, up to the row limit."""
        batch, controls = [], []
        (controls if isinstance(first, _Control) else batch).append(first)
        rows = sum(r.n for r in batch)
        deadline = time.monotonic() + self.batch_window_s
        while batch and rows < self.max_batch_rows:
            try:
                item = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(item, _Control):
                controls.append(item)
                continue
            if rows + item.n > self.max_batch_rows:
                self._run_batch(batch)  # keep the order: what does not fit starts the next batch
                batch, rows = [], 0
            batch.append(item)
            rows += item.n
        return batch, controls

    def _run_batch(self, batch: list[GenerationRequest]) -> None:
        rows: list[Row] = []
        owners: list[tuple[GenerationRequest, int]] = []
        steps: dict[int, int | None] = {}
        in_use: set[str] = set()
        for request in batch:
            if request.cancelled.is_set():
                self.cancelled_requests += 1
                _deliver(request, Failed(Cancelled("the client went away")))
                continue
            try:  # anything wrong with one request (its model, its seed, its grammar) fails it alone
                resolved = request.resolved or self.registry.resolve(request.model)
                adapter = self.registry.acquire(resolved, in_use)
                own = [self._row(request, index, adapter) for index in range(request.n)]
            except Exception as error:
                _deliver(request, Failed(error))
                continue
            in_use.add(adapter)
            steps[id(request)] = resolved.step
            rows += own
            owners += [(request, index) for index in range(request.n)]
        if not rows:
            return

        def on_token(row: int, token: int, logprob: float) -> None:
            if self._stopping.is_set():
                raise _Halted
            self.generated_tokens += 1
            request, index = owners[row]
            if request.stream:
                probe = rows[row].constraint
                top = probe.last if isinstance(probe, TopLogprobs) else []
                _deliver(request, TokenEvent(index, token, logprob, top))

        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(rows))
        requests = list({id(r): r for r, _ in owners}.values())
        try:
            outputs = decode(self.policy, rows, on_token)
        except Exception as error:
            if isinstance(error, _Halted):
                error = EngineStopped("the server is shutting down")
            else:
                log.error("a batch of %d rows failed", len(rows), exc_info=error)
            for request in requests:
                _deliver(request, Failed(error))
            return
        by_request: dict[int, list[RowOutput]] = {}
        for (request, _), output in zip(owners, outputs):
            by_request.setdefault(id(request), []).append(output)
        for request in requests:
            if request.cancelled.is_set():
                self.cancelled_requests += 1
            _deliver(request, Finished(by_request[id(request)], steps[id(request)]))

    def _row(self, request: GenerationRequest, index: int, adapter: str) -> Row:
        generator = None
        if request.seed is not None:
            generator = torch.Generator(device=self.policy.device).manual_seed(request.seed + index)
        constraint = request.constraint() if request.constraint else None
        if request.stream and request.top_logprobs:
            constraint = TopLogprobs(request.top_logprobs, constraint)
        return Row(request.prompt_ids, request.temperature, request.top_p, request.max_tokens, request.stop,
                   generator, adapter, constraint, request.top_logprobs, request.ignore_eos,
                   cancelled=request.cancelled.is_set)


def _deliver(request: GenerationRequest, event: Event) -> None:
    """Hand an event to the request's owner; an owner that is gone (a closed loop) must not stop the worker."""
    try:
        request.deliver(event)
    except Exception:
        log.debug("an event could not be delivered (the client is gone)", exc_info=True)


class TopLogprobs:
    """Records each step's top logprobs of a row, for streamed chunks (the decode loop's token
    callback gives only the chosen token's logprob).

    It sits in the row's constraint slot, where the decode loop hands it the row's
    temperature-scaled logits before any mask; it masks nothing itself and passes the call on
    to the row's real constraint, if any, so sampling is unchanged.
    """

    def __init__(self, k: int, inner: Constraint | None):
        self.k, self.inner = k, inner
        self.last: list[tuple[int, float]] = []

    def mask(self, logits: torch.Tensor, remaining: int) -> None:
        values, ids = torch.log_softmax(logits.float(), dim=-1).topk(self.k)
        self.last = list(zip(ids.tolist(), values.tolist()))
        if self.inner is not None:
            self.inner.mask(logits, remaining)

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()
