"""Multi-turn rollouts: the policy talks to an env, tool calls and results, until it answers.

All rollouts of a call advance in rounds. Each round, every unfinished rollout's next turn
goes into one batch of the sampler (G rollouts of a task, and all tasks of a step, decode
together); then the envs answer every turn concurrently on an event loop, tools running in
worker threads with a per-call timeout, so a slow tool holds up only its own rollout's
answer, not the others' tool calls.

Token bookkeeping: a rollout's ``Trajectory`` keeps the exact ids the sampler produced.
``prompt_ids`` is the first prompt (system, tools, user); ``completion_ids`` is everything
after it: each model turn as sampled (mask 1, with the sampler's logprobs), then the
template's tokens for the env's reply up to the next assistant header (mask 0, logprob 0).
A turn cut by its token budget gets the end-of-turn token appended with mask 0. Only the
model's own tokens ever get gradient.

A rollout ends on an answer (a turn without tool calls, or an answer tool), at
``env.max_turns`` turns, or when its generated tokens reach ``env.max_tokens``
(``finish_reason = "length"``, which DAPO's overlong masking treats as truncated).
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grooves.envs.base import Env, State
from grooves.policy.decoding import Constraint, Past, Row
from grooves.types import Group, Task, Trajectory


@dataclass
class Turn:
    """One generated assistant turn."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    past: Past | None = None  # the KV of the prompt and this turn's tokens but the last (sampler_generate)
    prefix_break: bool = False  # the sampler read other prompt ids than the conversation's (an engine)


Generate = Callable[[list[list[int]], list[int], list["Past | None"]], list[Turn]]
"""``generate(prompts_as_ids, token_budgets, pasts) -> turns``: the policy side of a rollout;
``pasts[i]`` is the KV of a prefix of ``prompts[i]`` from rollout i's previous turn, or None."""


def sampler_generate(policy, temperature: float = 1.0, top_p: float = 1.0,
                     generator: torch.Generator | None = None, reuse_kv: bool = True,
                     constrain: Callable[[int, list[int]], Constraint | None] | None = None) -> Generate:
    """The policy's batching sampler as a ``Generate`` (every row one rollout's next turn). With
    ``reuse_kv`` each turn keeps its KV cache for the rollout's next turn, so only the env's reply
    and the new turn go through the model, not the whole conversation again. ``constrain(row,
    prompt_ids)``: a constraint for a row's turn (a benchmark forces scripted turns with it)."""
    sampler = policy.sampler()

    def generate(prompts: list[list[int]], budgets: list[int], pasts: list[Past | None] | None = None) -> list[Turn]:
        pasts = pasts if reuse_kv and pasts is not None else [None] * len(prompts)
        rows = [Row(p, temperature, top_p, b, (), generator, past=past, keep_past=reuse_kv,
                    constraint=constrain(i, p) if constrain is not None else None)
                for i, (p, b, past) in enumerate(zip(prompts, budgets, pasts))]
        return [Turn(o.text, o.token_ids, o.logprobs, o.finish_reason, o.past, o.prefix_break)
                for o in sampler.decode_rows(rows)]

    return generate


def start(policy, env: Env, task: Task, seed: int = 0) -> State:
    """A fresh rollout state with its first prompt tokenised (tools in the chat template)."""
    state = env.reset(task, seed)
    state.tokens.prompt_ids = policy.chat_ids(state.messages, tools=env.tool_schemas() or None)
    return state


def advance(policy, env: Env, states: list[State], generate: Generate, turn_tokens: int) -> None:
    """One round: the next model turn of every unfinished state (one batch), then the envs' replies."""
    active = [s for s in states if not env.is_done(s)]
    if not active:
        return
    budgets = [max(1, min(turn_tokens, env.max_tokens - s.tokens.generated)) for s in active]
    turns = generate([s.tokens.prompt_ids + s.tokens.ids for s in active], budgets, [s.past for s in active])
    answering = []
    for state, turn in zip(active, turns):
        if turn.prefix_break:
            state.counters["prefix_breaks"] += 1
            if state.tokens.break_at is None:  # trained up to here: later turns sampled on another context
                state.tokens.break_at = len(state.tokens.ids)
        state.tokens.add(turn.token_ids, turn.logprobs, generated=True)
        state.past = turn.past
        if turn.finish_reason == "length":  # close the turn as the template would
            state.tokens.add([policy.end_of_turn_id], None, generated=False)
            if state.tokens.generated >= env.max_tokens:  # cut by the rollout's budget: no answer to read
                state.turns += 1
                state.messages.append({"role": "assistant", "content": turn.text, "raw": turn.text})
                env.finish(state, None, "max_tokens")
                continue
        answering.append((state, turn.text))
    replies = _run(_respond_all(env, [s for s, _ in answering], [t for _, t in answering]))
    for (state, _), reply in zip(answering, replies):
        if env.is_done(state):
            continue
        if state.tokens.generated >= env.max_tokens:
            env.finish(state, None, "max_tokens")
        elif state.turns >= env.max_turns:
            env.finish(state, None, "max_turns")
        else:
            state.tokens.add(policy.continuation_ids(reply), None, generated=False)
    for state in active:
        if env.is_done(state):
            state.past = None  # a finished rollout's cache is memory for nothing


async def _respond_all(env: Env, states: list[State], texts: list[str]):
    return await asyncio.gather(*(env.respond(s, t) for s, t in zip(states, texts)))


def _run(coroutine):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    raise RuntimeError("env rollouts drive their own event loop; call them from synchronous code")


def run_states(policy, env: Env, states: list[State], generate: Generate, turn_tokens: int,
               on_round: Callable[[int, int, int], None] | None = None) -> int:
    """Advance ``states`` until every one is done; ``on_round(round, done, total)`` after each round
    (a round of 40 agent rollouts can take a minute on a CPU: progress wants to know). Returns the
    number of rounds."""
    rounds = 0
    while any(not env.is_done(s) for s in states):
        advance(policy, env, states, generate, turn_tokens)
        rounds += 1
        if on_round is not None:
            on_round(rounds, sum(env.is_done(s) for s in states), len(states))
    return rounds


def trajectory(env: Env, state: State, policy_step: int = 0) -> Trajectory:
    """A finished rollout as training data, with ``env.score`` in ``metadata["env_scores"]`` and of the
    env's data only what ``env.stored_data`` keeps (a run stores every trajectory)."""
    scores = {name: float(value) for name, value in env.score(state).items()}
    return Trajectory(
        messages=state.messages, prompt_ids=list(state.tokens.prompt_ids), completion_ids=list(state.tokens.ids),
        completion_mask=list(state.tokens.trained_mask()), logprobs=list(state.tokens.logprobs),
        finish_reason="length" if state.finish == "max_tokens" else "stop",
        metadata={"task_id": state.task.get("id"), "policy_step": policy_step, "env": env.name,
                  "env_scores": scores, "state": {"answer": state.answer, "finish": state.finish,
                                                  "turns": state.turns, "counters": dict(state.counters),
                                                  "data": env.stored_data(state)}})


def env_groups(policy, env: Env, tasks: list[Task], n: int, generate: Generate, turn_tokens: int,
               policy_step: int = 0, seed: int = 0,
               on_round: Callable[[int, int, int], None] | None = None, wave: int | None = None) -> list[Group]:
    """``n`` rollouts of each task, all advanced together; one ``Group`` per task. With ``wave``,
    the rollouts of ``wave`` tasks at a time: a wave runs to its end before the next starts, so at
    most that many tasks' rollouts hold a KV cache (a run validating 192 helpdesk tasks at once
    reached 18 GB; in waves of 64, its evaluation peaked at 11)."""
    states = [start(policy, env, task, seed) for task in tasks for _ in range(n)]
    try:
        size, rounds = max(1, wave or len(tasks)) * n, 0
        for first in range(0, len(states), size):  # progress counts the waves' rounds and rollouts as one
            report = None if on_round is None else (
                lambda r, done, _, first=first, before=rounds: on_round(before + r, first + done, len(states)))
            rounds += run_states(policy, env, states[first: first + size], generate, turn_tokens, report)
        groups = []
        for k, task in enumerate(tasks):
            own = states[k * n: (k + 1) * n]
            groups.append(Group(task=task, trajectories=[trajectory(env, s, policy_step) for s in own]))
        return groups
    finally:
        for state in states:
            env.close(state)


def env_metrics(groups: list[Group], prefix: str = "env") -> dict[str, float]:
    """Per-rollout means of the env counters (tool calls, each kind of error), turns, and
    the share of rollouts by how they ended."""
    states = [t.metadata["state"] for g in groups for t in g.trajectories if "state" in t.metadata]
    if not states:
        return {}
    totals: Counter = Counter()
    for state in states:
        totals.update(state["counters"])
    metrics = {f"{prefix}/{key}": value / len(states) for key, value in sorted(totals.items())}
    metrics[f"{prefix}/turns"] = statistics.fmean(s["turns"] for s in states)
    for reason in ("answer", "max_turns", "max_tokens"):
        metrics[f"{prefix}/finish/{reason}"] = sum(s["finish"] == reason for s in states) / len(states)
    return metrics
