"""The envs room has no import circle, not even one that exists only for type checking."""

import ast
from pathlib import Path

import grooves.envs

ROOM = Path(grooves.envs.__file__).parent


def imports_within_room(path: Path) -> set[str]:
    """Every ``grooves.envs.*`` module ``path`` imports anywhere (``TYPE_CHECKING`` blocks and
    function bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grooves.envs."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("grooves.envs.")}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    out, seen = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            out.append(path[path.index(node):] + [node])
            return
        if node in seen:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        seen.add(node)

    for node in sorted(graph):
        visit(node, [])
    return out


def test_the_cycle_finder_sees_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_envs_room_imports_itself_back():
    graph = {f"grooves.envs.{p.stem}": imports_within_room(p) for p in ROOM.glob("*.py") if p.stem != "__init__"}
    assert "grooves.envs.base" not in graph["grooves.envs.tools"]
    assert cycles(graph) == []


def test_the_public_names_stay():
    from grooves.envs import base, state

    assert grooves.envs.State is state.State is base.State
    assert grooves.envs.TokenLog is state.TokenLog is base.TokenLog
    for name in grooves.envs.__all__:
        assert hasattr(grooves.envs, name), name
