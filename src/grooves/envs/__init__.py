"""Agent environments: the ``Env`` contract, multi-turn tool rollouts, SQLite app replicas.

Envs register by name. The built-in ones are listed here; a third-party package adds its
own through the ``grooves.envs`` entry-point group (``name = "package.module:EnvClass"``).
``grooves env list`` shows them all, ``grooves env try NAME`` runs one rollout. Wherever an
env is named, ``path/to/file.py:Class`` or ``package.module:Class`` names one directly,
loaded as reward functions are (``grooves.rewards.import_object``).
"""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points
from pathlib import Path

from grooves.envs.base import Env, State, TokenLog, Tool, make_tool, tool
from grooves.envs.rollout import Turn, env_groups, env_metrics, sampler_generate, start, trajectory
from grooves.envs.sqlite import SQLiteApp

BUILTIN = {
    "helpdesk": "grooves.envs.helpdesk:Helpdesk",
    "search": "grooves.envs.search:Search",
}
ENTRY_POINT_GROUP = "grooves.envs"


def available() -> dict[str, str]:
    """Every env by name: the built-in ones and those other packages register. A package's env
    whose name is a built-in's does not replace it; it is named in a warning."""
    found = dict(BUILTIN)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in BUILTIN:
            if point.value != BUILTIN[point.name]:
                warnings.warn(f"the env {point.value} that a package registers as {point.name!r} is shadowed by the "
                              f"built-in {point.name!r}; name it as {point.value} to use it", stacklevel=2)
            continue
        found.setdefault(point.name, point.value)
    return found


def env_class(name: str) -> type[Env]:
    """The class registered under ``name``, or named as ``file.py:Class`` / ``module:Class``;
    an unknown name lists the known ones."""
    if ":" in name:  # registered names have no colon
        cls = import_env(name)
        where = name
    else:
        known = available()
        if name not in known:
            raise KeyError(f"unknown env {name!r}; available: {', '.join(sorted(known))}, "
                           f"or a class in a file: my_env.py:MyEnv")
        cls = import_env(known[name])  # a package whose import fails is one error line too
        where = known[name]
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"{where} is not a grooves Env class")
    return cls


def import_env(path: str) -> object:
    """What ``file.py:Class`` or ``module:Class`` names; a file that does not run (a syntax
    error, a failed import, an exception) is one ``ValueError`` line, not a traceback."""
    from grooves.rewards.compose import import_object

    file = path.partition(":")[0]
    if file.endswith(".py") and not Path(file).is_file():
        raise ValueError(f"env file {file} does not exist (relative paths start from {Path.cwd()})")
    try:
        return import_object(path)
    except ValueError:
        raise
    except Exception as error:  # the user's code failed as it loaded
        detail = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"cannot load env {path}: {type(error).__name__}: {detail}") from None


def load_env(name: str, /, user: str | dict | None = None, **options) -> Env:
    """The env ``name`` with ``options``; ``user`` (``grooves.envs.users.make_user``: ``"scripted"``
    or a table) answers its text turns in place of the env's own user."""
    env = env_class(name)(**options)
    if user is not None:
        from grooves.envs.users import make_user

        env.user = make_user(user)
    return env


__all__ = [
    "BUILTIN", "Env", "SQLiteApp", "State", "TokenLog", "Tool", "Turn", "available", "env_class", "env_groups",
    "env_metrics", "load_env", "make_tool", "sampler_generate", "start", "tool", "trajectory",
]
