"""How many tokens a model reads, and the words for a prompt that is longer: said by every
command that would otherwise spend minutes on it (``env try``, ``sft``, ``eval``)."""

from __future__ import annotations

DEFAULT_CONTEXT = 2048  # a config without max_position_embeddings: the small models' usual window


def model_context(model) -> int:
    """The context (tokens) of a causal LM, a ``Policy`` or anything with a ``config``:
    ``max_position_embeddings``; positions past it have no trained embedding."""
    model = getattr(model, "causal_lm", model)
    return int(getattr(model.config, "max_position_embeddings", DEFAULT_CONTEXT))


def over_context(what: str, tokens: int, context: int) -> str | None:
    """``what`` (e.g. ``task t3: the prompt``) of ``tokens`` tokens said as over ``context``, or None."""
    if tokens <= context:
        return None
    return f"{what} is {tokens} tokens, over the model's context of {context}"


def over_limit(what: str, tokens: int, limit: int | None, name: str) -> str | None:
    """``what`` of ``tokens`` tokens said as over the configured ``name = limit``, or None."""
    if limit is None or tokens <= limit:
        return None
    return f"{what} is {tokens} tokens, over {name} = {limit}"
