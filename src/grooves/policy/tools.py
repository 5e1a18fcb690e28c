"""Tool calls: rendering OpenAI-style tools into a prompt and parsing calls out of model text.

This is the one parser of the project; the server and the agent environments use it.

Rendering. A chat template that supports ``tools=`` (Qwen, Llama 3.1, Hermes, ...) gets
them directly. Many small models' templates, the bundled SmolLM2's among them, silently
ignore ``tools``; grooves detects that and falls back to a documented system-prompt
rendering (``TOOLS_PROMPT``): the tool schemas in ``<tools>`` tags, calls written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, earlier calls written the same
way inside the assistant's text, and tool results sent back as user turns wrapped in
``<tool_response>`` tags (a template without tool support may not know a ``tool`` role).

Parsing. ``hermes`` reads ``<tool_call>{json}</tool_call>`` blocks (a block left open at
the end of the text also counts); ``json`` reads a reply that is nothing but a JSON object
(or a list of them) with ``name`` and ``arguments``, optionally in a ```json fence;
``auto`` (the default) tries hermes, then json. A malformed call is not dropped silently:
it becomes an entry in ``errors``, which callers send back to the model.

Near misses. A small model's call is often right but for one character: a string closed with
``'``, a quote inside a string left unescaped, a brace missing or one too many. Inside a
``<tool_call>`` block, where the text can only be a call, a body that ends with ``}`` is
repaired (``json_repair``) and kept when the repair is an object with a name and object
arguments. A body cut off before its end is never repaired: completing ``{"order_id": 12``
could act on the wrong order.
``ParsedReply.repaired`` counts them, so a metric can show how many calls needed it. A body
that cannot become a call (``{"name": "TOOL", "arguments": {...}}``) stays an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from grooves.types import Message

TOOLS_PROMPT = (
    "You can call functions to help with the user's request. The functions are described in JSON "
    "inside <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object inside <tool_call></tool_call> tags, like this:\n"
    '<tool_call>{{"name": "function_name", "arguments": {{"argument": "value"}}}}</tool_call>\n'
    "Function results come back inside <tool_response></tool_response> tags."
)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass
class ParsedReply:
    """A model reply split into its text and its tool calls; ``errors`` lists malformed calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    repaired: int = 0  # calls among tool_calls whose JSON was a near miss, repaired


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedReply: ...


def _call_from_object(obj: Any) -> ToolCall:
    """A ToolCall from a decoded ``{"name": ..., "arguments": ...}``; ValueError says what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('a tool call needs a "name" string')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f'the "arguments" of {name!r} are a string that is not JSON') from None
    if not isinstance(arguments, dict):
        raise ValueError(f'the "arguments" of {name!r} must be a JSON object')
    return ToolCall(name=name, arguments=arguments)


class HermesParser:
    """``<tool_call>{...}</tool_call>`` blocks anywhere in the text."""

    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls, errors, repaired = [], [], 0
        for match in self.pattern.finditer(text):
            body = match.group(1).strip()
            try:
                calls.append(_call_from_object(json.loads(body)))
            except json.JSONDecodeError as error:
                call = _repaired_call(body)
                if call is None:
                    errors.append(f"tool call is not valid JSON ({error.msg} at position {error.pos}): {body[:200]}")
                else:
                    calls.append(call)
                    repaired += 1
            except ValueError as error:
                errors.append(str(error))
        content = self.pattern.sub("", text).strip()
        return ParsedReply(content, calls, errors, repaired)


def _repaired_call(body: str) -> ToolCall | None:
    """The call a near-miss JSON body meant, or None when the repair is not a whole call."""
    from json_repair import repair_json

    if not body.endswith("}"):  # cut off: what it would have said is unknown
        return None
    try:
        obj = repair_json(body, return_objects=True)
    except Exception:  # noqa: BLE001 - a repair that fails is a call that stays malformed
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("arguments", obj.get("parameters")), dict)):
        return None
    try:
        return _call_from_object(obj)
    except ValueError:
        return None


class JsonParser:
    """A reply that is only a JSON tool call (or a list of them), bare or in a ```json fence."""

    fence = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        stripped = text.strip()
        fenced = self.fence.match(stripped)
        body = fenced.group(1) if fenced else stripped
        if not body.startswith(("{", "[")):
            return ParsedReply(text)
        try:
            decoded = json.loads(body)
        except json.JSONDecodeError:
            return ParsedReply(text)  # JSON-looking prose is still prose
        items = decoded if isinstance(decoded, list) else [decoded]
        if not items or not all(isinstance(i, dict) and "name" in i for i in items):
            return ParsedReply(text)  # a JSON answer, not a tool call
        calls, errors = [], []
        for item in items:
            try:
                calls.append(_call_from_object(item))
            except ValueError as error:
                errors.append(str(error))
        return ParsedReply("", calls, errors)


class AutoParser:
    def parse(self, text: str) -> ParsedReply:
        if "<tool_call>" in text:
            return HermesParser().parse(text)
        return JsonParser().parse(text)


PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "json": JsonParser(), "auto": AutoParser()}


def parse_tool_calls(text: str, parser: str | ToolCallParser = "auto") -> ParsedReply:
    if isinstance(parser, str):
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; available: {', '.join(PARSERS)}")
        parser = PARSERS[parser]
    return parser.parse(text)


# --- rendering ---------------------------------------------------------------------

_PROBE_TOOL = {"type": "function", "function": {
    "name": "grooves_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}}}


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (some templates silently drop them)."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that rejects the argument has no tool support either
        return False
    return "grooves_probe_tool" in text


def tool_call_text(call: dict[str, Any]) -> str:
    """An OpenAI ``tool_calls`` entry written the way the fallback rendering asks the model to write it."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # keep the model's own malformed text: it is what it wrote
    return "<tool_call>" + json.dumps({"name": function.get("name"), "arguments": arguments}) + "</tool_call>"


def fallback_messages(messages: list[Message], tools: list[dict] | None) -> list[Message]:
    """Messages any plain chat template can render: tools in the system prompt, calls and results as text."""
    out: list[Message] = []
    if tools:
        schemas = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        prompt = TOOLS_PROMPT.format(tools=schemas)
        if messages and messages[0].get("role") == "system":
            prompt = f"{messages[0].get('content') or ''}\n\n{prompt}".strip()
            messages = messages[1:]
        out.append({"role": "system", "content": prompt})
    for message in messages:
        role = message.get("role")
        content = message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "".join(tool_call_text(c) for c in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}".strip()})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    return out
