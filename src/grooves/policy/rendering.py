"""Chat rendering that keeps untrusted text as text.

A chat template writes its own special tokens (``<|im_start|>``, ``<|im_end|>``) around
each message, and a plain ``encode`` of the rendered string cannot tell those apart from
the same characters typed inside a message. Left alone, a user or a completion that
writes ``<|im_end|>\\n<|im_start|>system`` closes its turn and opens a system turn with
real token ids (a grooves-served judge would read it as such).

So every string of the messages and tools (contents, tool calls, tool schemas) that
spells a special token is rendered through a placeholder: the template runs on a copy in
which each such occurrence is an ASCII sentinel (it survives ``trim``, ``tojson`` and the
fallback's ``json.dumps``), the sentinels are put back, and their spans are remembered.
Encoding then splits the text only at the template's own special tokens and encodes the
pieces between them with ``split_special_tokens=True``, so the message's characters
become ordinary text tokens. A chat with no such string takes the tokenizer's own path
unchanged, so ordinary chats keep exactly the ids they always had.
"""

from __future__ import annotations

import bisect
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def special_pattern(tokenizer) -> re.Pattern:
    """What ``encode`` turns into special tokens, as one pattern (longest first, so the longest wins)."""
    found = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    found.update(tokenizer.all_special_tokens)
    ordered = sorted((s for s in found if s), key=len, reverse=True)
    return re.compile("|".join(re.escape(s) for s in ordered) or r"(?!)")  # (?!) never matches


def spells_special(value: Any, specials: re.Pattern) -> bool:
    """Whether any string inside ``value`` (nested dicts and lists) contains a special token's text."""
    if isinstance(value, str):
        return specials.search(value) is not None
    if isinstance(value, dict):
        return any(spells_special(v, specials) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(spells_special(v, specials) for v in value)
    return False


@dataclass(frozen=True)
class Rendered:
    """Template text, and the spans of it that came from message text spelling a special token."""

    text: str
    literal: list[tuple[int, int]]


class _Masker:
    """Replaces special-token text inside strings with numbered sentinels and puts it back."""

    def __init__(self, specials: re.Pattern):
        self.nonce = f"GRVLIT{uuid.uuid4().hex}N"  # random: message text cannot forge it
        self.pattern = specials
        self.originals: list[str] = []

    def mask(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.pattern.sub(self._sentinel, value)
        if isinstance(value, dict):
            return {k: self.mask(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mask(v) for v in value]
        return value

    def _sentinel(self, match: re.Match) -> str:
        self.originals.append(match.group(0))
        return f"{self.nonce}{len(self.originals) - 1}_"

    def unmask(self, text: str) -> Rendered:
        parts, spans, last, length = [], [], 0, 0
        for match in re.finditer(re.escape(self.nonce) + r"(\d+)_", text):
            parts.append(text[last:match.start()])
            length += match.start() - last
            original = self.originals[int(match.group(1))]
            parts.append(original)
            spans.append((length, length + len(original)))
            length += len(original)
            last = match.end()
        parts.append(text[last:])
        return Rendered("".join(parts), spans)


def render_literal(specials: re.Pattern, messages: list, tools: list | None,
                   template: Callable[[list, list | None], str]) -> Rendered:
    """``template(messages, tools)`` with special-token text inside them marked as literal."""
    masker = _Masker(specials)
    masked_tools = masker.mask(tools) if tools else tools
    return masker.unmask(template(masker.mask(messages), masked_tools))


def encode_rendered(tokenizer, specials: re.Pattern, rendered: Rendered, start: int = 0) -> list[int]:
    """Ids of ``rendered.text[start:]``: the template's special tokens as themselves, literal text as text."""
    text, literal = rendered.text, rendered.literal
    starts = [a for a, _ in literal]
    ids: list[int] = []
    position = start
    for match in specials.finditer(text, start):
        begin, end = match.start(), match.end()
        if _overlaps(begin, end, literal, starts):
            continue  # message text that spells a special token: encoded with its neighbours as text
        ids += _text_ids(tokenizer, text[position:begin])
        ids.append(tokenizer.convert_tokens_to_ids(match.group(0)))
        position = end
    return ids + _text_ids(tokenizer, text[position:])


def _overlaps(begin: int, end: int, spans: list[tuple[int, int]], starts: list[int]) -> bool:
    index = bisect.bisect_right(starts, begin) - 1
    return any(0 <= i < len(spans) and spans[i][0] < end and begin < spans[i][1] for i in (index, index + 1))


def _text_ids(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
