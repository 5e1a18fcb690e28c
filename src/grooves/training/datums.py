"""The trainer primitives' data, in the shape of Tinker's: per-token datums for ``forward_backward``
and their padding into tensors, the loss settings, the output, and ``optim_step``'s AdamW settings.

A datum is one sequence with one value per position for each loss input; ``DatumBatch`` pads
a list of them over their loss positions (``start`` on), in the ``TokenBatch`` layout that the
log-prob paths of ``grooves.policy.logprobs`` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grooves.policy.logprobs import TokenBatch
from grooves.types import Trajectory


@dataclass
class Datum:
    """One sequence for ``forward_backward``, per position as in Tinker's ``Datum``.

    Position ``i`` reads ``tokens[: i + 1]`` and is scored on ``target_tokens[i]``; every loss
    input has one value per position. Positions before ``start`` are outside the loss and get no
    log-prob, so a prompt shared by several datums runs once.
    """

    tokens: list[int]  # (N,) what the model reads
    target_tokens: list[int]  # (N,) what each position is scored on
    weights: list[float] | None = None  # (N,) per-token loss weight; None = 1 everywhere
    logprobs: list[float] | None = None  # (N,) the sampler's (old policy); None = the current policy's
    advantages: list[float] | None = None  # (N,)
    ref_logprobs: list[float] | None = None  # (N,) the reference model's, for a KL term
    start: int = 0
    # (N,) the sampler's, when ``logprobs`` are not: the importance-sampling correction and the
    # sampler/trainer mismatch diagnostics compare them with the old policy's (grooves' extension)
    sampler_logprobs: list[float] | None = None


@dataclass
class DatumBatch:
    """Datums padded into tensors over their loss positions ``start..N-1``: ``(B, T)`` each."""

    tokens: TokenBatch  # input_ids and targets; mask = 1 on every position from start
    weights: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    lengths: list[int]  # positions per datum from its start
    shifted: bool  # every target is the next input token (the shared-prompt path needs it)
    sampler_logprobs: torch.Tensor | None = None

    @classmethod
    def build(cls, datums: list[Datum], device: torch.device | str = "cpu") -> DatumBatch:
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        for index, datum in enumerate(datums):
            _check_datum(index, datum)
        for name in ("logprobs", "ref_logprobs", "sampler_logprobs"):
            if len({getattr(d, name) is None for d in datums}) > 1:
                raise ValueError(f"either every datum has {name} or none has")
        shifted = all(d.tokens[d.start + 1:] == d.target_tokens[d.start: -1] for d in datums)
        rows = [d.tokens + d.target_tokens[-1:] if shifted else d.tokens for d in datums]
        lengths = [len(d.tokens) - d.start for d in datums]
        width = max(lengths)
        input_ids = torch.zeros(len(datums), max(map(len, rows)), dtype=torch.long)
        for row, ids in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)

        def padded(name: str, default: float, dtype=torch.float) -> torch.Tensor:
            out = torch.zeros(len(datums), width, dtype=dtype)
            for row, d in enumerate(datums):
                values = getattr(d, name)
                out[row, : lengths[row]] = default if values is None else torch.tensor(values[d.start:], dtype=dtype)
            return out.to(device)

        region = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()  # (B, T)
        old = padded("logprobs", 0.0)
        tokens = TokenBatch(input_ids.to(device), torch.tensor([d.start + 1 for d in datums], device=device),
                            padded("target_tokens", 0, torch.long), region.to(device), old)
        has_old, has_ref = datums[0].logprobs is not None, datums[0].ref_logprobs is not None
        sampler = padded("sampler_logprobs", 0.0) if datums[0].sampler_logprobs is not None else None
        return cls(tokens, padded("weights", 1.0) * tokens.mask, padded("advantages", 0.0),
                   old if has_old else None, padded("ref_logprobs", 0.0) if has_ref else None, lengths, shifted,
                   sampler)

    def select(self, rows: torch.Tensor) -> DatumBatch:
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return DatumBatch(self.tokens.select(rows), self.weights[rows], self.advantages[rows],
                          pick(self.old_logprobs), pick(self.ref_logprobs),
                          [self.lengths[r] for r in rows.tolist()], self.shifted, pick(self.sampler_logprobs))


def _check_datum(index: int, datum: Datum) -> None:
    n = len(datum.tokens)
    if n == 0 or len(datum.target_tokens) != n:
        raise ValueError(f"datum {index}: needs tokens, and as many target_tokens as tokens "
                         f"({n} tokens, {len(datum.target_tokens)} target_tokens)")
    if not 0 <= datum.start < n:
        raise ValueError(f"datum {index}: start {datum.start} is outside its {n} positions")
    for name in ("weights", "logprobs", "advantages", "ref_logprobs", "sampler_logprobs"):
        values = getattr(datum, name)
        if values is not None and len(values) != n:
            raise ValueError(f"datum {index}: {name} has {len(values)} values for {n} positions")


def trajectory_datums(trajectories: list[Trajectory], batch: TokenBatch, weights: torch.Tensor,
                      advantages: torch.Tensor, old_logp: torch.Tensor | None,
                      ref_logp: torch.Tensor | None, sampler_logp: torch.Tensor | None = None) -> list[Datum]:
    """One datum per trajectory: the sequence shifted by one, the loss from the first completion token.

    ``weights`` (the aggregation), ``old_logp``, ``ref_logp`` and ``sampler_logp`` are ``(B, T)``
    over completion tokens, as ``batch``; ``advantages`` is ``(B,)`` and becomes one value per token.
    """
    datums = []
    for row, t in enumerate(trajectories):
        sequence = t.prompt_ids + t.completion_ids
        start, c = len(t.prompt_ids) - 1, len(t.completion_ids)

        def positions(values: torch.Tensor | None) -> list[float] | None:
            return None if values is None else [0.0] * start + values[row, :c].tolist()

        datums.append(Datum(sequence[:-1], sequence[1:], weights=positions(weights),
                            logprobs=positions(old_logp), advantages=positions(advantages[:, None].expand_as(weights)),
                            ref_logprobs=positions(ref_logp), start=start,
                            sampler_logprobs=positions(sampler_logp)))
    return datums


@dataclass
class LossConfig:
    """Settings of one ``forward_backward`` call's loss."""

    eps_low: float | None = None  # None = the loss's default (Tinker's 0.2 for ppo and cispo)
    eps_high: float | None = None
    kl_coef: float = 0.0  # adds kl_coef * k3(logp, ref_logprobs) per token
    entropy: bool = False  # report the token-mean entropy (costs a softmax over the vocabulary)
    is_level: str | None = None  # "token" / "sequence": weight the policy loss by exp(old - sampler)
    is_mode: str = "truncate"  # or "mask"
    is_cap: float = 3.0
    dual_clip: float | None = None
    kl_ratio: str | None = None  # "token" / "sequence": k3 * pi/pi_old, the bias-corrected KL (TRL's)
    loss_options: dict[str, float] = field(default_factory=dict)  # the loss's own settings (SAPO's, VESPO's)


@dataclass
class ForwardBackwardOutput:
    loss: float  # the summed loss of every datum
    logprobs: list[torch.Tensor]  # per datum, positions start..N-1
    sums: dict[str, float] = field(default_factory=dict)  # diagnostics over the loss's tokens
    counts: dict[str, float] = field(default_factory=dict)
    finite: bool = True  # False: a non-finite loss; every accumulated gradient was dropped
    active: float = 0.0  # tokens whose loss has a gradient: weight != 0 and (advantage != 0 or a KL term)
    ratios: list[torch.Tensor] = field(default_factory=list)  # sampler importance ratios (diagnostic)

    def metrics(self) -> dict[str, float]:
        """Tinker-style metric names: ``name:reduction``."""
        out = {"loss:sum": self.loss}
        out.update({f"{name}:mean": total / max(self.counts[name], 1.0) for name, total in self.sums.items()})
        return out


@dataclass
class AdamParams:
    """One ``optim_step``'s AdamW settings (decoupled weight decay). The defaults are torch's, as
    ``train_step`` has always used; Tinker's SDK sends its own (beta2 0.95, eps 1e-12)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping
