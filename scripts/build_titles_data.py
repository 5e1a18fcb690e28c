"""Build the demo task data: standard-library docstrings whose first line is a title.

Run once with the Python whose stdlib you want; the output is committed, so the demo's
texts are the same on every install whatever its Python version:

    python scripts/build_titles_data.py > src/grooves/tasks/data/titles.jsonl

A docstring qualifies when its first paragraph is one line of 3-12 words that starts with
a capital letter (the title) and the rest is 25-80 words of prose (the text).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import warnings

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "test",
        "ensurepip", "venv", "pydoc_data", "msilib", "winreg", "winsound", "nt", "tty", "pty"}


def title_and_text(doc: str | None) -> tuple[str, str] | None:
    if not doc:
        return None
    parts = re.split(r"\n\s*\n", inspect.cleandoc(doc), maxsplit=1)
    if len(parts) < 2 or "\n" in parts[0].strip():
        return None
    title = parts[0].strip().rstrip(".")
    text = " ".join(parts[1].split())
    if not 3 <= len(title.split()) <= 12 or not title[0].isupper():
        return None
    if any(c in title for c in "()[]=`>{}") or ">>>" in text or text.count("=") > 2:
        return None
    if not 25 <= len(text.split()) <= 80:
        return None
    return title, text


def documented_objects():
    for name in sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in SKIP):
        try:
            module = importlib.import_module(name)
        except Exception:  # platform-specific modules
            continue
        yield name, module
        for attr, obj in vars(module).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{name}.{attr}", obj
            if inspect.isclass(obj):
                for method_name, method in vars(obj).items():
                    if not method_name.startswith("_") and inspect.isfunction(method):
                        yield f"{name}.{attr}.{method_name}", method


def main() -> None:
    warnings.filterwarnings("ignore")
    seen = set()
    for qualname, obj in documented_objects():
        found = title_and_text(obj.__doc__)
        if found is None or found[0] in seen:
            continue
        seen.add(found[0])
        print(json.dumps({"id": qualname, "reference": found[0], "text": found[1]}))


if __name__ == "__main__":
    main()
