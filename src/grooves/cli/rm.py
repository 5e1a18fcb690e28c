"""``grooves rm``: train and use learned reward models."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Annotated

import typer

from grooves.cli.common import _fail, err, out

app = typer.Typer(help="Learned reward models: train one on a CSV, score texts with it.", no_args_is_help=True)


def _errors() -> tuple[type[Exception], ...]:
    from grooves.policy.models import ModelSpecError
    from grooves.rewards.models import RewardModelError

    return (RewardModelError, ModelSpecError, FileNotFoundError, UnicodeDecodeError)


@app.command()
def train(
    data: Annotated[Path, typer.Argument(help="Training data: a CSV file with a header row.")],
    text_col: Annotated[str, typer.Option(help="Column with the text to score.")],
    target_col: Annotated[str, typer.Option(help="Numeric column the model learns to predict (or to rank by).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder to write the reward model to.")],
    pair_col: Annotated[str | None, typer.Option(
        help="Pairwise (Bradley-Terry) mode: rows sharing this column's value form a comparison group, "
             "in which the row with the higher target wins; ties are skipped.")] = None,
    transform: Annotated[str, typer.Option(help="Transform of the target before fitting: none or log1p "
                                           "(log(1 + x), for counts such as upvotes).")] = "none",
    backbone: Annotated[str, typer.Option(help="Frozen backbone: bundled:smollm2-135m-instruct, tiny (random, "
                                          "for tests) or a local model folder.")] = "bundled:smollm2-135m-instruct",
    heldout_fraction: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of rows (of groups, with "
                                                    "--pair-col) held out for the reported metrics.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the held-out and inner validation splits.")] = 0,
    limit: Annotated[int | None, typer.Option(min=1, help="Use only the first N data rows.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per backbone forward pass.")] = 32,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens read per text (longer ones are cut).")] = 128,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress (bar or lines).")] = False,
) -> None:
    """Train a reward model (frozen backbone + linear head) on DATA and report held-out metrics.

    Progress (loading, features with the time left, fitting) goes to stdout with the report.
    """
    from grooves.progress import Reporter
    from grooves.rewards.models import read_csv, train_reward_model

    try:
        rows = read_csv(data, text_col, target_col, pair_col, limit)
        model = train_reward_model(rows.texts, rows.targets, backbone=backbone, groups=rows.groups,
                                   transform=transform, heldout_fraction=heldout_fraction, seed=seed,
                                   batch_size=batch_size, max_tokens=max_tokens,
                                   progress=Reporter(out, enabled=not quiet))
        model.config |= {"text_col": text_col, "target_col": target_col, "pair_col": pair_col,
                         "data": str(data)}
        model.save(out_dir)
    except _errors() as error:
        raise _fail(str(error)) from None
    _print_metrics(model.config)
    out.print(f"saved to {out_dir}", highlight=False, soft_wrap=True)


def _print_metrics(config: dict) -> None:
    metrics = config["metrics"]
    if config["objective"] == "regression":
        line = (f"held-out pearson {metrics['pearson']:.4f}  spearman {metrics['spearman']:.4f}  "
                f"rmse {metrics['rmse']:.4f}  (n_train {metrics['n_train']}, n_heldout {metrics['n_heldout']})")
    else:
        line = (f"held-out pairwise accuracy {metrics['pairwise_accuracy']:.4f}  (train pairs "
                f"{metrics['n_train_pairs']}, held-out pairs {metrics['n_heldout_pairs']})")
    timing = (f"features {metrics['seconds_features']:.1f} s, fit {metrics['seconds_fit']:.2f} s; "
              f"{config['head']} head, regularisation {config['regularisation']:.4g}")
    for text in (line, timing):
        out.print(text, highlight=False, soft_wrap=True)  # unwrapped: the numbers stay on one line


def _read_texts(file: Path, column: str | None) -> list[str]:
    if not file.is_file():
        raise FileNotFoundError(f"text file {file} does not exist")
    if column is None:
        return file.read_text(encoding="utf-8").splitlines()
    with file.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if column not in (reader.fieldnames or []):
            raise _fail(f"column {column!r} is not in {file}; its columns are: {', '.join(reader.fieldnames or [])}")
        return [row[column] or "" for row in reader]


@app.command()
def score(
    model_dir: Annotated[Path, typer.Argument(help="Reward model folder written by `grooves rm train`.")],
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to score.")] = None,
    file: Annotated[Path | None, typer.Option(help="Also score the lines of this file, or with --column "
                                              "one column of this CSV.")] = None,
    column: Annotated[str | None, typer.Option(help="With --file: read this column of a CSV instead of "
                                               "lines.")] = None,
    progress: Annotated[bool, typer.Option("--progress", help="Show a progress bar.")] = False,
) -> None:
    """Print one score per text, tab-separated from the text (regression: the predicted target
    after the model's transform; pairwise: a Bradley-Terry score, comparable between texts)."""
    from grooves.rewards.models import RewardModel

    if column is not None and file is None:
        raise _fail("--column needs --file")
    try:
        model = RewardModel.load(model_dir)
        items = list(texts or []) + (_read_texts(file, column) if file else [])
        if not items:
            raise _fail("no texts to score: pass them as arguments or with --file")
        scores = model.score(items, progress=progress)
    except _errors() as error:
        raise _fail(str(error)) from None
    for value, text in zip(scores, items):
        typer.echo(f"{value:.6f}\t{text}")
    err.print(f"{len(scores)} texts scored with {model_dir} ({model.config['objective']}, "
              f"transform {model.config['transform']})", highlight=False)
