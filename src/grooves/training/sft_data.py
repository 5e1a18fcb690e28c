"""SFT examples: chat transcripts rendered into tokens exactly as a rollout renders them.

A rollout's tokens are the first prompt (``Policy.chat_ids``: system, tools, user), then for
each model turn the text as generated plus the end-of-turn token (trained), then the
template's tokens for the env's reply up to the next assistant header
(``Policy.continuation_ids``; not trained). ``render_transcript`` builds the same stream from
messages, so what SFT teaches is what RL later samples and scores, token for token; an
assistant turn's text is its ``raw`` text when the transcript kept it (a rollout's), else its
content followed by its tool calls in the rendering's call format.

Sources: a chat JSONL file (OpenAI messages, with assistant ``tool_calls`` and ``tool``
messages, and optional ``tools``), an env's demonstrations (``env:NAME``), or the
trajectories of a finished run (``run:NAME``) whose reward reaches ``min_reward``
(rejection-sampling fine-tuning), whose exact token ids are used as they were sampled.

``fit_examples`` applies ``max_seq_length``: an example longer than it keeps its first
``max_seq_length`` tokens (the prompt stays whole, the end of the transcript goes); one whose
prompt alone reaches the limit, or that keeps no trained token, is skipped. Both are counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from grooves.policy.policy import Policy
from grooves.policy.tools import tool_call_text
from grooves.tasks.sources import TaskSourceError, load_tasks, split_tasks
from grooves.types import Message, Trajectory


def assistant_text(message: Message) -> str:
    """The text a model writes for an assistant message (its own ``raw`` text when known)."""
    if message.get("raw") is not None:
        return message["raw"]
    calls = "".join(tool_call_text(c) for c in message.get("tool_calls") or [])
    return f"{message.get('content') or ''}\n{calls}".strip()


def render_transcript(policy: Policy, messages: list[Message], tools: list[dict] | None = None) -> Trajectory:
    """A transcript as a training example: the loss mask is 1 on the assistant turns' tokens."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ValueError("the transcript has no assistant message to learn from")
    ids: list[int] = []
    mask: list[int] = []
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for k, index in enumerate(turns):
        own = policy.tokenizer.encode(assistant_text(messages[index]), add_special_tokens=False)
        own.append(policy.end_of_turn_id)
        ids += own
        mask += [1] * len(own)
        if k + 1 < len(turns):  # the env's reply up to the next assistant header; none after the last turn
            between = messages[index + 1: turns[k + 1]]
            inserted = policy.continuation_ids(between)
            ids += inserted
            mask += [0] * len(inserted)
    return Trajectory(messages=list(messages), prompt_ids=policy.chat_ids(messages[:first], tools=tools),
                      completion_ids=ids, completion_mask=mask, logprobs=[0.0] * len(ids))


def load_examples(policy: Policy, source: str, *, heldout: str | None = None, heldout_fraction: float = 0.1,
                  min_reward: float | None = None, limit: int | None = None, seed: int = 0,
                  runs: str | Path | None = None, env_options: dict[str, Any] | None = None,
                  ) -> tuple[list[Trajectory], list[Trajectory]]:
    """Train and held-out examples of a source (see the module docstring)."""
    if source.startswith("env:"):
        return _env_examples(policy, source[4:], limit, seed, env_options or {})
    if source.startswith("run:"):
        examples = _run_examples(source[4:], min_reward, runs)
        return _split(examples, heldout_fraction, seed, limit)
    rows = load_tasks(source)
    if heldout is not None:
        return _render_rows(policy, rows, source)[:limit], _render_rows(policy, load_tasks(heldout), heldout)
    train, held = split_tasks(rows, heldout_fraction, seed)
    return _render_rows(policy, train, source)[:limit], _render_rows(policy, held, source)


def _render_rows(policy: Policy, rows: list[dict], source: str) -> list[Trajectory]:
    out = []
    for row in rows:
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise TaskSourceError(f"{source}: row {row['id']} needs a 'messages' list of {{role, content}} objects")
        try:
            example = render_transcript(policy, messages, row.get("tools"))
        except ValueError as error:
            raise TaskSourceError(f"{source}: row {row['id']}: {error}") from None
        example.metadata["task_id"] = row["id"]
        out.append(example)
    return out


def _env_examples(policy: Policy, name: str, limit: int | None, seed: int, options: dict[str, Any]):
    from grooves.envs import load_env
    from grooves.envs.replay import demonstrations

    env = load_env(name, **options)
    tools = env.tool_schemas() or None
    sets = []
    for split, n in (("train", limit), ("heldout", None)):
        kept, _ = demonstrations(env, env.tasks(split, n, seed=seed), seed)
        examples = [render_transcript(policy, r.messages, tools) for r in kept]
        for example, result in zip(examples, kept):
            example.metadata["task_id"] = result.task["id"]
        sets.append(examples)
    return sets[0], sets[1]


def _run_examples(name: str, min_reward: float | None, runs: str | Path | None) -> list[Trajectory]:
    from grooves.policy.checkpoints import runs_root
    from grooves.runs.store import RunStore

    run_dir = runs_root(runs) / name
    if not (run_dir / "run.sqlite").exists():
        raise TaskSourceError(f"run:{name}: no run {name!r} under {runs_root(runs)}")
    store = RunStore(run_dir)
    try:
        records = store.trajectory_records(split="train")
    finally:
        store.close()
    floor = -float("inf") if min_reward is None else min_reward
    kept = [r.trajectory for r in records if r.trajectory.reward == r.trajectory.reward and r.trajectory.reward >= floor]
    if not kept:
        raise TaskSourceError(f"run:{name}: no trajectory has a reward of at least {floor}")
    for record in records:
        record.trajectory.metadata["task_id"] = record.task_id
        record.trajectory.logprobs = [0.0] * len(record.trajectory.completion_ids)
    return kept


def _split(examples: list[Trajectory], fraction: float, seed: int, limit: int | None):
    rows = [{"id": str(t.metadata.get("task_id")), "example": t} for t in examples]  # a task stays on one side
    train, held = split_tasks(rows, fraction, seed)
    return [r["example"] for r in train][:limit], [r["example"] for r in held]


@dataclass(frozen=True)
class Fit:
    """What ``max_seq_length`` did to a set of examples, and how many are over the model's context."""

    examples: int  # examples given
    cut: int  # examples shortened to max_seq_length tokens
    skipped: int  # examples left out: the prompt alone reaches the limit, or no trained token is left
    tokens_cut: int  # tokens dropped from the shortened examples (skipped ones not counted)
    loss_tokens_cut: int  # trained tokens (mask 1) lost, from shortened and skipped examples
    longest: int  # the longest example before cutting (tokens)
    over_context: int = 0  # without max_seq_length: examples longer than the model's context
    context: int = 0

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/examples_cut": float(self.cut), f"{prefix}/examples_skipped": float(self.skipped),
                f"{prefix}/loss_tokens_cut": float(self.loss_tokens_cut)}

    def sentence(self, what: str, limit: int | None) -> str | None:
        """What a user should read before the first step, or None when nothing happened."""
        if limit is None:
            if not self.over_context:
                return None
            return (f"{what}: {self.over_context} of {self.examples} are longer than the model's context of "
                    f"{self.context} tokens (the longest: {self.longest}); positions past it were never trained "
                    f"and each such example costs minutes on a CPU: set [data] max_seq_length (at most "
                    f"{self.context}) to cut them")
        if not (self.cut or self.skipped):
            return None
        return (f"{what}: {self.cut} of {self.examples} cut to max_seq_length = {limit} tokens "
                f"({self.tokens_cut} tokens, {self.loss_tokens_cut} of them trained), {self.skipped} skipped "
                f"(the longest was {self.longest} tokens)")


def fit_examples(examples: list[Trajectory], max_seq_length: int | None, context: int,
                 ) -> tuple[list[Trajectory], Fit]:
    """The examples within ``max_seq_length`` tokens (prompt + transcript), cut or skipped as the
    module docstring says. Without a limit every example is kept and those over the model's
    ``context`` are counted (``Fit.sentence`` says so); a limit over the context is an error."""
    if max_seq_length is not None and max_seq_length > context:
        raise ValueError(f"data.max_seq_length = {max_seq_length} is over the model's context of {context} tokens")
    longest = max((len(t.prompt_ids) + len(t.completion_ids) for t in examples), default=0)
    if max_seq_length is None:
        over = sum(len(t.prompt_ids) + len(t.completion_ids) > context for t in examples)
        return examples, Fit(len(examples), 0, 0, 0, 0, longest, over, context)
    kept, cut, skipped, tokens_cut, loss_cut = [], 0, 0, 0, 0
    for t in examples:
        room = max_seq_length - len(t.prompt_ids)  # completion tokens that fit
        if room >= len(t.completion_ids):
            kept.append(t)
            continue
        trained_left = sum(t.completion_mask[:room]) if room > 0 else 0
        loss_cut += sum(t.completion_mask) - trained_left
        if trained_left == 0:
            skipped += 1
            continue
        cut += 1
        tokens_cut += len(t.completion_ids) - room
        kept.append(replace(t, completion_ids=t.completion_ids[:room], completion_mask=t.completion_mask[:room],
                            logprobs=t.logprobs[:room], finish_reason="length", metadata=dict(t.metadata)))
    return kept, Fit(len(examples), cut, skipped, tokens_cut, loss_cut, longest, 0, context)
