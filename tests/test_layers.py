"""The rooms' import arrows point one way (DESIGN.md) and no module imports itself back.

Two views: the static import graph of the source (every import: module level, inside functions,
under ``TYPE_CHECKING``), where no circle may exist and each room may point only at the rooms
listed for it; and what importing a room really loads (``sys.modules``), for the rooms whose
loading time matters (``grooves serve`` must not load the trainer).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import grooves

SRC = Path(grooves.__file__).parent

# room -> the rooms it may import (anything under grooves.<room>); leaves first
ALLOWED = {
    "types": set(),
    "config_base": set(),
    "progress": set(),
    "scoring": {"types"},
    "runs": {"types"},
    "algorithms": set(),
    "policy": {"types"},
    "monitors": {"types", "scoring", "config_base"},
    "rewards": {"types", "scoring", "progress", "policy", "config_base"},
    "tasks": {"types", "rewards"},
    "envs": {"types", "policy", "rewards"},
    "serve": {"types", "policy", "runs"},
    "training": {"types", "config_base", "progress", "scoring", "runs", "algorithms", "policy", "monitors",
                 "rewards", "tasks", "envs", "serve"},
    "workflows": {"types", "config_base", "progress", "runs", "policy", "monitors", "rewards", "tasks", "envs",
                  "serve", "training"},
    "backend": {"types", "algorithms", "policy", "runs", "serve", "training"},
    "dashboard": {"types", "runs", "policy", "monitors", "tasks", "training", "workflows"},
    "demo": {"training"},
}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``module -> modules of the package it imports``, from the source of every file under ``root``.

    ``from a.b import c`` points at ``a.b.c`` when that is a module, else at ``a.b``. Loading a
    submodule runs its parents' ``__init__``, but that is the package's structure, not an arrow,
    so an import never points at one of the importer's own parent packages.
    """
    modules = {}
    for path in root.rglob("*.py"):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        here = here.rpartition(".")[0]
                    base = f"{here}.{base}" if base else here
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        found = {owner(t) for t in targets if t == package or t.startswith(package + ".")}
        graph[name] = {t for t in found if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, from its first module in sorted order (Tarjan's strongly connected parts)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while (top := stack.pop()) != node:
                on_stack.discard(top)
                part.append(top)
            on_stack.discard(node)
            if part:
                found.append(sorted([node, *part]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_the_cycle_finder_sees_a_planted_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b  # the package's own structure\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert cycles(import_graph(pkg, "pkg")) == []


def test_no_module_imports_itself_back():
    assert cycles(import_graph(SRC, "grooves")) == []


def test_each_room_points_only_at_the_rooms_below_it():
    graph = import_graph(SRC, "grooves")
    wrong = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                   if room(module) in ALLOWED and room(target) != room(module)
                   and room(target) not in ALLOWED[room(module)])
    assert not wrong, wrong
    assert not [m for m, targets in graph.items() for t in targets if room(t) == "cli" and room(m) != "cli"]


def loaded_by(*modules: str) -> list[str]:
    code = (f"import sys, importlib\nfor m in {list(modules)!r}: importlib.import_module(m)\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('grooves.')))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("room_name", ["types", "scoring", "progress", "runs", "monitors", "algorithms", "policy",
                                       "rewards", "envs", "serve"])
def test_importing_a_room_loads_no_room_above_it(room_name):
    wrong = [m for m in loaded_by(f"grooves.{room_name}") if room(m) != room_name and room(m) not in
             ALLOWED[room_name] and not (m == "grooves.__init__")]
    assert not wrong, f"grooves.{room_name} loads {wrong}"


def test_grooves_serve_does_not_load_the_trainer():
    loaded = loaded_by("grooves.serve.app", "grooves.serve.server", "grooves.serve.export", "grooves.serve.local")
    assert not [m for m in loaded if room(m) in ("training", "workflows", "algorithms", "envs")], loaded


def test_importing_one_training_module_does_not_load_the_loop():
    loaded = loaded_by("grooves.training.config")
    assert "grooves.training.loop" not in loaded and "grooves.training.trainer" not in loaded, loaded


def test_every_name_the_readme_uses_from_grooves_imports():
    """The public API stays: each ``gr.NAME`` / ``from grooves import NAME`` of the README resolves."""
    readme = (SRC.parents[1] / "README.md").read_text()
    import re

    names = set(re.findall(r"\bgr\.([A-Za-z_]\w*)", readme))
    for line in re.findall(r"from grooves import ([\w, ]+)", readme):
        names |= {n.strip() for n in line.split(",")}
    assert names, "the README names no part of the Python API"
    assert names <= set(grooves.__all__), names - set(grooves.__all__)
    for name in sorted(names):
        assert getattr(grooves, name) is not None
