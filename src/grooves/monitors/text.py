"""Text helpers of the output detectors: normalising, near-same clustering, word overlap, repeats.

All of it is plain string work (no tokenizer, no model), cheap enough to run on every
output of every step.
"""

from __future__ import annotations

import re
from collections import Counter

_NON_WORD = re.compile(r"[\W_]+")
_WORD = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset(
    "a an the and or but of to in on for with by from as at is are be been was were it its this that these "
    "those into onto over under not no can may will should would could than then there their which who whom "
    "whose what when where how why all any each every some such only also more most other another if else "
    "do does did done your you our we they them he she his her".split()
)


def normalise(text: str) -> str:
    """Lowercase, punctuation to spaces, whitespace collapsed: 'Google lays off 75%!' -> 'google lays off 75'."""
    return _NON_WORD.sub(" ", text.lower()).strip()


def shingles(normalised: str, n: int = 3) -> frozenset[str]:
    """The set of character n-grams of an already normalised text (the whole text when shorter)."""
    if len(normalised) <= n:
        return frozenset([normalised])
    return frozenset(normalised[i:i + n] for i in range(len(normalised) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    """|a ∩ b| / |a ∪ b|; two empty sets are identical (1.0)."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def near_same_clusters(texts: list[str], similarity: float, n: int = 3) -> list[list[int]]:
    """Indices of ``texts`` grouped into near-same clusters, largest first.

    Texts with the same normalised form always share a cluster. Then each distinct form,
    most frequent first, joins the first cluster whose leader (its most frequent form) has a
    character n-gram Jaccard similarity of at least ``similarity``, or leads a new cluster.
    Greedy leader clustering is order-dependent at the margins, which is fine for spotting
    one text that many tasks share.
    """
    by_form: dict[str, list[int]] = {}
    for index, text in enumerate(texts):
        by_form.setdefault(normalise(text), []).append(index)
    leaders: list[frozenset[str]] = []
    clusters: list[list[int]] = []
    for form, indices in sorted(by_form.items(), key=lambda item: (-len(item[1]), item[0])):
        grams = shingles(form, n)
        for leader, cluster in zip(leaders, clusters):
            if similarity < 1.0 and jaccard(grams, leader) >= similarity:
                cluster.extend(indices)
                break
        else:
            leaders.append(grams)
            clusters.append(list(indices))
    return sorted(clusters, key=len, reverse=True)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def content_stems(text: str) -> set[str]:
    """Words of 3+ characters that are not stopwords, cut to their first five letters
    (a crude stemmer: 'sorting' and 'sorted' match)."""
    return {w[:5] for w in words(text) if len(w) >= 3 and w not in STOPWORDS}


def overlap(output: set[str], source: set[str]) -> float:
    """Share of the output's content stems that occur in the source (0.0 for an empty output)."""
    return len(output & source) / len(output) if output else 0.0


def ngram_repeat_rate(tokens: list[str], n: int) -> tuple[float, int, str]:
    """(1 - distinct/total n-grams, number of n-grams, the most repeated n-gram) of a word list."""
    grams = [" ".join(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0, 0, ""
    counts = Counter(grams)
    return 1.0 - len(counts) / len(grams), len(grams), counts.most_common(1)[0][0]


def top_content_word(tokens: list[str]) -> tuple[str, int]:
    """The most frequent non-stopword of a word list and its count (('', 0) when none)."""
    counts = Counter(w for w in tokens if w not in STOPWORDS)
    return counts.most_common(1)[0] if counts else ("", 0)


def clip(text: str, limit: int = 160) -> str:
    """The text on one line, cut to ``limit`` characters for messages and evidence."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
