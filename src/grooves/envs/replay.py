"""Model-free rollouts: a scripted list of assistant turns played through an env.

``replay(env, task, turns)`` answers each turn exactly as a rollout would (tool calls parsed
by the project's one parser, run with their timeouts, errors answered and counted), then
scores the final state. It is how an env's oracle is checked against its own scores, and
how ``demonstrations`` turn an env's expert transcripts (``Env.demonstrate``) into SFT data:
only demonstrations whose replay earns every score in full are kept, so a demo is never
wrong by the env's own measure.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from grooves.envs.base import Env, State
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
        return Replay(task, list(state.messages), scores, state.finish, state.turns, dict(state.counters))
    finally:
        env.close(state)


async def _play(env: Env, state: State, turns: list[str]) -> None:
    for text in turns:
        if env.is_done(state) or state.turns >= env.max_turns:
            return
        await env.respond(state, text)


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
