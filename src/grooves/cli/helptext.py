"""Help text as plain text: ``[alerts]`` and ``[[candidates]]`` name TOML tables, so Rich must not
read them as markup (it would drop them), and a wrapped docstring's lines are joined."""

from __future__ import annotations

import inspect

import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup


def _text(help_text: str | None) -> str | None:
    return None if help_text is None else escape(help_text)


class TextCommand(TyperCommand):
    """A command whose help, and its parameters' help, prints as written."""

    def __init__(self, *args, help: str | None = None, short_help: str | None = None, **kwargs) -> None:
        super().__init__(*args, help=_text(help), short_help=_text(short_help), **kwargs)
        for param in self.params:
            if getattr(param, "help", None):
                param.help = _text(param.help)


class TextGroup(TyperGroup):
    """A command group whose own help prints as written (its commands are TextCommands)."""

    def __init__(self, *args, help: str | None = None, short_help: str | None = None, **kwargs) -> None:
        super().__init__(*args, help=_text(help), short_help=_text(short_help), **kwargs)
        for param in self.params:
            if getattr(param, "help", None):
                param.help = _text(param.help)


def plain_help(app: typer.Typer) -> None:
    """Every command of APP and of its groups, at any depth: help from the docstring (reflowed) when
    none is given, printed as text."""
    for command in app.registered_commands:
        if command.help is None and command.callback is not None:
            command.help = reflow(inspect.getdoc(command.callback) or "")
        if command.cls in (None, TyperCommand):  # Typer fills in its own class
            command.cls = TextCommand
    for group in app.registered_groups:
        if not group.cls and not group.typer_instance.info.cls:
            group.cls = TextGroup
        plain_help(group.typer_instance)


def reflow(text: str) -> str:
    """A docstring as help text: the lines of a paragraph joined (Typer's rich help keeps them,
    so a wrapped docstring prints ragged); list items stay on their own lines."""
    paragraphs = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.splitlines()
        if any(line.lstrip().startswith(("- ", "* ")) or line.startswith(" ") for line in lines):
            paragraphs.append(paragraph)
        else:
            paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)
