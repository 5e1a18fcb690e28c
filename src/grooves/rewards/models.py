"""Learned reward models: a frozen LM backbone, mean-pooled features and a linear head.

A reward model (RM) maps a text to one number. Features are the backbone decoder's last
hidden state averaged over each text's real tokens (lengths are tracked; padding is never
found through ``pad_token_id``, which is eos for SmolLM2), standardised with the training
rows' mean and std. The backbone is never trained (``mode = "frozen"``); a LoRA-tuned
backbone is not implemented. Two objectives share those features:

- regression: ridge regression of the transformed target, closed form; the ridge strength
  is chosen on an inner validation split of the training rows. Scores are in target space
  after the transform (``log1p``: predicted log1p points), not transformed back.
- Bradley-Terry (``groups=``): rows that share a group value are compared, the higher target
  wins, ties give no comparison. P(a beats b) = sigmoid(s(a) - s(b)) with a linear s and an
  L2 penalty chosen on inner validation, fitted by Newton's method. Scores are log-odds
  units: only their differences mean something.

A folder holds ``reward_model.json`` (backbone, mode, pooling, transform, metrics, ...) and
``head.safetensors`` (feature mean and std, weight, bias), written atomically.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from grooves.progress import Reporter
from grooves.rewards.compose import ComponentError, RewardComponent, task_arguments
from grooves.rewards.rm_fit import (  # noqa: F401  (re-exported: the RM API is one module)
    MIN_HELDOUT, MIN_TRAIN, TRANSFORMS, RewardModelError, TrainingData, comparison_pairs, fit_bradley_terry,
    fit_pairwise, fit_ridge, group_split, heldout_split, pair_accuracy, pearson, ranks, read_csv, spearman,
    transform_targets,
)
from grooves.rewards.runner import in_thread
from grooves.types import Group, nan_to_none

FORMAT = "grooves-reward-model"
SCALES = (None, "z", "sigmoid")


# --- features ------------------------------------------------------------------------------

_BACKBONES: dict[str, tuple[Any, Any]] = {}
_BACKBONES_LOCK = threading.Lock()
_FORWARD_LOCK = threading.Lock()  # one forward at a time: _frozen toggles a possibly shared model


def shared_backbone(spec: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``spec``, loaded once per process and shared by every RM."""
    from grooves.policy.models import load_model

    with _BACKBONES_LOCK:
        if spec not in _BACKBONES:
            _BACKBONES[spec] = load_model(spec)
        return _BACKBONES[spec]


@contextmanager
def _frozen(model):
    """Eval mode and, on a PEFT model, adapters off: features must come from the base weights,
    also when the backbone is the trainer's own (adapter-wrapped, training-mode) model."""
    from peft import PeftModel

    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter() if isinstance(model, PeftModel) else nullcontext():
            yield
    finally:
        model.train(was_training)


def embed(model, tokenizer, texts: list[str], batch_size: int = 32, max_tokens: int = 128,
          progress: bool | Reporter = False) -> np.ndarray:
    """Mean-pooled last hidden state of each text, (N, H) float64.

    Texts are sorted by token count so a batch pads little; padding goes on the right and
    the mean covers each text's own tokens, so (causal attention) a text's features do not
    depend on its batch beyond float rounding. An empty text is read as one eos token.
    ``progress``: a ``Reporter``, or True for one on stderr (a log gets a line at most every 10 s).
    """
    import torch

    reporter = progress if isinstance(progress, Reporter) else Reporter(enabled=progress)

    filler = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids = [row or [filler] for row in
           tokenizer(list(texts), truncation=True, max_length=max_tokens)["input_ids"]]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    device = next(model.parameters()).device
    features = np.zeros((len(ids), model.config.hidden_size))
    reporter.phase("features", f"{len(ids)} texts, {batch_size} per batch")
    with _FORWARD_LOCK, _frozen(model), torch.inference_mode(), \
            reporter.counting(len(ids), unit="texts", every=10.0):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            lengths = torch.tensor([len(ids[i]) for i in batch])  # (B,)
            tokens = torch.full((len(batch), int(lengths.max())), filler, dtype=torch.long)  # (B, T)
            for row, i in enumerate(batch):
                tokens[row, :len(ids[i])] = torch.tensor(ids[i])
            mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]  # (B, T)
            hidden = model.get_decoder()(input_ids=tokens.to(device),
                                         attention_mask=mask.long().to(device)).last_hidden_state
            pooled = (hidden.float().cpu() * mask[..., None]).sum(1) / lengths[:, None]  # (B, H)
            features[batch] = pooled.double().numpy()
            reporter.advance(start + len(batch))
    return features


# --- the reward model ----------------------------------------------------------------------


class RewardModel:
    """A trained RM: its settings (``config``, as in reward_model.json) and linear head.

    The backbone loads on the first ``score`` (once per process per spec), unless ``base``,
    an already-loaded ``(model, tokenizer)`` of the same backbone, is given.
    """

    def __init__(self, config: dict[str, Any], head: dict[str, np.ndarray], base: tuple[Any, Any] | None = None):
        self.config = config
        self.head = head
        self.base = base

    @property
    def backbone(self) -> tuple[Any, Any]:
        if self.base is None:
            self.base = shared_backbone(self.config["backbone"])
        return self.base

    def features(self, texts: list[str], progress: bool = False) -> np.ndarray:
        """Standardised features, (N, H); checks the backbone matches the head."""
        model, tokenizer = self.backbone
        if model.config.hidden_size != len(self.head["mean"]):
            raise RewardModelError(f"backbone {self.config['backbone']!r} gives {model.config.hidden_size}-dim "
                                   f"features, but this head expects {len(self.head['mean'])}")
        x = embed(model, tokenizer, texts, self.config["batch_size"], self.config["max_tokens"], progress)
        return (x - self.head["mean"]) / self.head["std"]

    def score(self, texts: list[str], progress: bool = False) -> list[float]:
        """One score per text: predicted target after the transform (regression), or a
        Bradley-Terry score in log-odds units (pairwise)."""
        if not texts:
            return []
        return self.score_features(self.features(list(texts), progress)).tolist()

    def score_features(self, x: np.ndarray) -> np.ndarray:
        return x @ self.head["weight"] + float(self.head["bias"][0])

    def save(self, folder: str | Path) -> Path:
        """Write the folder atomically: a finished temporary folder replaces ``folder``."""
        from safetensors.numpy import save_file

        folder = Path(folder)
        if (folder.exists() and not (folder / "reward_model.json").exists()
                and (not folder.is_dir() or any(folder.iterdir()))):
            raise RewardModelError(f"{folder} exists and is not a reward model folder; refusing to overwrite it")
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in self.head.items()}, str(tmp / "head.safetensors"))
            # NaN (e.g. the correlation of a constant prediction) is written as null: strict JSON.
            (tmp / "reward_model.json").write_text(json.dumps(nan_to_none(self.config), indent=2) + "\n")
            old = folder.with_name(tmp.name + "-old")
            if folder.exists():
                os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return folder

    @classmethod
    def load(cls, folder: str | Path, base: tuple[Any, Any] | None = None) -> RewardModel:
        """Read a saved RM (settings and head only; the backbone loads when first needed)."""
        from safetensors.numpy import load_file

        folder = Path(folder)
        if not folder.is_dir():
            raise RewardModelError(f"reward model folder {folder} does not exist")
        meta, head_file = folder / "reward_model.json", folder / "head.safetensors"
        if not meta.is_file() or not head_file.is_file():
            raise RewardModelError(f"{folder} is not a reward model folder (it needs reward_model.json and "
                                   f"head.safetensors); train one with `grooves rm train`")
        try:
            config = json.loads(meta.read_text())
            head = load_file(str(head_file))
        except (ValueError, OSError) as error:
            raise RewardModelError(f"{folder} holds a damaged reward model: {error}") from None
        if not isinstance(config, dict) or config.get("format") != FORMAT or config.get("mode") != "frozen":
            raise RewardModelError(f"{meta} is not a grooves frozen-backbone reward model")
        metrics = config.get("metrics", {})
        config["metrics"] = {k: math.nan if v is None else v for k, v in metrics.items()}
        if sorted(head) != ["bias", "mean", "std", "weight"]:
            raise RewardModelError(f"{head_file} has tensors {sorted(head)}; expected bias, mean, std, weight")
        return cls(config, head, base)


def _split(y: np.ndarray, groups: list[str] | None, fraction: float, seed: int):
    """(train rows, held-out rows, train pairs, held-out pairs), checked big enough to fit and judge."""
    if groups is None:
        train, heldout = heldout_split(len(y), fraction, seed)
        pairs, sizes, need, unit = (None, None), (len(train), len(heldout)), (MIN_TRAIN, MIN_HELDOUT), "rows"
    else:
        train, heldout = group_split(groups, fraction, seed)
        pairs = tuple(comparison_pairs(y, groups, rows) for rows in (train, heldout))
        sizes, need, unit = (len(pairs[0]), len(pairs[1])), (2, 1), "comparisons"
    if sizes[0] < need[0] or sizes[1] < need[1]:
        raise RewardModelError(f"too few rows for a split: {len(y)} rows with held-out fraction {fraction} give "
                               f"{sizes[0]} training and {sizes[1]} held-out {unit}; need at least {need[0]} "
                               f"and {need[1]}")
    return train, heldout, *pairs


def _metrics(scores: np.ndarray, y: np.ndarray, train: np.ndarray, heldout: np.ndarray, pairs) -> dict[str, float]:
    if pairs[0] is not None:
        return {"pairwise_accuracy": pair_accuracy(scores, pairs[1]), "n_train_pairs": len(pairs[0]),
                "n_heldout_pairs": len(pairs[1]), "train_pairwise_accuracy": pair_accuracy(scores, pairs[0])}
    s, t = scores[heldout], y[heldout]
    return {"pearson": pearson(s, t), "spearman": spearman(s, t), "rmse": float(np.sqrt(np.mean((s - t) ** 2))),
            "train_pearson": pearson(scores[train], y[train])}


def train_reward_model(texts: list[str], targets, *, backbone: str = "bundled:smollm2-135m-instruct",
                       groups: list[str] | None = None, transform: str = "none", heldout_fraction: float = 0.1,
                       seed: int = 0, batch_size: int = 32, max_tokens: int = 128,
                       base: tuple[Any, Any] | None = None, progress: bool | Reporter = False) -> RewardModel:
    """Fit an RM (regression, or Bradley-Terry when ``groups`` is given) on a seeded split;
    held-out metrics land in ``config["metrics"]``. Sizes are checked before the slow features."""
    y = transform_targets(np.asarray(targets, dtype=np.float64), transform)
    if len(texts) != len(y) or (groups is not None and len(groups) != len(y)):
        raise RewardModelError(f"{len(texts)} texts, {len(y)} targets and groups of a different length")
    train, heldout, *pairs = _split(y, groups, heldout_fraction, seed)
    reporter = progress if isinstance(progress, Reporter) else Reporter(enabled=progress)
    if base is None:
        reporter.phase("loading", f"backbone {backbone}")
    model, tokenizer = base or shared_backbone(backbone)
    start = time.perf_counter()
    x = embed(model, tokenizer, texts, batch_size, max_tokens, reporter)
    seconds_features, start = time.perf_counter() - start, time.perf_counter()
    reporter.phase("fitting", "ridge head" if groups is None else "Bradley-Terry head")
    mean, std = x[train].mean(0), x[train].std(0)
    std[std < 1e-12] = 1.0  # a constant feature carries nothing; avoid 0/0
    z = (x - mean) / std
    if groups is None:
        weight, bias, strength = fit_ridge(z[train], y[train], seed)
    else:
        (weight, strength), bias = fit_pairwise(z, pairs[0], groups, seed), 0.0
    scores = z @ weight + bias
    metrics = {"n_train": len(train), "n_heldout": len(heldout), "seconds_features": round(seconds_features, 3),
               "seconds_fit": round(time.perf_counter() - start, 3), **_metrics(scores, y, train, heldout, pairs)}
    config = {
        "format": FORMAT, "version": 1, "backbone": backbone, "mode": "frozen", "pooling": "mean",
        "objective": "regression" if groups is None else "bradley_terry",
        "head": "ridge" if groups is None else "linear_bradley_terry", "regularisation": strength,
        "transform": transform, "feature_normalisation": "standardise: training-row mean and std (head.safetensors)",
        "max_tokens": max_tokens, "batch_size": batch_size, "heldout_fraction": heldout_fraction, "seed": seed,
        "score_mean": float(scores[train].mean()), "score_std": float(scores[train].std() or 1.0),
        "metrics": metrics, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    head = {"mean": mean, "std": std, "weight": weight, "bias": np.array([bias])}
    return RewardModel(config, head, (model, tokenizer))


# --- as a reward component -----------------------------------------------------------------


class RewardModelComponent(RewardComponent):
    """A learned RM as a reward component: scores ``input`` (a format string over the
    completion and the task's columns) for each trajectory, in a worker thread.

    ``scale``: None gives the RM's raw score; ``"z"`` subtracts the mean and divides by the
    std of its scores on its training rows; ``"sigmoid"`` maps that z into (0, 1).
    """

    def __init__(self, name: str, path_or_model: str | Path | RewardModel, weight: float = 1.0,
                 required: bool = True, input: str = "{completion}", scale: str | None = None,
                 base: tuple[Any, Any] | None = None):
        super().__init__(name, weight, required)
        if scale not in SCALES:
            raise ValueError(f"reward model {name!r}: unknown scale {scale!r}; allowed: none, z, sigmoid")
        model = path_or_model if isinstance(path_or_model, RewardModel) else RewardModel.load(path_or_model)
        if base is not None:  # a new RewardModel: the caller's keeps its own backbone
            model = RewardModel(model.config, model.head, base)
        self.model, self.input, self.scale = model, input, scale
        self._texts, self._seconds = 0, 0.0

    def _text(self, trajectory, group: Group) -> str:
        available = task_arguments(trajectory, group)
        try:
            return self.input.format(**available)
        except (KeyError, IndexError, AttributeError) as error:
            raise ComponentError(f"input {self.input!r} asks for {error}, which is not among "
                                 f"{sorted(available)}") from None

    def _score(self, texts: list[str]) -> list[float]:
        start = time.perf_counter()
        scores = np.asarray(self.model.score(texts))
        self._texts, self._seconds = self._texts + len(texts), self._seconds + time.perf_counter() - start
        if self.scale is not None:
            scores = (scores - self.model.config["score_mean"]) / self.model.config["score_std"]
        if self.scale == "sigmoid":
            scores = 0.5 * (1 + np.tanh(scores / 2))
        return scores.tolist()

    async def score_group(self, group: Group) -> list[float]:
        texts = [self._text(t, group) for t in group.trajectories]
        return await in_thread(self._score, texts)  # torch must not block the event loop

    def counters(self) -> dict[str, float]:
        return {"texts": float(self._texts), "seconds": self._seconds}
