"""Fitting reward models on plain arrays: reading the data, splits, metrics and the heads.

Everything here is numpy on features already computed (``grooves.rewards.models`` makes
them with a frozen backbone): a closed-form ridge regression whose strength is chosen on an
inner validation split, and a linear Bradley-Terry head fitted by Newton's method for
pairwise data. Pearson and Spearman are a few lines of numpy rather than a SciPy dependency.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRANSFORMS = {"none": lambda y: y, "log1p": np.log1p}
MIN_TRAIN, MIN_HELDOUT = 8, 3  # the inner split needs a few rows; a correlation needs three


class RewardModelError(ValueError):
    """Bad training data or a folder that is not a reward model; the message says which."""


# --- data ----------------------------------------------------------------------------------


@dataclass
class TrainingData:
    texts: list[str]
    targets: np.ndarray  # (N,) raw targets, before the transform
    groups: list[str] | None = None  # comparison group of each row (pairwise mode)


def read_csv(path: str | Path, text_col: str, target_col: str, pair_col: str | None = None,
             limit: int | None = None) -> TrainingData:
    """Read texts, numeric targets and optional groups; a bad value names its row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CSV file {path} does not exist")
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        columns = reader.fieldnames or []
        for name in [text_col, target_col] + ([pair_col] if pair_col else []):
            if name not in columns:
                raise RewardModelError(f"column {name!r} is not in {path}; its columns are: "
                                       f"{', '.join(columns) or '(none: the file is empty)'}")
        texts, targets, groups = [], [], []
        for row_number, row in enumerate(reader, start=1):
            if limit is not None and row_number > limit:
                break
            raw = row[target_col]
            try:
                value = float(raw)
            except (TypeError, ValueError):
                value = math.nan
            if not math.isfinite(value):
                raise RewardModelError(f"{path}: data row {row_number} (line {reader.line_num}) has "
                                       f"{target_col} = {raw!r}, which is not a finite number")
            texts.append(row[text_col] or "")
            targets.append(value)
            groups.append(row[pair_col] if pair_col else None)
    return TrainingData(texts, np.asarray(targets, dtype=np.float64), groups if pair_col else None)


def transform_targets(targets: np.ndarray, transform: str) -> np.ndarray:
    if transform not in TRANSFORMS:
        raise RewardModelError(f"unknown transform {transform!r}; allowed: {', '.join(TRANSFORMS)}")
    bad = np.flatnonzero(targets <= -1) if transform == "log1p" else []
    if len(bad):
        raise RewardModelError(f"log1p needs targets above -1; data row {bad[0] + 1} has {targets[bad[0]]}")
    return TRANSFORMS[transform](targets)


def heldout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded (train, held-out) index arrays; the same (n, fraction, seed) always gives the same split."""
    if not 0 < fraction < 1:
        raise RewardModelError(f"held-out fraction must be between 0 and 1, got {fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_heldout = int(round(n * fraction))
    return np.sort(order[n_heldout:]), np.sort(order[:n_heldout])


def comparison_pairs(targets: np.ndarray, groups: list[str], rows: np.ndarray) -> np.ndarray:
    """(P, 2) [winner, loser] row pairs: every two rows of a group whose targets differ."""
    members = defaultdict(list)
    for row in rows:
        members[groups[row]].append(int(row))
    pairs = [(a, b) if targets[a] > targets[b] else (b, a)
             for rows_of_group in members.values() for a, b in itertools.combinations(rows_of_group, 2)
             if targets[a] != targets[b]]
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


def group_split(groups: list[str], fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split rows by group, so no held-out comparison shares a text with a training one."""
    names = sorted(set(groups))
    train_groups, heldout_groups = heldout_split(len(names), fraction, seed)
    heldout = {names[i] for i in heldout_groups}
    is_heldout = np.array([g in heldout for g in groups])
    return np.flatnonzero(~is_heldout), np.flatnonzero(is_heldout)


# --- metrics -------------------------------------------------------------------------------


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    """NaN when either side is constant (checked exactly: a mean's rounding is not variation)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return math.nan
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / math.sqrt(float(a @ a) * float(b @ b)))


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1, ties sharing their average rank (as scipy.stats.rankdata, minus one)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    rank = np.empty(len(x))
    rank[order] = np.arange(len(x))
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=rank) / counts)[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return pearson(ranks(a), ranks(b))


def pair_accuracy(scores: np.ndarray, pairs: np.ndarray) -> float:
    """Share of pairs whose winner scores higher; an exact tie counts half."""
    margin = scores[pairs[:, 0]] - scores[pairs[:, 1]]
    return float(np.mean((margin > 0) + 0.5 * (margin == 0))) if len(pairs) else math.nan


# --- heads ---------------------------------------------------------------------------------


def _ridge_path(x: np.ndarray, y: np.ndarray, alphas):
    """(weight, bias) for each alpha, from one eigendecomposition of the centred Gram matrix."""
    x_mean, y_mean = x.mean(0), y.mean()
    xc = x - x_mean  # (N, H)
    evals, evecs = np.linalg.eigh(xc.T @ xc)  # (H,), (H, H)
    projected = evecs.T @ (xc.T @ (y - y_mean))  # (H,)
    for alpha in alphas:
        weight = evecs @ (projected / (evals + alpha))
        yield weight, float(y_mean - x_mean @ weight)


def fit_ridge(x: np.ndarray, y: np.ndarray, seed: int = 0) -> tuple[np.ndarray, float, float]:
    """Ridge on standardised ``x``: alpha with the lowest MSE on a seeded 20% inner split,
    then refitted on all rows. Returns (weight, bias, alpha)."""
    inner_train, inner_val = heldout_split(len(y), 0.2, seed)
    alphas = len(inner_train) * np.logspace(-6, 2, 17)
    errors = [np.mean((x[inner_val] @ w + b - y[inner_val]) ** 2)
              for w, b in _ridge_path(x[inner_train], y[inner_train], alphas)]
    alpha = float(alphas[int(np.argmin(errors))]) * len(y) / len(inner_train)
    weight, bias = next(_ridge_path(x, y, [alpha]))
    return weight, bias, alpha


def fit_bradley_terry(diffs: np.ndarray, l2: float, iterations: int = 50) -> np.ndarray:
    """w minimising mean(softplus(-diffs @ w)) + l2 |w|^2, by Newton's method (convex).

    ``diffs`` are winner minus loser features, (P, H); no bias: it cancels in s(a) - s(b).
    """
    weight = np.zeros(diffs.shape[1])
    for _ in range(iterations):
        wrong = 0.5 * (1 - np.tanh(diffs @ weight / 2))  # (P,) sigmoid(-margin), overflow-free
        grad = -(diffs.T @ wrong) / len(diffs) + 2 * l2 * weight
        hess = (diffs.T * (wrong * (1 - wrong))) @ diffs / len(diffs) + 2 * l2 * np.eye(len(weight))
        step = np.linalg.solve(hess, grad)
        weight -= step
        if np.abs(step).max() < 1e-9:
            break
    return weight


def _bt_loss(diffs: np.ndarray, weight: np.ndarray) -> float:
    return float(np.mean(np.logaddexp(0.0, -(diffs @ weight))))


def fit_pairwise(x: np.ndarray, pairs: np.ndarray, groups: list[str], seed: int = 0) -> tuple[np.ndarray, float]:
    """Bradley-Terry head: L2 with the lowest log-loss on an inner split of the training
    groups, then refitted on all pairs. Returns (weight, l2)."""
    rows = np.unique(pairs)
    inner_train, inner_val = group_split([groups[r] for r in rows], 0.2, seed)
    fit_rows, val_rows = set(rows[inner_train].tolist()), set(rows[inner_val].tolist())
    fit_pairs = pairs[[a in fit_rows and b in fit_rows for a, b in pairs]]
    val_pairs = pairs[[a in val_rows and b in val_rows for a, b in pairs]]
    l2s = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]
    if len(fit_pairs) and len(val_pairs):
        diffs = x[fit_pairs[:, 0]] - x[fit_pairs[:, 1]]
        val_diffs = x[val_pairs[:, 0]] - x[val_pairs[:, 1]]
        l2 = l2s[int(np.argmin([_bt_loss(val_diffs, fit_bradley_terry(diffs, l2)) for l2 in l2s]))]
    else:  # too few groups for an inner split: a middling penalty
        l2 = 1e-2
    return fit_bradley_terry(x[pairs[:, 0]] - x[pairs[:, 1]], l2), l2
