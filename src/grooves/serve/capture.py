"""Trajectory capture: train on rollouts that user code made with the ``openai`` client.

Wrap a client in a ``Recorder`` and call ``recorder.create(...)`` where the code would call
``client.chat.completions.create(...)``. The recorder asks ``grooves serve`` for the exact
token ids (``return_token_ids``) and turns every choice into a ``Trajectory`` as the
built-in sampler would make it: the server's prompt and completion ids, its logprobs, and
``metadata["policy_step"]``, the adapter step that produced it (0 for the base model).

For an agent that makes several calls in one episode, ``episode()`` merges the calls into
one trajectory when each call's prompt extends the previous call's prompt and completion
token for token: the tokens in between (tool results, user turns) get mask 0, so only the
model's own tokens are trained. Where a prompt does not extend the turns before it (a turn
cut at ``max_tokens`` whose text the chat template re-tokenises differently, a template that
drops a separator), the episode is trained up to the break and marked
``metadata["prefix_break"]`` (counted in ``rollout/prefix_breaks``, as the built-in rollout
counts them), so one cut turn never costs the rest of its group.

``AsyncRecorder`` is the same over an ``openai.AsyncOpenAI`` client. ``TokenIdsByDefault``
wraps a server's app for clients that cannot ask for the ids (ART's managed client): see there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from grooves.types import Group, Trajectory


class CaptureError(RuntimeError):
    """A response without grooves' token ids, or turns that cannot be merged."""


@dataclass
class RecordedCall:
    messages: list[dict[str, Any]]
    response: Any  # an openai ChatCompletion

    @property
    def extension(self) -> dict[str, Any]:
        extension = (self.response.model_extra or {}).get("grooves")
        if not extension:
            raise CaptureError("the response has no 'grooves' token ids: is the client talking to grooves serve?")
        return extension

    def trajectories(self) -> list[Trajectory]:
        """One trajectory per choice."""
        extension = self.extension
        out = []
        for choice in self.response.choices:
            ids = (choice.model_extra or {}).get("grooves") or {}
            if "completion_token_ids" not in ids:
                raise CaptureError("a choice has no 'grooves.completion_token_ids'")
            message = choice.message.model_dump(exclude_none=True)
            out.append(Trajectory(
                messages=[*self.messages, message],
                prompt_ids=list(extension["prompt_token_ids"]),
                completion_ids=list(ids["completion_token_ids"]),
                completion_mask=[1] * len(ids["completion_token_ids"]),
                logprobs=list(ids["completion_logprobs"]),
                finish_reason=choice.finish_reason,
                metadata={"policy_step": extension.get("adapter_step") or 0, "model": self.response.model},
            ))
        return out


@dataclass
class _Calls:
    client: Any
    calls: list[RecordedCall] = field(default_factory=list)

    def trajectories(self) -> list[Trajectory]:
        """Every choice of every recorded call, one trajectory each."""
        return [t for call in self.calls for t in call.trajectories()]

    def group(self, task: dict[str, Any]) -> Group:
        """The recorded trajectories as one group for ``task`` (e.g. one call with ``n = G``)."""
        return Group(task=task, trajectories=self.trajectories())

    def episode(self, on_break: Literal["cut", "raise"] = "cut") -> Trajectory:
        """The recorded calls (first choice of each) as one multi-turn trajectory; see ``merge_turns``."""
        return merge_turns([call.trajectories()[0] for call in self.calls], on_break=on_break)


def _with_token_ids(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**(kwargs.pop("extra_body", None) or {}), "return_token_ids": True}


class Recorder(_Calls):
    """Records chat completions made through an ``openai.OpenAI`` client."""

    def create(self, **kwargs):
        """``client.chat.completions.create(**kwargs)``, asking for token ids and recording the call."""
        response = self.client.chat.completions.create(extra_body=_with_token_ids(kwargs), **kwargs)
        self.calls.append(RecordedCall(list(kwargs["messages"]), response))
        return response


class AsyncRecorder(_Calls):
    """Records chat completions made through an ``openai.AsyncOpenAI`` client."""

    async def create(self, **kwargs):
        """``await client.chat.completions.create(**kwargs)``, asking for token ids and recording the call."""
        response = await self.client.chat.completions.create(extra_body=_with_token_ids(kwargs), **kwargs)
        self.calls.append(RecordedCall(list(kwargs["messages"]), response))
        return response


def merge_turns(turns: list[Trajectory], on_break: Literal["cut", "raise"] = "raise") -> Trajectory:
    """One trajectory from consecutive turns whose prompts extend each other token for token.

    A turn whose prompt does not extend the turns before it is a break: ``on_break="raise"``
    raises ``CaptureError``; ``"cut"`` keeps the turns before it, sets ``metadata["prefix_break"]``
    and records the turn and the first diverging token (``metadata["prefix_break_at"]``).
    """
    if not turns:
        raise CaptureError("no turns to merge")
    first = turns[0]
    ids = list(first.completion_ids)
    mask = list(first.completion_mask)
    logprobs = list(first.logprobs)
    context = first.prompt_ids + first.completion_ids
    kept, broken = [first], None
    for number, turn in enumerate(turns[1:], start=2):
        if turn.prompt_ids[: len(context)] != context:
            if on_break == "raise":
                raise CaptureError(f"turn {number}'s prompt does not extend the previous turns token for token "
                                   f"(the chat template re-rendered them); train on the turns separately")
            broken = _divergence(number, context, turn.prompt_ids)
            break
        between = turn.prompt_ids[len(context):]  # tool results, user turns, the next assistant header
        ids += between + turn.completion_ids
        mask += [0] * len(between) + turn.completion_mask
        logprobs += [0.0] * len(between) + turn.logprobs
        context = turn.prompt_ids + turn.completion_ids
        kept.append(turn)
    last = kept[-1]
    metadata = {**first.metadata, "policy_step": min(t.metadata.get("policy_step", 0) for t in kept),
                "turns": len(kept)}
    if broken is not None:
        metadata.update(prefix_break=True, prefix_break_at=broken, turns_sampled=len(turns))
    return Trajectory(messages=turns[-1].messages, prompt_ids=list(first.prompt_ids), completion_ids=ids,
                      completion_mask=mask, logprobs=logprobs, finish_reason=last.finish_reason, metadata=metadata)


def _divergence(turn: int, context: list[int], prompt: list[int]) -> dict[str, Any]:
    """Where a turn's prompt leaves the tokens before it: the turn, the index and a few ids each side."""
    at = next((i for i, (a, b) in enumerate(zip(context, prompt)) if a != b), min(len(context), len(prompt)))
    return {"turn": turn, "index": at, "expected": context[at: at + 4], "got": prompt[at: at + 4]}


class TokenIdsByDefault:
    """ASGI middleware: a non-streamed chat completion returns grooves' token ids unless the request
    sets ``return_token_ids`` itself, and each choice's ``grooves`` block also carries its prompt's
    ids and the adapter step, so a client that keeps only the ``Choice`` (an ART ``Trajectory``)
    still has the exact tokens the server used. A body over ``max_body_bytes`` passes untouched
    (the server's edge refuses it)."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        chunks, more, size = [], True, 0
        while more and size <= self.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        body = b"".join(chunks)
        patched = None if more else _ask_for_ids(body)
        if patched is None:
            return await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": more}],
                                                 receive), send)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(patched)).encode())]}
        await self.app(scope, _replay([{"type": "http.request", "body": patched, "more_body": False}], receive),
                       _ids_per_choice(send))


def _ask_for_ids(body: bytes) -> bytes | None:
    """The body with ``return_token_ids: true`` added, or None to leave it as it is."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("stream") or "return_token_ids" in data:
        return None
    return json.dumps({**data, "return_token_ids": True}).encode()


def _replay(messages: list[dict], receive):
    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()
    return replayed


def _ids_per_choice(send):
    """Copy the reply's prompt ids and adapter step into each choice's ``grooves`` block."""
    start, parts = None, []

    async def sending(message: dict) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(parts)
        try:
            data = json.loads(body)
            extension = data["grooves"]
            for choice in data["choices"]:
                choice["grooves"].update(prompt_token_ids=extension["prompt_token_ids"],
                                         adapter_step=extension["adapter_step"])
            body = json.dumps(data).encode()
        except (ValueError, KeyError, TypeError):
            pass  # an error reply: as it is
        headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return sending
