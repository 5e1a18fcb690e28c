"""Data-parallel training with ``torch.distributed``: ``Trainer(..., world=World.from_env())``.

Every rank calls ``train_step`` with the *same* groups (the whole global batch). Advantages and
the aggregation weights are computed over the whole batch (or mini-batch) on every rank, each
rank runs forward/backward on its contiguous shard of the rows, and the gradients are **summed**
over the ranks before the AdamW step. Because the weights already carry the global
normalisation (per token, per sequence, or Dr. GRPO's ``sequences * max_len`` constant), the sum
is exactly the 1-process gradient, whatever the aggregation; every rank then takes the same
step on the same gradient, so the adapters stay equal without a broadcast. The step's
diagnostics (loss, clipfrac, KLs, importance ratios) are reduced the same way.

Processes are started the way ``torchrun`` starts them: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in the environment; ``init_from_env()`` joins the group
(gloo on CPU, NCCL on CUDA). Only rank 0 should write files.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

DIAGNOSTICS = ("approx_kl", "clipfrac", "entropy", "is_exact", "is_masked", "is_truncated", "kl", "sampler_kl")


class World:
    """This process's place in a process group of ``size`` ranks."""

    def __init__(self, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a world of {size}")
        self.rank, self.size = rank, size

    @classmethod
    def from_env(cls) -> World | None:
        """The initialised default group as a ``World``; None when there is none or it has one rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous part of ``rows`` (empty when there are fewer rows than ranks)."""
        return rows.tensor_split(self.size)[self.rank]

    def reduce(self, out, params: list[torch.Tensor]) -> None:
        """Sum the gradients of ``params`` and ``out``'s loss, diagnostics and flags over the ranks, in place."""
        device = params[0].device
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        values = [float(not out.finite), out.active, out.loss]
        for name in DIAGNOSTICS:
            values += [float(name in out.sums), out.sums.get(name, 0.0), out.counts.get(name, 0.0)]
        totals = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        totals = totals.tolist()
        out.finite, out.active, out.loss = totals[0] == 0, totals[1], totals[2]
        for i, name in enumerate(DIAGNOSTICS):
            present, total, count = totals[3 + 3 * i: 6 + 3 * i]
            if present:
                out.sums[name], out.counts[name] = total, count
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, torch.cat(out.ratios) if out.ratios else torch.zeros(0))
        out.ratios = [r for r in gathered if r.numel()]


def init_from_env(backend: str | None = None) -> World | None:
    """Join the process group that ``torchrun`` (or ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``)
    describes; None when ``WORLD_SIZE`` is unset or 1. Gloo on CPU, NCCL when CUDA is present."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size < 2:
        return None
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
        dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=size)
    return World.from_env()


# --- the training loop under torchrun: rank 0 samples, scores, logs and saves; the others train ----


def broadcast(obj=None):
    """Rank 0's ``obj`` on every rank (pickled; the groups of a step are small)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def send_state(trainer) -> None:
    """Rank 0: the adapter and the optimizer after ``_open`` (a fresh run, or a resumed checkpoint)."""
    broadcast({"params": [p.detach().cpu() for p in trainer.params], "trainer": trainer.state_dict()})


def follow(trainer) -> int:
    """A rank other than 0: take rank 0's state, then train on each step's groups until rank 0 sends
    None (the run ended, halted or failed). Returns the trainer's step."""
    state = broadcast()
    if state is None:
        return trainer.step
    with torch.no_grad():
        for param, value in zip(trainer.params, state["params"]):
            param.copy_(value.to(param.device))
    trainer.load_state_dict(state["trainer"])
    while (groups := broadcast()) is not None:
        trainer.train_step(groups)
    return trainer.step
