"""Agentic search over a fixed corpus: the Python standard library's own documentation,
indexed with SQLite FTS5 and ranked by BM25.

Corpus. Every public function and class (``__all__``) of a fixed list of platform-independent
stdlib modules is one document: ``doc_id`` is its qualified name (``shutil.copytree``), the text is
its signature (``inspect.signature``) and its docstring. It is built in-process from the
running interpreter, so it needs no network and is the same on every machine with the same
Python version (memory addresses in default values are removed). No third-party package
contributes.

Questions, generated from the corpus with known answers and source documents:

=====================  ==================================================  ===================
kind                   question                                            answer
=====================  ==================================================  ===================
``default``            the default of parameter ``p`` of ``module.name``   the default's source
``name``               which function or class <docstring summary>?        ``module.name``
``described_default``  the default of ``p`` of the one that <summary>      the default's source
=====================  ==================================================  ===================

Defaults of ``None`` (the most common default: a free guess) and long or backslashed ones
are left out; a summary must be unique in the corpus and not contain the object's own name.
Search results show titles and docstring snippets, never signatures, so a signature (and
the default in it) is only seen by reading the document. Train and heldout questions come
from disjoint documents (one document in four is heldout).

Score components, each in [0, 1]: ``exact`` (normalised exact match), ``answer_f1`` (token
F1 over the words the question does not contain), ``read_source`` (the source document was
read), ``searched`` (at least one search ran) and ``format`` (the share of tool-call attempts
that were well formed: parseable, a known tool, valid arguments; 0 for a rollout that never
calls a tool, so answering blind earns nothing).
``bm25_baseline`` answers each question from BM25's top hit for the raw question.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import importlib
import inspect
import random
import re
import sqlite3
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import Field

from grooves.envs.base import State, call_text, tool
from grooves.envs.sqlite import SQLiteApp
from grooves.types import Task

MODULES = (
    "argparse", "base64", "binascii", "bisect", "calendar", "codecs", "collections", "colorsys", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "dis", "email.utils", "enum",
    "filecmp", "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "heapq", "html",
    "inspect", "io", "ipaddress", "itertools", "json", "keyword", "linecache", "logging", "math", "mimetypes",
    "operator", "optparse", "pathlib", "pickle", "plistlib", "pprint", "queue", "quopri", "random", "re", "reprlib",
    "sched", "secrets", "shlex", "shutil", "statistics", "string", "struct", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "traceback", "types", "urllib.parse", "uuid", "warnings", "wave", "zipapp", "zipfile",
    "zlib",
)
SCHEMA = ("CREATE VIRTUAL TABLE docs USING fts5(doc_id UNINDEXED, title, signature, body, "
          "tokenize = 'porter unicode61');")
RANK = "bm25(docs, 0.0, 4.0, 2.0, 1.0)"  # title matches count most, then parameter names, then the docstring
KINDS = ("default", "name", "described_default")
FORMAT_ERRORS = ("tool_errors/malformed", "tool_errors/unknown_tool", "tool_errors/bad_arguments")
MAX_TERMS = 32
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# imperative first words of docstring summaries, turned into "which function returns ...?"
_VERBS = {"add", "apply", "build", "calculate", "call", "change", "check", "close", "compare", "compute", "convert",
          "copy", "create", "decode", "delete", "determine", "encode", "escape", "extract", "fill", "find", "format",
          "generate", "get", "load", "make", "open", "parse", "print", "read", "register", "remove", "rename",
          "return", "split", "test", "translate", "write"}


@dataclass(frozen=True)
class Doc:
    doc_id: str
    kind: str  # "function" or "class"
    signature: str  # "(src, dst, *, follow_symlinks=True)", "" when inspect cannot tell
    body: str  # the docstring

    @property
    def title(self) -> str:
        return f"{self.doc_id} ({self.kind})"

    @property
    def text(self) -> str:
        """What ``read`` returns."""
        return f"{self.title}\n{self.doc_id.rsplit('.', 1)[1]}{self.signature}\n\n{self.body}"


def build_corpus(modules: tuple[str, ...] = MODULES) -> list[Doc]:
    """One document per public function or class of ``modules``, in a fixed order; an object
    exported by two modules is kept under its first name."""
    docs, seen = [], set()
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", [])):
            obj = getattr(module, name, None)
            is_class = inspect.isclass(obj)
            own_doc = vars(obj).get("__doc__") if is_class else getattr(obj, "__doc__", None)
            if not (is_class or inspect.isroutine(obj)) or not isinstance(own_doc, str) or id(obj) in seen:
                continue
            seen.add(id(obj))
            try:
                signature = _ADDRESS.sub("", str(inspect.signature(obj)))
            except (TypeError, ValueError):  # some C functions and classes have none
                signature = ""
            docs.append(Doc(f"{module_name}.{name}", "class" if is_class else "function", signature,
                            inspect.cleandoc(own_doc)))
    return docs


def signature_defaults(signature: str) -> dict[str, str]:
    """Parameter -> default (as source text) of a signature string; {} if it does not parse.
    A default shown as ``<function copy2>`` becomes ``...``."""
    try:
        args = ast.parse(f"def f{re.sub(r'<[^<>]*>', '...', signature)}: pass").body[0].args
    except SyntaxError:
        return {}
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {arg.arg: ast.unparse(default) for arg, default in pairs}


def summary(doc: Doc) -> str | None:
    """The docstring's first sentence, if it can name the document on its own: 4+ words, no
    signature-like text and not the object's own name."""
    paragraph = " ".join(doc.body.split("\n\n")[0].split()).replace("``", "`")
    first = re.split(r"(?<=[a-z)])\.(?:\s|$)", paragraph)[0].rstrip(".")
    short = doc.doc_id.rsplit(".", 1)[1].lower()
    if len(first.split()) < 4 or "(" in first or "=" in first or re.search(rf"\b{re.escape(short)}\b", first.lower()):
        return None
    return first


def describe(text: str) -> str:
    """'Return the x' -> 'returns the x'; other summaries are quoted."""
    verb, _, rest = text.partition(" ")
    if verb.lower() not in _VERBS:
        return f'is described as "{text}"'
    verb = verb.lower()
    verb = verb[:-1] + "ies" if verb.endswith("y") else verb + ("es" if verb.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{verb} {rest}"


def all_questions(corpus: list[Doc]) -> list[Task]:
    """Every question the corpus allows, in a fixed order."""
    summaries = Counter(s.lower() for s in map(summary, corpus) if s)
    out = []
    for doc in corpus:
        text = summary(doc)
        unique = text is not None and summaries[text.lower()] == 1
        if unique:
            out.append({"kind": "name", "source": doc.doc_id, "answer": doc.doc_id,
                        "prompt": f"Which Python standard-library function or class {describe(text)}? "
                                  f"Answer with its full name, like `module.name`."})
        for param, default in signature_defaults(doc.signature).items():
            if not _short_literal(default):
                continue
            out.append({"kind": "default", "source": doc.doc_id, "answer": default, "param": param,
                        "prompt": f"In the Python standard library, what is the default value of the `{param}` "
                                  f"parameter of `{doc.doc_id}`?"})
            if unique:
                out.append({"kind": "described_default", "source": doc.doc_id, "answer": default, "param": param,
                            "prompt": f"A Python standard-library {doc.kind} {describe(text)}. What is the default "
                                      f"value of its `{param}` parameter?"})
    for task in out:
        task["id"] = f"search/{task['kind']}/{task['source']}" + (f"/{task['param']}" if "param" in task else "")
    return out


def _short_literal(source: str) -> bool:
    try:
        ast.literal_eval(source)
    except (ValueError, SyntaxError):
        return False
    # None (the most common default by far) would make "None" a free answer; backslashes are hard to write in JSON
    return source != "None" and "\\" not in source and len(source) <= 24 and bool(re.search(r"\w", source))


def heldout(doc_id: str) -> bool:
    """One document in four, by a hash of its id, is heldout (all of its questions with it)."""
    return hashlib.sha256(doc_id.encode()).digest()[0] % 4 == 0


def normalise(text: str) -> str:
    text = " ".join(str(text).strip().lower().split())
    text = text.strip("`\"' .")
    return text.removesuffix("()")


def token_f1(prediction: str, truth: str, given: str = "") -> float:
    """SQuAD-style F1 over the words (``\\w+``) of the normalised texts, leaving out of both the
    words of ``given`` (the question): restating the question earns no partial credit (RL found
    that echoing it scored a little F1 through the module name a question mentions)."""
    def words(text: str) -> list[str]:
        return re.findall(r"\w+", normalise(text))

    known = set(words(given))
    predicted, expected = [w for w in words(prediction) if w not in known], [w for w in words(truth) if w not in known]
    if not expected:  # the question holds the whole answer: plain F1
        predicted, expected = words(prediction), words(truth)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return float(predicted == expected)
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def match_query(text: str) -> str:
    """User text as a safe FTS5 query: an OR of its quoted words (no FTS5 syntax survives)."""
    words = re.findall(r"[^\W_]+", text)[:MAX_TERMS]
    if not words:
        raise ValueError("the query has no words to search for")
    return " OR ".join(f'"{w}"' for w in words)


def bm25_search(db: sqlite3.Connection, query: str, k: int) -> list[dict[str, str]]:
    sql = (f"SELECT doc_id, title, snippet(docs, 3, '', '', '...', 16) AS snippet FROM docs "
           f"WHERE docs MATCH ? ORDER BY {RANK}, doc_id LIMIT ?")
    return [dict(row) for row in db.execute(sql, (match_query(query), k))]


class Search(SQLiteApp):
    """Answer questions about the Python standard library by searching and reading its docs."""

    name: ClassVar[str] = "search"
    description: ClassVar[str] = "Agentic BM25 search over Python standard-library documentation."
    system_prompt: ClassVar[str] = (
        "You answer questions about the Python standard library using a documentation corpus. "
        "search(query) finds documents, read(doc_id) shows one (its signature and docstring), "
        "answer(text) gives your final short answer. Document ids are qualified names such as `json.dumps`.")
    schema: ClassVar[str] = SCHEMA
    weights: ClassVar[dict[str, float]] = {"exact": 1.0, "answer_f1": 1.0, "read_source": 0.5, "searched": 0.25,
                                           "format": 0.25}
    success: ClassVar[str] = "exact"
    modules: tuple[str, ...] = MODULES
    kinds: tuple[str, ...] = KINDS  # the question kinds ``tasks`` gives (e.g. SFT demos of only some kinds)

    @functools.cached_property
    def corpus(self) -> dict[str, Doc]:
        """doc_id -> document, in the corpus's order."""
        return {doc.doc_id: doc for doc in build_corpus(tuple(self.modules))}

    @functools.cached_property
    def question_pool(self) -> list[Task]:
        return all_questions(list(self.corpus.values()))

    def seed_data(self, db: sqlite3.Connection, rng: random.Random) -> None:
        db.executemany("INSERT INTO docs VALUES (?, ?, ?, ?)",
                       [(d.doc_id, d.title, d.signature, d.body) for d in self.corpus.values()])

    @property
    def template(self) -> sqlite3.Connection:
        try:
            return super().template
        except sqlite3.OperationalError as error:  # "no such module: fts5"
            raise RuntimeError(f"the search env needs SQLite with FTS5 (this is {sqlite3.sqlite_version}): "
                               f"{error}") from error

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        """Questions of documents in ``split``, the kinds interleaved, in a seeded order."""
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be train or heldout, not {split!r}")
        if unknown := set(self.kinds) - set(KINDS):
            raise ValueError(f"search: unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        rng = random.Random(f"search:{split}:{seed}")
        own = [dict(t) for t in self.question_pool if heldout(t["source"]) == (split == "heldout")]
        pools = [[t for t in own if t["kind"] == kind] for kind in KINDS if kind in self.kinds]
        for pool in pools:
            rng.shuffle(pool)
        interleaved = [t for round_ in zip(*pools) for t in round_]
        interleaved += [t for pool in pools for t in pool[min(map(len, pools)):]]
        return interleaved[:n]

    def setup(self, state: State) -> None:
        super().setup(state)
        self.db(state).execute("PRAGMA query_only = ON")  # tools only read; snapshots need not carry the index
        state.data.update(searches=[], reads=[])

    def save_resources(self, state: State) -> dict[str, bytes]:
        return {}

    def load_resources(self, state: State, blobs: dict[str, bytes]) -> None:
        data = dict(state.data)
        self.setup(state)
        state.data = data

    @tool
    def search(self, state: State, query: str, k: Annotated[int, Field(ge=1, le=10)] = 5) -> list[dict[str, str]]:
        """Search the documentation; results are ranked best first (BM25).

        Args:
            query: words to look for, e.g. "copy a directory tree".
            k: how many results to return (1 to 10).
        """
        results = bm25_search(self.db(state), query, k)
        state.data["searches"].append(query)
        return results

    @tool
    def read(self, state: State, doc_id: str) -> str:
        """Read one document: its signature and full docstring.

        Args:
            doc_id: the document's id as search shows it, e.g. "json.dumps".
        """
        if doc_id not in self.corpus:
            close = difflib.get_close_matches(doc_id, list(self.corpus), n=3)
            raise ValueError(f"no document {doc_id!r}" + (f"; did you mean {', '.join(close)}?" if close else ""))
        state.data["reads"].append(doc_id)
        return self.corpus[doc_id].text

    @tool
    def answer(self, state: State, text: str) -> str:
        """Give the final answer and end the conversation.

        Args:
            text: the answer only, e.g. "True" or "json.dumps".
        """
        self.finish(state, text, "answer")
        return "answer recorded"

    def demonstrate(self, task: Task) -> list[str] | None:
        """Search (the question, else the document id a ``default`` question names), read the
        source, answer. None when no such search shows the source in its top 10: a demo that
        reads a document it was never shown would teach guessing ids. A default's answer first
        writes the parameter as the signature has it (``In the signature: p=70.``): the 135M model
        copies a value after ``p=`` (21 of 30 training questions, top-1) but not at the opening
        of the answer call (0 of 30; docs/agents.md)."""
        queries = [task["prompt"]] + ([task["source"]] if task["kind"] == "default" else [])
        for query in queries:
            for k in (5, 10):
                if any(hit["doc_id"] == task["source"] for hit in bm25_search(self.template, query, k)):
                    search = call_text("search", query=query) if k == 5 else call_text("search", query=query, k=k)
                    answer = call_text("answer", text=task["answer"])
                    if task["kind"] != "name":
                        answer = f"In the signature: {task['param']}={task['answer']}.\n{answer}"
                    return [search, call_text("read", doc_id=task["source"]), answer]
        return None

    def score(self, state: State) -> dict[str, float]:
        answer, truth = state.answer or "", state.task["answer"]
        attempts = state.counters["tool_calls"] + state.counters["tool_errors/malformed"]
        well_formed = attempts - sum(state.counters[key] for key in FORMAT_ERRORS)
        return {"exact": float(normalise(answer) == normalise(truth)),
                "answer_f1": token_f1(answer, truth, state.task["prompt"]),
                "read_source": float(state.task["source"] in state.data["reads"]),
                "searched": float(bool(state.data["searches"])),
                "format": well_formed / attempts if attempts else 0.0}


def baseline_answer(env: Search, task: Task) -> tuple[str, str | None]:
    """(answer, top hit) from BM25's top hit for the raw question: its id for a ``name``
    question, else the default of the asked parameter in its signature."""
    hits = bm25_search(env.template, task["prompt"], 1)
    if not hits:
        return "", None
    top = hits[0]["doc_id"]
    if task["kind"] == "name":
        return top, top
    return signature_defaults(env.corpus[top].signature).get(task["param"], ""), top


def bm25_baseline(env: Search, tasks: list[Task]) -> dict[str, Any]:
    """Exact match, token F1 and top-1 source hit rate of ``baseline_answer``, overall and per kind."""
    rows = []
    for task in tasks:
        answer, top = baseline_answer(env, task)
        rows.append((task["kind"], float(normalise(answer) == normalise(task["answer"])),
                     token_f1(answer, task["answer"], task["prompt"]), float(top == task["source"])))
    out: dict[str, Any] = {"n": len(rows)}
    for kind in (None, *KINDS):
        own = [r for r in rows if kind is None or r[0] == kind]
        if own:
            suffix = f"/{kind}" if kind else ""
            for index, metric in ((1, "exact"), (2, "answer_f1"), (3, "top1_source")):
                out[metric + suffix] = statistics.fmean(r[index] for r in own)
    return out
