"""A ``forward_backward`` request run over the positions its loss reads.

Tinker's datums carry every position of a sequence, the prompt included, and the answer holds a
log-prob for each. The loss, though, reads only the positions whose weight (``cross_entropy``)
or advantage (``importance_sampling``, ``ppo``, ``cispo``) is not zero: a zero there multiplies
the position's term to zero, and no gradient flows from it. An RL datum is a prompt of a hundred
or more tokens and a completion of a few dozen, and a group's completions share the prompt.

So the service runs each datum from its first position in the loss (``Datum.start``): the
trainer then reads a prompt shared by a group once, as the in-process step does, and takes the
output head only where the loss is. The positions before it still get their log-probs, as the
Tinker API returns them, without gradient: from the final hidden states the trainer's own forward
computed for a group's shared prompt (``keep_prefix_states``: only the output head runs again), or
where no such prompt covers them (a lone datum, or a context past the shared prompt) from one
forward for each distinct context.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from grooves.policy.logprobs import completion_logprobs, keep_prefix_states, vocab_logprobs
from grooves.training.datums import Datum, DatumBatch, ForwardBackwardOutput

# the loss input whose zeros leave a position out of the loss
_LOSS_VALUES = {"cross_entropy": "weights", "importance_sampling": "advantages", "ppo": "advantages",
                "cispo": "advantages"}


def loss_start(datum: Datum, loss_fn: str) -> int:
    """The first position whose term in ``loss_fn`` can be non-zero (0 when every one can).

    A datum with no such position starts at its last one, so it stays a valid datum of one position."""
    values = getattr(datum, _LOSS_VALUES.get(loss_fn, "weights"))
    if values is None:
        return 0
    first = next((i for i, value in enumerate(values) if value != 0), None)
    return len(datum.tokens) - 1 if first is None else first


def forward_backward(trainer, datums: list[Datum], loss_fn: str, config, backward: bool) -> ForwardBackwardOutput:
    """``trainer.forward_backward`` over each datum's loss positions, with the log-probs of every
    position in the answer (those before the loss computed without gradient)."""
    starts = [max(d.start, loss_start(d, loss_fn)) for d in datums]
    with keep_prefix_states() as kept:
        out = trainer.forward_backward([replace(d, start=s) for d, s in zip(datums, starts, strict=True)], loss_fn,
                                       config, backward=backward)
    if not out.finite:
        return out
    if _dropout_at_work(trainer.policy.causal_lm):
        kept = []
    context = _context_logprobs(trainer, datums, starts, kept)
    out.logprobs = [torch.cat([before, logp]) for before, logp in zip(context, out.logprobs, strict=True)]
    return out


@torch.no_grad()
def _context_logprobs(trainer, datums: list[Datum], starts: list[int], kept: list) -> list[torch.Tensor]:
    """Each datum's log-probs over positions ``d.start .. start - 1`` (its own start: what the answer
    holds before the loss): from ``kept`` prefix states that cover the context, else one forward per
    distinct context."""
    keys = [(tuple(d.tokens[: s]), tuple(d.target_tokens[: s]), d.start) for d, s in zip(datums, starts, strict=True)]
    found: dict[tuple, torch.Tensor] = {}
    distinct = []
    for key in dict.fromkeys(keys):
        tokens, targets, start = key
        if len(tokens) <= start:
            continue
        hidden = _covering(kept, tokens)
        if hidden is None:
            distinct.append(key)
            continue
        logp = vocab_logprobs(trainer.policy.causal_lm, hidden[start: len(tokens)], trainer.temperature)
        found[key] = logp.gather(-1, torch.tensor(targets[start:], device=logp.device)[:, None])[:, 0].cpu()
    if distinct:
        batch = DatumBatch.build([Datum(list(t), list(g), start=s) for t, g, s in distinct], trainer.policy.device)
        lm = trainer.policy.causal_lm
        was_training = lm.training
        lm.eval()
        try:
            logp, _ = completion_logprobs(lm, batch.tokens, trainer.temperature)
        finally:
            lm.train(was_training)
        for row, key in enumerate(distinct):
            found[key] = logp[row, : batch.lengths[row]].cpu()
    return [found.get(key, torch.zeros(0)) for key in keys]


def _covering(kept: list, tokens: tuple[int, ...]) -> torch.Tensor | None:
    """The hidden states ``(P, H)`` of a kept prefix that begins with ``tokens``, or None."""
    for ids, hidden in kept:
        if len(ids) >= len(tokens) and ids[: len(tokens)].tolist() == list(tokens):
            return hidden
    return None


def _dropout_at_work(module: torch.nn.Module) -> bool:
    """Whether a training forward drops anything: its hidden states would then differ from the
    evaluation-mode forward the answer's log-probs come from."""
    attention = float(getattr(getattr(module, "config", None), "attention_dropout", 0.0) or 0.0)
    return (module.training and attention > 0) or any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in module.modules())
