"""Checkpoint names: ``RUN@STEP`` and ``RUN@latest`` wherever a model is named.

A run is a folder under the runs root (``--runs``, ``$GROOVES_RUNS`` or ``./runs``); its
checkpoints are ``checkpoints/step-000N/`` folders, each holding a PEFT ``adapter/`` folder
and ``state.json`` (which names the base model spec). Only complete checkpoints exist under
that name: they are written to a temporary folder and renamed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

RUNS_ENV = "GROOVES_RUNS"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint name that does not resolve; the message says what exists."""


def runs_root(root: str | Path | None = None) -> Path:
    return Path(root or os.environ.get(RUNS_ENV) or "runs")


def step_dirname(step: int) -> str:
    return f"step-{step:04d}"


def is_checkpoint_name(spec: str) -> bool:
    return "@" in spec and not Path(spec).exists()


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / "state.json").exists():
            found.append((int(match.group(1)), child))
    return sorted(found)


def resolve_checkpoint(name: str, root: str | Path | None = None) -> Path:
    """Path of the checkpoint folder named ``RUN@STEP`` or ``RUN@latest``."""
    run, _, step = name.rpartition("@")
    if not run or not step:
        raise CheckpointError(f"{name!r} is not a checkpoint name; use RUN@STEP or RUN@latest")
    if "/" in run or "\\" in run or run in {".", ".."}:
        raise CheckpointError(f"run name {run!r} must be a plain folder name under the runs root")
    run_dir = runs_root(root) / run
    if not run_dir.is_dir():
        raise CheckpointError(f"no run {run!r} under {runs_root(root)} (set --runs or ${RUNS_ENV})")
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise CheckpointError(f"run {run!r} has no complete checkpoint yet")
    if step == "latest":
        return checkpoints[-1][1]
    if not step.isdigit():
        raise CheckpointError(f"step {step!r} in {name!r} must be a number or 'latest'")
    by_step = dict(checkpoints)
    if int(step) not in by_step:
        steps = ", ".join(str(s) for s, _ in checkpoints)
        raise CheckpointError(f"run {run!r} has no checkpoint at step {step}; it has: {steps}")
    return by_step[int(step)]


def checkpoint_base_spec(checkpoint: Path) -> str:
    return json.loads((checkpoint / "state.json").read_text())["base_model"]
