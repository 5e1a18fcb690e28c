"""The serving engine: a bounded request queue and one worker thread that batches.

Requests that arrive within ``batch_window_s`` of each other are decoded as one batch (up
to ``max_batch_rows`` samples), whatever adapters they name: PEFT runs rows of different
adapters of the same base in one forward. The worker thread is the only one that touches
the model, so adapter loading and unloading also run there, between batches. A full queue
raises ``QueueFull`` at once (the server answers 429); nothing waits unboundedly.

Each sample gets its own random generator (seeded from the request's ``seed`` plus the
sample's index), so a seeded request gives the same text whatever else shares its batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from grooves.policy.decoding import Constraint, Row, RowOutput, decode
from grooves.serve.adapters import AdapterRegistry

QueueFull = queue.Full


@dataclass
class TokenEvent:
    index: int  # which of the request's n samples
    token: int
    logprob: float


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

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises QueueFull when the queue is full."""
        self.queue.put_nowait(request)

    def control(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the worker thread between batches (model changes must happen there)."""
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
            batch, controls = self._gather(first)
            if batch:
                self._run_batch(batch)
            for control in controls:
                try:
                    control.future.set_result(control.fn())
                except Exception as error:
                    control.future.set_exception(error)

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
            try:
                resolved = self.registry.resolve(request.model)
                adapter = self.registry.acquire(resolved, in_use)
            except Exception as error:
                request.deliver(Failed(error))
                continue
            in_use.add(adapter)
            steps[id(request)] = resolved.step
            for index in range(request.n):
                generator = None
                if request.seed is not None:
                    generator = torch.Generator(device=self.policy.device).manual_seed(request.seed + index)
                rows.append(Row(request.prompt_ids, request.temperature, request.top_p, request.max_tokens,
                                request.stop, generator, adapter,
                                request.constraint() if request.constraint else None, request.top_logprobs,
                                request.ignore_eos))
                owners.append((request, index))
        if not rows:
            return

        def on_token(row: int, token: int, logprob: float) -> None:
            request, index = owners[row]
            if request.stream:
                request.deliver(TokenEvent(index, token, logprob))

        self.batches += 1
        self.largest_batch = max(self.largest_batch, len(rows))
        try:
            outputs = decode(self.policy, rows, on_token)
        except Exception as error:
            for request in {id(r): r for r, _ in owners}.values():
                request.deliver(Failed(error))
            return
        by_request: dict[int, list[RowOutput]] = {}
        for (request, _), output in zip(owners, outputs):
            by_request.setdefault(id(request), []).append(output)
        for request in {id(r): r for r, _ in owners}.values():
            request.deliver(Finished(by_request[id(request)], steps[id(request)]))
