"""The judges' client: one OpenAI-compatible endpoint, strict JSON replies, retries, a cache.

Any server that speaks the chat-completions API works (OpenAI, vLLM, Ollama, the
llama.cpp server, ``grooves serve``). ``JudgeClient.ask`` sends a prompt with a JSON
schema as ``response_format`` (structured output; ``grooves serve`` enforces it by
constrained decoding) and returns the reply's JSON object after a caller's check:

- transient failures (timeouts, connection errors, 5xx, 429) are retried with exponential
  backoff (``Retry-After`` is honoured, capped at 30 s); other 4xx fail at once;
- a reply that is not one JSON object, or fails the check (a score out of range, the
  wrong ids), gets ``repairs`` more tries: the model sees its reply and what was wrong;
- a server that rejects ``response_format`` is asked again without it, once per client;
- successes are cached by (judge, model, prompt, schema); failures never are.
- a request can be asked ahead (``asking_ahead``; ``Reward.ask_ahead`` while a batch is still
  being sampled): its answer, or its failure, and its counters wait in the client until the
  batch's scoring asks the same thing, which takes them over instead of asking again, so the
  calls count in the step that uses them. Asked ahead twice, a request is sent once.
- a call that fails for good says why in words a user can act on: "timed out after 60 s
  (3 retries)" when every try timed out, else how many tries failed (and timed out) and the
  last error; that text is the reward's first error, shown in the step's output.

Counters (``calls``, ``retries``, ``unparseable``, ``failures``, ``cache_hits``, ``tokens``,
``latency_s``) are running totals; the reward report turns them into per-step metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class JudgeError(RuntimeError):
    """A judge call failed for good (after retries and repairs); the component gives NaN."""


class ReplyError(ValueError):
    """A reply that cannot be used; the message is shown to the model in the repair turn."""


@dataclass(frozen=True)
class Endpoint:
    """Where a judge's model is served and how to call it."""

    base_url: str
    model: str
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout: float = 60.0
    max_retries: int = 3
    backoff: float = 0.5
    structured: bool = True
    temperature: float = 0.0
    max_tokens: int = 400
    seed: int | None = 0

    @property
    def api_key(self) -> str:
        # Local servers need no key, but the openai client insists on a non-empty one.
        return (os.environ.get(self.api_key_env) if self.api_key_env else None) or "none"


class JudgeCache:
    """Replies of successful judge calls by key; in memory, or in a SQLite file to share across runs."""

    def __init__(self, path: str | Path | None = None):
        self._memory: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._db = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, reply TEXT NOT NULL)")

    def get(self, key: str) -> Any | None:
        with self._lock:
            if key in self._memory:
                return self._memory[key]
            if self._db is not None:
                row = self._db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
                if row:
                    self._memory[key] = json.loads(row[0])
                    return self._memory[key]
        return None

    def put(self, key: str, reply: Any) -> None:
        with self._lock:
            self._memory[key] = reply
            if self._db is not None:
                self._db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?)", (key, json.dumps(reply)))
                self._db.commit()

    def __len__(self) -> int:
        return len(self._memory)


_COUNTERS = ("calls", "retries", "unparseable", "failures", "cache_hits", "tokens", "latency_s")

asking_ahead: ContextVar[bool] = ContextVar("grooves_judge_asking_ahead", default=False)
MAX_UNCLAIMED = 1024  # answers asked ahead and never asked for again: the oldest are dropped past this


class AskedAlready(JudgeError):
    """Asked ahead for a request already answered or on its way (nothing is sent)."""


class JudgeClient:
    """Calls one endpoint for one judge; see the module docstring for the failure rules."""

    def __init__(self, endpoint: Endpoint, name: str = "judge", cache: JudgeCache | None = None,
                 repairs: int = 1):
        self.endpoint = endpoint
        self.name = name
        self.cache = cache if cache is not None else JudgeCache()
        self.repairs = repairs
        self.stats = dict.fromkeys(_COUNTERS, 0.0)
        self._structured = endpoint.structured
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # requests asked ahead, by cache key: a future of (reply or None, JudgeError or None, counters)
        self._early: dict[str, asyncio.Future] = {}

    def counters(self) -> dict[str, float]:
        return dict(self.stats)

    async def ask(self, messages: list[dict], schema: dict, check: Callable[[Any], T]) -> T:
        """Send ``messages``, parse the reply as one JSON object, return ``check(reply)``.

        ``check`` raises ``ReplyError`` for a reply it cannot use (that starts a repair turn).
        Under ``asking_ahead`` the request's outcome waits for a later ask of the same (module doc).
        """
        key = self.cache_key(messages, schema)
        ahead = asking_ahead.get()
        early = self._early.get(key)
        if early is not None and early.get_loop() is asyncio.get_running_loop():
            if ahead:
                raise AskedAlready(f"judge {self.name!r}: asked ahead already")
            reply = await self._claim(key, early)
            if reply is not None:
                return check(reply)
        cached = self.cache.get(key)
        if cached is not None:
            if ahead:
                raise AskedAlready(f"judge {self.name!r}: answered already")
            self.stats["cache_hits"] += 1
            return check(cached)
        if ahead:
            return check(await self._ask_early(key, messages, schema, check))
        return check(await self._answer(key, messages, schema, check, self.stats))

    async def _answer(self, key: str, messages: list[dict], schema: dict, check: Callable[[Any], Any],
                      tally: dict[str, float]) -> Any:
        """The reply that passes ``check`` (after repair turns), cached; counted in ``tally``."""
        conversation = list(messages)
        problem = ""
        for _ in range(self.repairs + 1):
            text = await self._complete(conversation, schema, tally)
            try:
                reply = parse_json_object(text)
                check(reply)
            except ReplyError as error:
                tally["unparseable"] += 1
                problem = str(error)
                conversation += [{"role": "assistant", "content": text},
                                 {"role": "user", "content": f"That reply cannot be used: {problem}. "
                                  "Answer again with only the JSON object, exactly as asked."}]
                continue
            self.cache.put(key, reply)
            return reply
        tally["failures"] += 1
        raise JudgeError(f"judge {self.name!r}: no usable reply after {self.repairs + 1} tries ({problem})")

    async def _ask_early(self, key: str, messages: list[dict], schema: dict, check: Callable[[Any], Any]) -> Any:
        """Ask now for a later ``ask``: the outcome and its counters wait in ``_early``."""
        future = asyncio.get_running_loop().create_future()
        self._early[key] = future
        self._drop_unclaimed()
        tally = dict.fromkeys(_COUNTERS, 0.0)
        try:
            reply = await self._answer(key, messages, schema, check, tally)
        except JudgeError as error:
            future.set_result((None, error, tally))
            raise
        except BaseException:  # cancelled, or a bug: the later ask asks for itself
            future.set_result((None, None, tally))
            raise
        future.set_result((reply, None, tally))
        return reply

    async def _claim(self, key: str, future: asyncio.Future) -> Any | None:
        """Take over a request asked ahead: its reply (None: ask anew), its failure raised. The
        first to claim it counts its calls; another ask of the same request counts a cache hit."""
        reply, error, tally = await asyncio.shield(future)
        if self._early.get(key) is future:
            del self._early[key]
            self._count(tally)
            if error is not None:
                raise error
            return reply
        if reply is not None:
            self.stats["cache_hits"] += 1
        return reply

    def _count(self, tally: dict[str, float]) -> None:
        for name, value in tally.items():
            self.stats[name] += value

    def _drop_unclaimed(self) -> None:
        """Forget the oldest finished answers no ask took over, past ``MAX_UNCLAIMED``; their calls count now."""
        for key in [k for k, f in self._early.items() if f.done()][: max(0, len(self._early) - MAX_UNCLAIMED)]:
            self._count(self._early.pop(key).result()[2])

    def cache_key(self, messages: list[dict], schema: dict) -> str:
        e = self.endpoint
        payload = json.dumps([self.name, e.base_url, e.model, e.temperature, messages, schema], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    async def _complete(self, messages: list[dict], schema: dict, tally: dict[str, float]) -> str:
        import openai

        e = self.endpoint
        last = "no attempt"
        timeouts = 0
        attempt = -1
        while attempt < e.max_retries:
            attempt += 1
            kwargs: dict[str, Any] = {"model": e.model, "messages": messages, "temperature": e.temperature,
                                      "max_tokens": e.max_tokens}
            if e.seed is not None:
                kwargs["seed"] = e.seed
            if self._structured:
                kwargs["response_format"] = {"type": "json_schema",
                                             "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
            start = time.perf_counter()
            tally["calls"] += 1
            try:
                response = await self._client().chat.completions.create(**kwargs)
            except openai.BadRequestError as error:
                if self._structured and "response_format" in str(error):
                    self._structured = False  # this server has no structured output: ask plainly
                    attempt -= 1
                    continue
                tally["failures"] += 1
                raise JudgeError(f"judge {self.name!r}: the endpoint refused the request: {error}") from None
            except (openai.APITimeoutError, openai.APIConnectionError, openai.RateLimitError,
                    openai.InternalServerError) as error:
                last = _describe(error)
                timeouts += isinstance(error, openai.APITimeoutError)
                if attempt < e.max_retries:
                    tally["retries"] += 1
                    await asyncio.sleep(_delay(error, e.backoff * 2 ** attempt))
                continue
            except openai.APIStatusError as error:
                tally["failures"] += 1
                raise JudgeError(f"judge {self.name!r}: {_describe(error)}") from None
            finally:
                tally["latency_s"] += time.perf_counter() - start
            usage = getattr(response, "usage", None)
            tally["tokens"] += float(getattr(usage, "total_tokens", 0) or 0)
            if not response.choices:
                last = "the reply had no choices"
                continue
            return response.choices[0].message.content or ""
        tally["failures"] += 1
        raise JudgeError(f"judge {self.name!r}: {e.base_url} {_gave_up(e, timeouts)}; last: {last}")

    def _client(self):
        """One AsyncOpenAI client per event loop (its connection pool belongs to that loop)."""
        import openai

        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            e = self.endpoint
            client = openai.AsyncOpenAI(base_url=e.base_url, api_key=e.api_key, timeout=e.timeout, max_retries=0)
            self._clients[loop] = client
        return client


def _gave_up(e: Endpoint, timeouts: int) -> str:
    """Why a call failed for good, in the words the step's output shows: "timed out after 60 s
    (3 retries)" when every try timed out, else how many tries failed and how many timed out."""
    tries = e.max_retries + 1
    retries = f"{e.max_retries} retr{'y' if e.max_retries == 1 else 'ies'}"
    if timeouts == tries:
        return f"timed out after {e.timeout:g} s ({retries})"
    timed_out = f", {timeouts} timed out after {e.timeout:g} s" if timeouts else ""
    return f"failed {tries} times ({retries}{timed_out})"


def _describe(error: Exception) -> str:
    status = getattr(error, "status_code", None)
    return f"HTTP {status}: {error}" if status else f"{type(error).__name__}: {error}"


def _delay(error: Exception, default: float) -> float:
    response = getattr(error, "response", None)
    header = response.headers.get("retry-after") if response is not None else None
    try:
        return min(30.0, max(default, float(header))) if header else default
    except ValueError:
        return default


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_json_object(text: str) -> dict:
    """Exactly one JSON object (a surrounding markdown code fence is tolerated); else ReplyError."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        reply = json.loads(body)
    except json.JSONDecodeError as error:
        raise ReplyError(f"not valid JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(reply, dict):
        raise ReplyError(f"expected a JSON object, got {type(reply).__name__}")
    return reply


def number_in(reply: dict, key: str, low: float, high: float) -> float:
    """``reply[key]`` as a number within [low, high], or ReplyError saying what is wrong."""
    value = reply.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyError(f"{key!r} must be a number from {low:g} to {high:g}, got {value!r}")
    if not low <= value <= high:
        raise ReplyError(f"{key!r} must be from {low:g} to {high:g}, got {value:g}")
    return float(value)
