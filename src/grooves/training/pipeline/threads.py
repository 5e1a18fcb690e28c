"""The trainer's torch threads, giving way to a sampler process while it generates.

In an async run with a sampler process (``train.async_sampler = "process"``) on a CPU, the child
decodes on half the cores. A trainer that keeps all of its threads asks for more threads than
there are cores while the child generates (on 2 cores its update then ran 1.25-1.30x its
one-thread time, docs/scale.md); one that keeps half leaves cores idle whenever the child waits
for the next adapter. ``ElasticThreads`` runs the trainer on ``busy`` threads while the child
generates and on ``idle`` threads otherwise.

Torch's thread count (OpenMP's) is the calling thread's own setting, so it cannot be changed from
the thread that talks to the child: it is fitted where the model computes, before each LoRA
layer's forward and as the backward pass reaches each such layer's output (a CPU backward runs
on the thread that called it). A switch waits for the next layer, a few milliseconds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from grooves.policy.lora_batch import lora_layers


class ElasticThreads:
    """Fit the computing thread's torch threads to whether a neighbour process is working."""

    def __init__(self, model: torch.nn.Module, idle: int, busy: int):
        self.idle, self.busy = idle, busy
        self.neighbour = threading.Event()  # set while the neighbour computes
        self.switches = 0  # times a computing thread changed its count
        self._handles = []
        for _, _, layer in lora_layers(model):
            self._handles.append(layer.register_forward_pre_hook(self._before))
            self._handles.append(layer.register_forward_hook(self._after))

    @contextmanager
    def working(self) -> Iterator[None]:
        """The neighbour computes inside this block."""
        self.neighbour.set()
        try:
            yield
        finally:
            self.neighbour.clear()

    def fit(self) -> None:
        want = self.busy if self.neighbour.is_set() else self.idle
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
            self.switches += 1

    def close(self) -> None:
        """Remove the hooks; the calling thread gets its ``idle`` threads back."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        torch.set_num_threads(self.idle)

    def _before(self, module, args) -> None:
        self.fit()

    def _after(self, module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_gradient)

    def _on_gradient(self, gradient: torch.Tensor) -> None:
        self.fit()  # returns None: the gradient passes unchanged
