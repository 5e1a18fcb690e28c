"""Constrained decoding with xgrammar: JSON output and forced tool calls that always parse.

``response_format={"type": "json_object"}`` constrains the reply to a JSON object,
``{"type": "json_schema", ...}`` to the given schema, and a forced ``tool_choice`` (a named
function, or ``"required"``) to ``{"name": ..., "arguments": {...}}`` matching the tools'
parameter schemas, which ``grooves.policy.tools`` parses into ``tool_calls``. Whitespace
between JSON tokens is not free (``any_whitespace=False``): small models otherwise wander
into endless whitespace. Compiled grammars are cached by schema.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch


class GrammarError(ValueError):
    """A schema xgrammar cannot compile; the message is safe to show to the client."""


class GrammarConstraint:
    """One row's grammar state: masks logits, follows the chosen tokens, knows when it is done.

    Budget guard: a sample that is cut by ``max_tokens`` mid-JSON would not parse, and small
    models do write long strings. Once the tokens left only just suffice for the shortest
    completion the grammar accepts (closing strings, brackets and required keys), that
    completion is forced, so the reply ends as valid JSON whenever it fits at all.
    """

    def __init__(self, compiled, vocab_size: int, tokenizer):
        import xgrammar as xgr

        self._xgr = xgr
        self.tokenizer = tokenizer
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.forced: list[int] = []

    def mask(self, logits: torch.Tensor, remaining: int) -> None:
        if not self.forced and remaining <= GUARD_WINDOW:
            completion = self._completion_tokens()
            # + 1 for the stop token, + a margin: mid-way through a multi-byte character no
            # completion can be found, so the guard must not wait for the last possible moment.
            if completion is not None and len(completion) + 1 + GUARD_MARGIN >= remaining:
                self.forced = completion
        if self.forced:
            keep = logits[self.forced[0]].clone()
            logits.fill_(float("-inf"))
            logits[self.forced[0]] = keep
            return
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self._xgr.apply_token_bitmask_inplace(logits[None], self.bitmask.to(logits.device))

    def accept(self, token: int) -> None:
        self.matcher.accept_token(token)
        if self.forced and self.forced[0] == token:
            self.forced.pop(0)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def _completion_tokens(self) -> list[int] | None:
        """Tokens of the shortest completion found, checked against the grammar; None if none fits."""
        text = shortest_completion(self.matcher)
        if not text:
            return None
        whole = self.tokenizer.encode(text, add_special_tokens=False)
        by_char = [t for ch in text for t in self.tokenizer.encode(ch, add_special_tokens=False)]
        for tokens in (whole, by_char):
            trial = self.matcher.fork()
            if all(trial.accept_token(t) for t in tokens) and trial.is_completed():
                return tokens
        return None


GUARD_WINDOW = 48  # look for a completion once this few tokens are left
GUARD_MARGIN = 4  # a UTF-8 character spans up to 4 byte tokens
# Characters in the order a closer tries them: end strings and containers first, then
# separators (so a number ends rather than grows), the smallest values, then letters and
# digits (e.g. the first letter of an enum value).
_PRIORITY = '"}],:0n ' + "abcdefghijklmopqrstuvwxyz123456789-."


def shortest_completion(matcher, max_chars: int = 256) -> str | None:
    """A short string that completes what ``matcher`` has accepted, or None.

    Greedy: repeatedly take the grammar's forced stretch (a required key, the "ull" of null)
    or else the first character in ``_PRIORITY`` the grammar accepts, until the input is a
    complete value. Inside a string the first accepted character is the closing quote, so
    the walk closes what is open from the inside out.
    """
    state = matcher.fork()
    text = ""
    while len(text) < max_chars:
        if state.is_completed():
            return text
        jump = state.find_jump_forward_string()
        if jump and state.accept_string(jump):
            text += jump
            continue
        for char in _PRIORITY:
            trial = state.fork()
            if trial.accept_string(char):
                state, text = trial, text + char
                break
        else:
            return None
    return None


class Grammars:
    """Compiles and caches grammars for one tokenizer."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info)
        self._compile = lru_cache(maxsize=64)(self._compile_uncached)

    def json_object(self) -> GrammarConstraint:
        return self.for_schema({"type": "object"})

    def for_schema(self, schema: dict[str, Any]) -> GrammarConstraint:
        # Key order is kept: properties are generated in the order the schema gives them.
        return GrammarConstraint(self._compile(json.dumps(schema)), self.vocab_size, self.tokenizer)

    def tool_call(self, tools: list[dict[str, Any]], name: str | None = None) -> GrammarConstraint:
        """A call of the named tool, or of any of ``tools`` when ``name`` is None."""
        options = []
        for tool in tools:
            function = tool.get("function", tool)
            if name is None or function.get("name") == name:
                options.append({
                    "type": "object",
                    "properties": {"name": {"const": function["name"]},
                                   "arguments": function.get("parameters") or {"type": "object"}},
                    "required": ["name", "arguments"],
                })
        if not options:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the request's tools")
        return self.for_schema(options[0] if len(options) == 1 else {"anyOf": options})

    def _compile_uncached(self, schema: str):
        try:
            return self.compiler.compile_json_schema(schema, any_whitespace=False)
        except Exception as error:  # xgrammar raises several types for unsupported schemas
            raise GrammarError(f"cannot use this JSON schema for constrained decoding: {error}") from None
