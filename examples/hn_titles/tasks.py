"""The texts to title: READMEs of the Python packages installed next to grooves.

A "Show HN" post usually links to a project's README, so the long description of each
installed distribution (``importlib.metadata``) is the story a title is written for. No
network, no data set to download, and every machine with grooves has some.

Each README is stripped of what a reader of the front page never sees (code blocks,
badges, images, link targets, tables, HTML, reStructuredText directives), cut to about
256 tokens (``MAX_CHARS``) at a paragraph or sentence boundary, and kept only if enough
prose is left (``MIN_CHARS``). Tasks are deduplicated (by name and by text) and sorted by
package name, so the same venv gives the same file. The held-out split is made by the run
config (``[tasks] heldout_fraction``), by a seeded hash of each id.

    python examples/hn_titles/tasks.py OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
from importlib import metadata
from pathlib import Path

MAX_CHARS = 1200  # about 256 SmolLM2 tokens of English prose
MIN_CHARS = 400   # less than this is a one-line summary, not a story

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_HTML_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_IMAGE = re.compile(r"!\[[^\]]*\](\([^)]*\)|\[[^\]]*\])")  # inline or reference images (badges)
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_REF_LINK = re.compile(r"\[([^\]\n]*)\](?:\[[^\]]*\])?")  # [text][ref], [text] and what a badge leaves
_LINK_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*\S+.*$", re.MULTILINE)
_RST_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^>]*>)?`_{1,2}")  # `text <url>`_ and `text`_
_RST_ROLE = re.compile(r":[a-z]+:`([^`]+)`")
_RST_SUBST = re.compile(r"\|[^|\n]+\|_{0,2}")
_RST_REF = re.compile(r"\b([A-Za-z]+)_(?=[\s.,;:)!?]|$)", re.MULTILINE)  # "see docs_" -> "see docs"
_URL = re.compile(r"https?://\S+")
_EMPHASIS = re.compile(r"(\*\*|__|\*|`+)(\S(?:.*?\S)?)\1")
_HEADING = re.compile(r"^#{1,6}\s*(.*?)\s*#*\s*$", re.MULTILINE)
_UNDERLINE = re.compile(r"^\s*([=\-~^*#+`'\".])\1{2,}\s*$", re.MULTILINE)


def readme(dist: metadata.Distribution) -> str:
    """The long description: the ``Description`` field, or (metadata 2.1+) the message body."""
    text = dist.metadata.get("Description") or dist.metadata.get_payload() or ""
    return text if isinstance(text, str) else ""


def _drop_rst_blocks(text: str) -> str:
    """Remove ``.. directive::`` blocks and ``::`` literal blocks with their indented bodies."""
    out, skipping = [], False
    for line in text.splitlines():
        if skipping and (not line.strip() or line[:1] in " \t"):
            continue
        skipping = False
        if line.lstrip().startswith(".. "):
            skipping = True
            continue
        if line.rstrip().endswith("::"):
            skipping = True
            line = line.rstrip()[:-1]  # "Example::" reads as "Example:"
        out.append(line)
    return "\n".join(out)


def _prose_lines(text: str) -> list[str]:
    """Lines a reader would read: no tables, prompts, shell lines or indented code."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith((">>>", "...", "$ ", "pip install", "+--", "python -m")) or stripped.count("|") >= 2:
            continue  # doctest, shell and table lines
        if line.startswith(("    ", "\t")) and not re.match(r"\s*([-*+]|\d+\.)\s", line):
            continue  # an indented code block (nested list items are kept)
        lines.append(stripped)
    return lines


def strip_markup(text: str) -> str:
    """Markdown or reStructuredText to plain paragraphs separated by blank lines."""
    text = _FENCE.sub("", text.replace("\r\n", "\n"))
    text = _drop_rst_blocks(text)
    for pattern in (_HTML_COMMENT, _IMAGE, _LINK_DEF, _UNDERLINE):
        text = pattern.sub("", text)
    for pattern in (_RST_LINK, _LINK, _REF_LINK, _RST_ROLE, _RST_REF):  # RST links before tags: <url> looks like one
        text = pattern.sub(r"\1", text)
    text = _HTML_TAG.sub("", text)
    text = _URL.sub("", _RST_SUBST.sub("", text))
    text = _HEADING.sub(lambda m: m.group(1) + ("" if m.group(1).endswith((".", ":", "?", "!")) else "."), text)
    text = _EMPHASIS.sub(r"\2", text)
    paragraphs, current = [], []
    for line in _prose_lines(text) + [""]:
        line = re.sub(r"^(>\s*)*(([-*+]|\d+\.)\s+)?", "", line)  # quote marks and list bullets
        if line:
            current.append(line)
        elif current:
            paragraphs.append(re.sub(r"\s+", " ", " ".join(current)).strip())
            current = []
    return "\n\n".join(p for p in paragraphs if re.search(r"[A-Za-z]{3}", p))


def truncate(text: str, limit: int = MAX_CHARS) -> str:
    """At most ``limit`` characters, cut at the last paragraph, else sentence, else word end."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    for boundary in ("\n\n", ". ", "! ", "? "):
        cut = head.rfind(boundary)
        if cut >= limit // 2:
            return head[: cut + (1 if boundary != "\n\n" else 0)].strip()
    return head[: head.rfind(" ")].strip()


def build_tasks() -> list[dict[str, str]]:
    """One task per installed distribution with enough README prose, sorted by name."""
    seen_names, seen_texts, tasks = set(), set(), []
    for dist in metadata.distributions():
        name = dist.metadata.get("Name") or ""
        key = re.sub(r"[-_.]+", "-", name).lower()
        if not name or key in seen_names:
            continue
        seen_names.add(key)
        text = truncate(strip_markup(readme(dist)))
        fingerprint = re.sub(r"\W+", " ", text[:300]).lower()
        if len(text) < MIN_CHARS or fingerprint in seen_texts:
            continue
        seen_texts.add(fingerprint)
        tasks.append({"id": name, "text": text})
    return sorted(tasks, key=lambda t: t["id"].lower())


def write_tasks(path: Path) -> int:
    """Write the tasks JSONL (atomically: a half-written file would be reused as complete)."""
    tasks = build_tasks()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tasks))
    tmp.replace(path)
    return len(tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="tasks JSONL to write (columns id, text)")
    args = parser.parse_args()
    print(f"{write_tasks(args.out)} tasks -> {args.out}")


if __name__ == "__main__":
    main()
