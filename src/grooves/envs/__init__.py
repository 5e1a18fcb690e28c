"""Agent environments: the ``Env`` contract, multi-turn tool rollouts, SQLite app replicas.

Envs register by name. The built-in ones are listed here; a third-party package adds its
own through the ``grooves.envs`` entry-point group (``name = "package.module:EnvClass"``).
``grooves env list`` shows them all, ``grooves env try NAME`` runs one rollout.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from grooves.envs.base import Env, State, TokenLog, Tool, make_tool, tool
from grooves.envs.rollout import Turn, env_groups, env_metrics, sampler_generate, start, trajectory
from grooves.envs.sqlite import SQLiteApp

BUILTIN = {
    "helpdesk": "grooves.envs.helpdesk:Helpdesk",
    "search": "grooves.envs.search:Search",
}
ENTRY_POINT_GROUP = "grooves.envs"


def available() -> dict[str, str]:
    """Every env by name: the built-in ones and those other packages register."""
    found = dict(BUILTIN)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(point.name, point.value)
    return found


def env_class(name: str) -> type[Env]:
    """The class registered under ``name``; an unknown name lists the known ones."""
    import importlib

    known = available()
    if name not in known:
        raise KeyError(f"unknown env {name!r}; available: {', '.join(sorted(known))}")
    module, _, attr = known[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"{known[name]} is not a grooves Env class")
    return cls


def load_env(name: str, /, **options) -> Env:
    return env_class(name)(**options)


__all__ = [
    "BUILTIN", "Env", "SQLiteApp", "State", "TokenLog", "Tool", "Turn", "available", "env_class", "env_groups",
    "env_metrics", "load_env", "make_tool", "sampler_generate", "start", "tool", "trajectory",
]
