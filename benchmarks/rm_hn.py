"""A frozen-backbone reward model on Hacker News titles, against simple peers.

Task: predict log1p(num_points) of a story from its title, on all rows of
../shared/data/hn/hacker_news.csv, with one seeded 90/10 split shared by every model:

  (a) constant   the training mean (Pearson/Spearman are undefined: no variation)
  (b) ngram      ridge regression on binary word unigram + bigram features (the most
                 frequent ``--vocab`` in the training titles), numpy only
  (c) rm         ``grooves rm train``'s pipeline: bundled SmolLM2-135M frozen, mean-pooled
                 last hidden state, ridge head (alpha chosen on an inner split)

Both ridge models use the same code (``grooves.rewards.models.fit_ridge``) on standardised
features, so the comparison is about the features. Peak RSS is the process's high-water
mark after each stage; it only grows, so the stages run constant, rm, n-gram, and the
n-gram row shows the larger of the rm's and its own.

    python benchmarks/rm_hn.py [--data PATH] [--vocab 2000] [--batch-size 32]

The last line is machine-readable:
``rm_hn pearson=X spearman=Y baseline_pearson=Z n_train=A n_heldout=B seconds=S``
(the rm's held-out figures, the n-gram baseline's Pearson, and the whole run's seconds).
"""

from __future__ import annotations

import argparse
import re
import resource
import time
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console

from grooves.progress import Reporter
from grooves.rewards.models import (fit_ridge, heldout_split, pearson, read_csv, spearman,
                                    train_reward_model)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "hn" / "hacker_news.csv"
BACKBONE = "bundled:smollm2-135m-instruct"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def ngrams(title: str) -> set[str]:
    words = re.findall(r"[a-z0-9]+", title.lower())
    return set(words) | {f"{a} {b}" for a, b in zip(words, words[1:])}


def ngram_features(titles: list[str], train: np.ndarray, vocab_size: int) -> np.ndarray:
    """(N, V) 0/1 features over the ``vocab_size`` n-grams found in most training titles."""
    grams = [ngrams(t) for t in titles]
    counts = Counter(g for i in train for g in grams[i])
    index = {g: j for j, (g, _) in enumerate(counts.most_common(vocab_size))}
    x = np.zeros((len(titles), len(index)))
    for row, found in enumerate(grams):
        x[row, [index[g] for g in found if g in index]] = 1.0
    return x


def evaluate(name, predictions, y, heldout, seconds_features, seconds_fit) -> dict:
    p, t = predictions[heldout], y[heldout]
    return {"model": name, "pearson": pearson(p, t), "spearman": spearman(p, t),
            "rmse": float(np.sqrt(np.mean((p - t) ** 2))), "features_s": seconds_features,
            "fit_s": seconds_fit, "peak_rss_mib": peak_rss_mib()}


def ngram_baseline(titles, y, train, heldout, vocab_size, seed) -> dict:
    start = time.perf_counter()
    x = ngram_features(titles, train, vocab_size)
    mean, std = x[train].mean(0), x[train].std(0)
    std[std < 1e-12] = 1.0
    z = (x - mean) / std
    seconds_features, start = time.perf_counter() - start, time.perf_counter()
    weight, bias, _ = fit_ridge(z[train], y[train], seed)
    return evaluate(f"ngram ridge ({x.shape[1]} word 1-2grams)", z @ weight + bias, y, heldout,
                    seconds_features, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--vocab", type=int, default=2000, help="n-gram features of the baseline")
    parser.add_argument("--batch-size", type=int, default=32, help="titles per backbone forward pass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    began = time.perf_counter()
    progress = Reporter(Console())  # stdout: a bar on a terminal, lines in a log

    progress.phase("reading", str(args.data))
    rows = read_csv(args.data, "title", "num_points")
    y = np.log1p(rows.targets)
    train, heldout = heldout_split(len(y), 0.1, args.seed)  # the split train_reward_model makes
    constant = evaluate("constant (training mean)", np.full(len(y), y[train].mean()), y, heldout, 0.0, 0.0)
    model = train_reward_model(rows.texts, rows.targets, backbone=BACKBONE, transform="log1p",
                               heldout_fraction=0.1, seed=args.seed, batch_size=args.batch_size, progress=progress)
    m = model.config["metrics"]
    assert m["n_heldout"] == len(heldout)
    rm = {"model": "rm: frozen SmolLM2-135M, mean pool, ridge", "pearson": m["pearson"],
          "spearman": m["spearman"], "rmse": m["rmse"], "features_s": m["seconds_features"],
          "fit_s": m["seconds_fit"], "peak_rss_mib": peak_rss_mib()}
    progress.phase("baseline", f"ridge on the {args.vocab} most frequent word 1-2grams")
    ngram = ngram_baseline(rows.texts, y, train, heldout, args.vocab, args.seed)
    results = [constant, ngram, rm]

    print(f"\n{len(y)} titles, log1p(num_points): mean {y.mean():.3f}, std {y.std():.3f}; "
          f"train {len(train)}, held out {len(heldout)} (seed {args.seed})\n")
    print("| model | pearson | spearman | rmse | features s | fit s | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['pearson']:.4f} | {r['spearman']:.4f} | {r['rmse']:.4f} | "
              f"{r['features_s']:.1f} | {r['fit_s']:.2f} | {r['peak_rss_mib']:.0f} |")
    print(f"\nrm_hn pearson={m['pearson']:.4f} spearman={m['spearman']:.4f} "
          f"baseline_pearson={ngram['pearson']:.4f} n_train={len(train)} n_heldout={len(heldout)} "
          f"seconds={time.perf_counter() - began:.0f}")


if __name__ == "__main__":
    main()
