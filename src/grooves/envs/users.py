"""The user's side of a conversation: after an assistant turn without tool calls, an env may
answer as the user instead of ending the rollout.

``Env.user_turn(state, text)`` returns the user's next message, or None to end the rollout
with ``text`` as the answer. By default it asks ``env.user``, if one is set:

- ``ScriptedUser()``: the task's ``user_turns`` list, one message per turn, then the end;
- ``LLMUser(base_url, model)``: a simulated user served by any OpenAI-compatible endpoint
  (``grooves serve`` included). It sees the conversation from the user's side (the agent's
  words as the other party's, tool traffic left out), follows its instructions plus the
  task's ``user_instructions``, and ends the conversation by writing ``stop`` (``###STOP###``).

Where the user has got to lives in ``state.data`` and ``state.messages``, so a snapshot
taken between turns resumes the same conversation.

``make_user(spec)`` builds one from a config's ``[env] user``: ``"scripted"``, or a table
``{kind = "scripted", key = ...}`` or ``{kind = "llm", base_url = ..., model = ..., ...}``.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Awaitable, Callable
from typing import Any

from grooves.envs.base import State
from grooves.types import Message

UserFn = Callable[[State, str], Awaitable[str | None]]

USER_PROMPT = ("You are a customer talking to a support agent. Write only your own next message, short and "
               "in your own words. When your request is handled, or cannot be, write {stop} and nothing else.")


class ScriptedUser:
    """Replies from the task's ``user_turns`` (a list of strings), in order; None when they run out."""

    def __init__(self, key: str = "user_turns"):
        self.key = key

    async def __call__(self, state: State, text: str) -> str | None:
        said = state.data.get("user_turns_said", 0)
        lines = state.task.get(self.key) or []
        if said >= len(lines):
            return None
        state.data["user_turns_said"] = said + 1
        return str(lines[said])


class LLMUser:
    """A simulated user on an OpenAI-compatible endpoint (temperature 0 and a seed by default)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, instructions: str = USER_PROMPT,
                 stop: str = "###STOP###", temperature: float = 0.0, max_tokens: int = 200, seed: int | None = 0,
                 timeout: float = 60.0):
        self.base_url, self.model = base_url, model
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "none"  # local servers need none
        self.instructions, self.stop = instructions.format(stop=stop), stop
        self.sampling = {"temperature": temperature, "max_tokens": max_tokens, "seed": seed}
        self.timeout = timeout

    @functools.cached_property
    def client(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout)

    def messages(self, state: State) -> list[Message]:
        """The conversation as the simulated user sees it: its own turns as ``assistant``."""
        system = self.instructions
        if state.task.get("user_instructions"):
            system += f"\n\nYour situation: {state.task['user_instructions']}"
        out: list[Message] = [{"role": "system", "content": system}]
        for message in state.messages:
            content = message.get("content") or ""
            if message.get("role") == "user":
                out.append({"role": "assistant", "content": content})
            elif message.get("role") == "assistant" and content.strip():
                out.append({"role": "user", "content": content})
        return out

    async def __call__(self, state: State, text: str) -> str | None:
        reply = await self.client.chat.completions.create(model=self.model, messages=self.messages(state),
                                                          **self.sampling)
        content = (reply.choices[0].message.content or "").strip()
        state.counters["user/llm_calls"] += 1
        return None if not content or self.stop in content else content


USER_KINDS = {"scripted": ScriptedUser, "llm": LLMUser}


def make_user(spec: str | dict[str, Any]) -> ScriptedUser | LLMUser:
    """A user from a config's ``[env] user``; a bad spec is a ``ValueError`` naming the setting."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"user: {spec!r} is neither a kind ({', '.join(USER_KINDS)}) nor a table")
    settings = dict(spec)
    kind = settings.pop("kind", None)
    if kind not in USER_KINDS:
        raise ValueError(f"user.kind: {kind!r}; allowed: {', '.join(USER_KINDS)}")
    cls = USER_KINDS[kind]
    parameters = inspect.signature(cls).parameters
    unknown = sorted(set(settings) - set(parameters))
    if unknown:
        raise ValueError(f"user.{unknown[0]}: not a setting when kind = {kind!r}; allowed: {', '.join(parameters)}")
    missing = [n for n, p in parameters.items() if p.default is inspect.Parameter.empty and n not in settings]
    if missing:
        raise ValueError(f"user.{missing[0]}: required when kind = {kind!r}")
    return cls(**settings)
