"""Model-free rollouts: a scripted list of assistant turns played through an env.

``replay(env, task, turns)`` answers each turn exactly as a rollout would (tool calls parsed
by the project's one parser, run with their timeouts, errors answered and counted), then
scores the final state. It is how an env's oracle is checked against its own scores, and
how ``demonstrations`` turn an env's expert transcripts (``Env.demonstrate``) into SFT data:
only demonstrations whose replay earns every score in full are kept, so a demo is never
wrong by the env's own measure. ``collect`` gathers demonstrations from a model instead
(any OpenAI-compatible endpoint, ``endpoint_chat``), keeping rollouts that score well enough.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from grooves.envs.base import Env, State
from grooves.policy.tools import tool_call_text
from grooves.types import Message, Task


@dataclass
class Replay:
    """A scripted rollout's end: its transcript, scores, and how it ended."""

    task: Task
    messages: list[Message]
    scores: dict[str, float]
    finish: str  # "answer", "max_turns", or "script_ended" when the turns ran out first
    turns: int
    counters: dict[str, int] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # the env's state.data at the end

    @property
    def full_score(self) -> bool:
        return all(value >= 1.0 - 1e-9 for value in self.scores.values())

    def record(self) -> dict[str, Any]:
        """A JSON line of an SFT demo file: the OpenAI messages plus where they came from."""
        messages = [{k: v for k, v in m.items() if k != "raw"} for m in self.messages]
        return {"task_id": self.task.get("id"), "messages": messages, "scores": self.scores}


def replay(env: Env, task: Task, turns: list[str], seed: int = 0) -> Replay:
    """Play ``turns`` (assistant texts, tool calls written as the model would) through ``env``."""
    state = env.reset(task, seed)
    try:
        asyncio.run(_play(env, state, turns))
        if not env.is_done(state):
            env.finish(state, None, "max_turns" if state.turns >= env.max_turns else "script_ended")
        scores = {name: float(value) for name, value in env.score(state).items()}
        return Replay(task, list(state.messages), scores, state.finish, state.turns, dict(state.counters),
                      dict(state.data))
    finally:
        env.close(state)


async def _play(env: Env, state: State, turns: list[str]) -> None:
    for text in turns:
        if env.is_done(state) or state.turns >= env.max_turns:
            return
        await env.respond(state, text)


Chat = Callable[[list[Message], list[dict[str, Any]]], Awaitable[str]]
"""``chat(messages, tools) -> the assistant's next turn as text`` (tool calls written out)."""


def endpoint_chat(base_url: str, model: str, api_key: str | None = None, temperature: float = 0.0,
                  max_tokens: int = 256, seed: int | None = 0) -> Chat:
    """A ``Chat`` on any OpenAI-compatible endpoint: the conversation and tools go as OpenAI
    messages; the reply's tool calls are written back as text in the rendering's call format."""
    from openai import AsyncOpenAI

    clients: dict[Any, AsyncOpenAI] = {}  # one per event loop: each collect() runs its own

    async def chat(messages: list[Message], tools: list[dict[str, Any]]) -> str:
        loop = asyncio.get_running_loop()
        if loop not in clients:
            clients.clear()
            clients[loop] = AsyncOpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none")
        clean = [{k: v for k, v in m.items() if k != "raw"} for m in messages]
        reply = await clients[loop].chat.completions.create(model=model, messages=clean, tools=tools or None,
                                                     temperature=temperature, max_tokens=max_tokens, seed=seed)
        message = reply.choices[0].message
        calls = [{"function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in message.tool_calls or []]
        return assistant_turn_text(message.content or "", calls)

    return chat


def assistant_turn_text(content: str, calls: list[dict[str, Any]]) -> str:
    return f"{content}\n{''.join(tool_call_text(c) for c in calls)}".strip()


def collect(env: Env, tasks: list[Task], chat: Chat, min_score: float = 1.0, seed: int = 0,
            concurrency: int = 4) -> tuple[list[Replay], dict[str, int]]:
    """Roll ``tasks`` out with a model behind ``chat`` (a larger one, say) and keep the rollouts whose
    weighted score (the env's weights, as a share of their sum) is at least ``min_score``."""

    async def one(task: Task, gate: asyncio.Semaphore) -> Replay:
        async with gate:
            state = env.reset(task, seed)
            try:
                while not env.is_done(state) and state.turns < env.max_turns:
                    await env.respond(state, await chat(state.messages, env.tool_schemas()))
                if not env.is_done(state):
                    env.finish(state, None, "max_turns")
                scores = {name: float(value) for name, value in env.score(state).items()}
                return Replay(task, list(state.messages), scores, state.finish, state.turns, dict(state.counters),
                              dict(state.data))
            finally:
                env.close(state)

    async def every() -> list[Replay]:
        gate = asyncio.Semaphore(concurrency)
        return await asyncio.gather(*(one(t, gate) for t in tasks))

    results = asyncio.run(every())
    total = sum(env.weights.values()) or 1.0
    kept = [r for r in results if sum(env.weights.get(k, 0.0) * v for k, v in r.scores.items()) / total >= min_score]
    return kept, {"kept": len(kept), "below_min_score": len(results) - len(kept)}


def demonstrations(env: Env, tasks: list[Task], seed: int = 0) -> tuple[list[Replay], dict[str, int]]:
    """The expert replays of ``tasks`` that earn every score in full, and counts of the rest
    (``no_demo``: the env had none for the task; ``imperfect``: its replay lost points)."""
    kept, counts = [], {"kept": 0, "no_demo": 0, "imperfect": 0}
    for task in tasks:
        turns = env.demonstrate(task)
        if turns is None:
            counts["no_demo"] += 1
            continue
        result = replay(env, task, turns, seed)
        if result.full_score:
            kept.append(result)
            counts["kept"] += 1
        else:
            counts["imperfect"] += 1
    return kept, counts
