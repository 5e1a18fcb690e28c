"""Env tools: typed ``@tool`` methods and tools made from JSON schemas.

``@tool`` marks an env method ``(self, state, ...)``: ``make_tool`` turns its signature and
docstring (``Args:``) into an OpenAI tool schema and a pydantic model that checks the model's
arguments, and calls it as ``fn(state, **arguments)``. ``Tool.from_schema`` takes someone
else's schema and a function ``fn(state, arguments)`` instead. Either way the arguments are
checked before the call (``BadArguments``: the model's mistake) and bound to the function
before it runs (a ``TypeError`` there: the env author's).

A schema tool refuses arguments its schema does not declare, as ``@tool`` does: most published
schemas leave out ``additionalProperties: false``, and an extra argument would otherwise reach the
function and fail there as the env's error. A schema that sets ``additionalProperties`` or
``patternProperties`` itself is followed; ``extra_arguments=True`` lets undeclared ones through.

Many tool sets report failure in the value they return (``"Error: order not found"``) rather
than by raising. ``is_error`` says which returned values are errors: a function of the result,
or a prefix (or tuple of prefixes) that a text result starts with. Such a result goes back to
the model as returned and is counted as ``tool_errors/returned``.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, create_model

from grooves.envs.state import State
from grooves.policy.tools import tool_call_text


class BadArguments(ValueError):
    """The model's arguments do not fit the tool's schema; the message lists each problem."""


ErrorRule = Callable[[Any], bool] | str | tuple[str, ...] | None
"""How a tool's returned value is read as an error: a predicate, or the prefixes of an error text."""


def error_rule(rule: ErrorRule) -> Callable[[Any], bool] | None:
    """``rule`` as a predicate; a prefix rule matches text results only, after leading whitespace."""
    if rule is None or callable(rule):
        return rule
    prefixes = (rule,) if isinstance(rule, str) else tuple(rule)
    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise TypeError(f"is_error must be a function of the result or non-empty prefix strings, not {rule!r}")
    return lambda result: isinstance(result, str) and result.lstrip().startswith(prefixes)


@dataclass
class Tool:
    """A tool: its name, description, arguments and the function behind it.

    Made by ``@tool`` (``make_tool``: a pydantic model from the signature; the function is called
    as ``fn(state, **arguments)``) or by ``Tool.from_schema`` (an OpenAI schema checked with
    JSON Schema; the function is called as ``fn(state, arguments)``, so an argument may have any
    name, ``state`` included).
    """

    name: str
    description: str
    fn: Callable[..., Any]
    arguments: type | None = None  # a pydantic model of the arguments (``@tool``)
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (``from_schema``), as offered
    checked: dict[str, Any] | None = None  # the schema the arguments are checked against (``from_schema``)
    is_error: Callable[[Any], bool] | None = None  # which returned values are errors (``error_rule``)

    @classmethod
    def from_schema(cls, schema: dict[str, Any], fn: Callable[[State, dict[str, Any]], Any], *,
                    is_error: ErrorRule = None, extra_arguments: bool = False) -> Tool:
        """A tool from an OpenAI tool schema (``{"type": "function", "function": {...}}`` or the inner
        ``{"name", "description", "parameters"}``) and ``fn(state, arguments)``. ``is_error``: which
        returned values are errors (a predicate or text prefixes); ``extra_arguments``: let arguments
        the schema does not declare through (refused by default)."""
        from jsonschema import Draft202012Validator

        function = schema.get("function", schema)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        Draft202012Validator.check_schema(parameters)  # a broken schema is the env author's error, now
        checked = parameters
        if not extra_arguments and not {"additionalProperties", "patternProperties"} & set(parameters):
            checked = {**parameters, "additionalProperties": False}
        return cls(function["name"], function.get("description", ""), fn, parameters=parameters, checked=checked,
                   is_error=error_rule(is_error))

    def schema(self) -> dict[str, Any]:
        if self.parameters is not None:
            parameters = self.parameters
        else:
            parameters = self.arguments.model_json_schema()
            parameters.pop("title", None)
            for prop in parameters.get("properties", {}).values():
                prop.pop("title", None)
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": parameters}}

    def validate(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The arguments the function gets, or BadArguments saying what is wrong with ``raw``."""
        if self.parameters is not None:
            from jsonschema import Draft202012Validator

            errors = sorted(Draft202012Validator(self.checked or self.parameters).iter_errors(raw),
                            key=lambda e: list(e.path))
            if errors:
                raise BadArguments("; ".join(f"{'.'.join(map(str, e.path)) or '(arguments)'}: {e.message}"
                                             for e in errors))
            return dict(raw)
        try:
            model = self.arguments.model_validate(raw)
        except ValidationError as error:
            raise BadArguments("; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}"
                                         for e in error.errors())) from None
        return {k: getattr(model, k) for k in type(model).model_fields}

    def bind(self, state: State, arguments: dict[str, Any]) -> Callable[[], Any]:
        """The call, ready to run; a TypeError here is a bug in the env's tool, not the model's."""
        if self.parameters is not None:
            inspect.signature(self.fn).bind(state, arguments)
            return functools.partial(self.fn, state, arguments)
        inspect.signature(self.fn).bind(state, **arguments)
        return functools.partial(self.fn, state, **arguments)


def call_text(name: str, **arguments: Any) -> str:
    """One tool call as an assistant turn's text, in the format the rendering asks for."""
    return tool_call_text({"name": name, "arguments": arguments})


def tool(fn: Callable | None = None, *, name: str | None = None, is_error: ErrorRule = None) -> Callable:
    """Mark an env method ``(self, state, ...)`` as a tool the model can call; ``is_error`` says which
    of its returned values are errors (a predicate of the result, or the prefixes of an error text)."""
    rule = error_rule(is_error)

    def mark(f: Callable) -> Callable:
        f.__grooves_tool__ = name or f.__name__
        f.__grooves_tool_is_error__ = rule
        return f

    return mark(fn) if fn is not None else mark


_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


def make_tool(fn: Callable, name: str | None = None, is_error: ErrorRule = None) -> Tool:
    """A ``Tool`` from a function ``(state, arg: type = default, ...)``; ``Args:`` lines of its
    docstring describe the arguments, the text before them the tool. ``is_error`` as for ``@tool``
    (by default the one ``@tool`` was given)."""
    doc = inspect.getdoc(fn) or ""
    summary, _, args_block = doc.partition("Args:")
    described: dict[str, str] = {}
    current = None
    for line in args_block.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith(":"):
            break  # the next section (Returns:, Raises:) is not about the arguments
        match = _ARG_LINE.match(line)
        if match and (not line.startswith(" " * 8)):
            current = match.group(1)
            described[current] = match.group(2).strip()
        elif current and line.strip():
            described[current] += " " + line.strip()
    hints = inspect.get_annotations(fn, eval_str=True)
    fields: dict[str, Any] = {}
    for index, param in enumerate(inspect.signature(fn).parameters.values()):
        if index == 0 or param.name == "self":  # state (a bound method has no self here)
            continue
        annotation = hints.get(param.name, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = (annotation, Field(default, description=described.get(param.name)))
    tool_name = name or getattr(fn, "__grooves_tool__", fn.__name__)
    model = create_model(f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid", strict=False), **fields)
    rule = error_rule(is_error) if is_error is not None else getattr(fn, "__grooves_tool_is_error__", None)
    return Tool(tool_name, " ".join(summary.split()), fn, model, is_error=rule)
