"""Trajectory capture: train on rollouts that user code made with the ``openai`` client.

Wrap a client in a ``Recorder`` and call ``recorder.create(...)`` where the code would call
``client.chat.completions.create(...)``. The recorder asks ``grooves serve`` for the exact
token ids (``return_token_ids``) and turns every choice into a ``Trajectory`` as the
built-in sampler would make it: the server's prompt and completion ids, its logprobs, and
``metadata["policy_step"]``, the adapter step that produced it (0 for the base model).

For an agent that makes several calls in one episode, ``episode()`` merges the calls into
one trajectory when each call's prompt extends the previous call's prompt and completion
token for token: the tokens in between (tool results, user turns) get mask 0, so only the
model's own tokens are trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
class Recorder:
    """Records chat completions made through an ``openai.OpenAI`` client."""

    client: Any
    calls: list[RecordedCall] = field(default_factory=list)

    def create(self, **kwargs):
        """``client.chat.completions.create(**kwargs)``, asking for token ids and recording the call."""
        extra = {**(kwargs.pop("extra_body", None) or {}), "return_token_ids": True}
        response = self.client.chat.completions.create(extra_body=extra, **kwargs)
        self.calls.append(RecordedCall(list(kwargs["messages"]), response))
        return response

    def trajectories(self) -> list[Trajectory]:
        """Every choice of every recorded call, one trajectory each."""
        return [t for call in self.calls for t in call.trajectories()]

    def group(self, task: dict[str, Any]) -> Group:
        """The recorded trajectories as one group for ``task`` (e.g. one call with ``n = G``)."""
        return Group(task=task, trajectories=self.trajectories())

    def episode(self) -> Trajectory:
        """The recorded calls (first choice of each) as one multi-turn trajectory."""
        return merge_turns([call.trajectories()[0] for call in self.calls])


def merge_turns(turns: list[Trajectory]) -> Trajectory:
    """One trajectory from consecutive turns whose prompts extend each other token for token."""
    if not turns:
        raise CaptureError("no turns to merge")
    first = turns[0]
    ids = list(first.completion_ids)
    mask = list(first.completion_mask)
    logprobs = list(first.logprobs)
    context = first.prompt_ids + first.completion_ids
    for number, turn in enumerate(turns[1:], start=2):
        if turn.prompt_ids[: len(context)] != context:
            raise CaptureError(f"turn {number}'s prompt does not extend the previous turns token for token "
                               f"(the chat template re-rendered them); train on the turns separately")
        between = turn.prompt_ids[len(context):]  # tool results, user turns, the next assistant header
        ids += between + turn.completion_ids
        mask += [0] * len(between) + turn.completion_mask
        logprobs += [0.0] * len(between) + turn.logprobs
        context = turn.prompt_ids + turn.completion_ids
    last = turns[-1]
    return Trajectory(messages=last.messages, prompt_ids=list(first.prompt_ids), completion_ids=ids,
                      completion_mask=mask, logprobs=logprobs, finish_reason=last.finish_reason,
                      metadata={**first.metadata, "policy_step": min(t.metadata.get("policy_step", 0) for t in turns),
                                "turns": len(turns)})
