"""The service's queue: one worker thread runs every operation that touches the model, so
operations never race.

A training client's operations run in the order of their ``seq_id`` (the SDK numbers them from
1; creating the model is 0), whatever order they arrive in; a request whose ``seq_id`` was
already accepted gets the first one's future back, so a retry is never applied twice. Work is
taken from tenants in turn (round robin), so one tenant's long queue does not starve another.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

log = logging.getLogger("grooves.backend")

BATCH_WAIT_S = 0.05  # how long a lone batchable request waits for others to join its batch
MAX_FUTURES = 100_000  # results kept for the SDK to collect; the oldest go first


class UserError(ValueError):
    """A request the service refuses; the message goes back to the client (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Future:
    request_id: str
    tenant: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None  # ("json", dict) or ("proto", bytes)
    error: tuple[str, str] | None = None  # (message, "user" | "server")


@dataclass
class Ordered:
    """One training client's stream of operations, run in ``seq_id`` order."""

    next_seq: int | None = 1  # None: restored after a restart, the next request's seq_id is taken
    accepted: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id
    waiting: dict[int, tuple] = field(default_factory=dict)  # seq_id -> (future, op), until its turn


@dataclass(frozen=True)
class Batchable:
    """An operation the worker may run in one batch with the others of the same ``key`` waiting at
    the head of the tenants' queues (sampling requests for one checkpoint: one decode for all).

    ``run(futures, items)`` gets the batch's futures and items and returns one result per item;
    ``size`` is what the item adds to a batch (rows), at most ``limit`` in all."""

    key: Hashable
    item: Any
    size: int
    limit: int
    run: Callable[[list[Future], list[Any]], list[Any]]


class WorkQueue:
    """Futures, the per-tenant queues and the worker thread."""

    def __init__(self, max_queue: int, check_budget: Callable[[str], None] = lambda tenant: None,
                 on_idle: Callable[[], None] = lambda: None):
        self.futures: collections.OrderedDict[str, Future] = collections.OrderedDict()
        self.max_queue = max_queue
        self.check_budget = check_budget  # raises UserError(402) when a tenant may not spend more
        self.on_idle = on_idle  # called on the worker thread when it has nothing to do
        self.current: Future | None = None  # the request the worker runs now (for charging)
        self._ready: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._waiting = 0  # ordered operations accepted but not yet their turn
        self._last_tenant: str | None = None
        self._lock = threading.Condition()
        self._stop = False
        self._worker = threading.Thread(target=self._work, name="grooves-backend", daemon=True)
        self._worker.start()

    def new_future(self, tenant: str) -> Future:
        future = Future(uuid.uuid4().hex, tenant)
        with self._lock:
            self.futures[future.request_id] = future
            while len(self.futures) > MAX_FUTURES:
                self.futures.popitem(last=False)
        return future

    def future(self, tenant: str, request_id: str) -> Future:
        """A request's future; 410 when unknown (expired, or the service restarted: the SDK resubmits)."""
        future = self.futures.get(request_id)
        if future is None or future.tenant != tenant:
            raise UserError(f"no pending request {request_id!r} for this API key (expired, or the service "
                            "restarted); submit it again", 410)
        return future

    def queued(self) -> int:
        with self._lock:
            return self._waiting + sum(len(q) for q in self._ready.values())

    def submit(self, tenant: str, op: Callable[[], Any], *, metered: bool = False) -> Future:
        """Run ``op`` on the worker when the tenant's turn comes; its return value is the result.

        ``metered`` work (it costs tokens) is refused with 402 once the tenant's budget is spent."""
        if metered:
            self.check_budget(tenant)
        future = self.new_future(tenant)
        with self._lock:
            self._check_room()
            self._ready[tenant].append((future, op))
            self._lock.notify()
        return future

    def submit_ordered(self, tenant: str, stream: Ordered, seq_id: int | None, op: Callable[[], Any], *,
                       metered: bool = False, name: str = "") -> Future:
        """Like ``submit``, in ``seq_id`` order within ``stream``; a repeated ``seq_id`` is the same request."""
        with self._lock:
            if seq_id is None:
                seq_id = max([(stream.next_seq or 1) - 1, *stream.waiting, *stream.accepted]) + 1
            if seq_id in stream.accepted:
                known = self.futures.get(stream.accepted[seq_id])
                if known is None:
                    raise UserError(f"the result of seq_id {seq_id} has expired", 410)
                return known
            if stream.next_seq is None:  # restored after a restart: the client's next request sets the count
                stream.next_seq = seq_id
            if metered:
                self.check_budget(tenant)
            if seq_id < stream.next_seq:
                raise UserError(f"seq_id {seq_id} of model {name} was already run; it cannot run again")
            self._check_room()
            future = self.new_future(tenant)
            stream.accepted[seq_id] = future.request_id
            stream.waiting[seq_id] = (future, op)
            self._waiting += 1
            while stream.next_seq in stream.waiting:  # its turn has come: hand it to the tenant's queue
                self._ready[tenant].append(stream.waiting.pop(stream.next_seq))
                self._waiting -= 1
                stream.next_seq += 1
            self._lock.notify()
        return future

    def _check_room(self) -> None:
        if self.queued() >= self.max_queue:  # the lock is re-entrant
            raise UserError(f"the service queue is full ({self.max_queue} operations); retry later", 429)

    def _next(self) -> tuple[Future, Callable] | None:
        tenants = sorted(t for t, q in self._ready.items() if q)
        if not tenants:
            return None
        later = [t for t in tenants if self._last_tenant is None or t > self._last_tenant]
        tenant = (later or tenants)[0]  # round robin: the tenant after the one served last
        self._last_tenant = tenant
        return self._ready[tenant].popleft()

    def _companions(self, op: Batchable) -> list[tuple[Future, Batchable]]:
        """The operations of ``op``'s key waiting at the head of each tenant's queue, up to its limit
        (taken under the lock)."""
        taken, size = [], op.size
        for queue in self._ready.values():
            while queue and isinstance(queue[0][1], Batchable) and queue[0][1].key == op.key \
                    and size + queue[0][1].size <= op.limit:
                taken.append(queue.popleft())
                size += taken[-1][1].size
        return taken

    def _work(self) -> None:
        while True:
            with self._lock:
                item = self._next()
                if item is None and not self._stop:
                    self.on_idle()
                while item is None and not self._stop:
                    self._lock.wait()
                    item = self._next()
                if item is None:
                    return
                batch = [item]
                if isinstance(item[1], Batchable):
                    batch += self._companions(item[1])
                    # a client sends a step's requests one after the other: wait a moment for the rest
                    deadline = time.monotonic() + BATCH_WAIT_S
                    while len(batch) == 1 and not self._stop and (left := deadline - time.monotonic()) > 0:
                        self._lock.wait(left)
                        batch += self._companions(item[1])
            self.current = batch[0][0]
            try:
                if isinstance(batch[0][1], Batchable):
                    results = batch[0][1].run([f for f, _ in batch], [op.item for _, op in batch])
                else:
                    results = [batch[0][1]()]
                for (future, _), result in zip(batch, results, strict=True):
                    future.result = result
            except UserError as exc:
                for future, _ in batch:
                    future.error = (str(exc), "user")
                log.warning("request %s of tenant %s refused: %s", self.current.request_id, self.current.tenant, exc)
            except Exception as exc:  # a bug or a broken model: the client gets it, the service stays up
                for future, _ in batch:
                    future.error = (f"{type(exc).__name__}: {exc}", "server")
                log.exception("request %s of tenant %s failed", self.current.request_id, self.current.tenant)
            for future, _ in batch:
                future.done.set()

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._worker.join(timeout=30)
