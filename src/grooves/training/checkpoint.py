"""Checkpoints: adapter, optimizer state, random states, data position, step.

A checkpoint is written into a temporary folder and renamed into place, so a
``checkpoints/step-000N/`` folder is always complete; a crash mid-write leaves only a
``.tmp-*`` folder, which the next resume removes. Its ``manifest.json`` (every file's size
and SHA-256, written last) lets a resume verify the checkpoint it picks: one damaged after
the fact (a full disk, a bad copy) is set aside as ``corrupt-step-000N`` and the resume
falls back to the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grooves.policy.checkpoints import list_checkpoints, newest_complete, step_dirname, write_manifest
from grooves.policy.policy import Policy


def save_checkpoint(run_dir: Path, step: int, policy: Policy, trainer_state: dict,
                    generator: torch.Generator, extra: dict[str, Any]) -> Path:
    folder = run_dir / "checkpoints"
    final = folder / step_dirname(step)
    tmp = folder / f".tmp-{step_dirname(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_adapter(tmp / "adapter")
    torch.save(trainer_state, tmp / "trainer.pt")
    torch.save(random_state(generator), tmp / "rng.pt")
    state = {"step": step, "base_model": policy.base_spec, "created": time.time(), **extra}
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    write_manifest(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_checkpoint(checkpoint: Path, policy: Policy, generator: torch.Generator) -> tuple[dict, dict]:
    """Load adapter weights and random states; return ``(trainer_state, state.json)``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    set_peft_model_state_dict(policy.model, {k: v.to(policy.device) for k, v in weights.items()})
    set_random_state(torch.load(checkpoint / "rng.pt", weights_only=False), generator)
    trainer_state = torch.load(checkpoint / "trainer.pt", weights_only=False)
    return trainer_state, json.loads((checkpoint / "state.json").read_text())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def set_aside_corrupt(run_dir: Path) -> tuple[Path | None, list[tuple[int, str]]]:
    """The newest checkpoint that verifies; newer damaged ones are renamed ``corrupt-step-000N``
    (kept for inspection, out of the way of the steps the resumed run saves again)."""
    newest, corrupt = newest_complete(run_dir)
    for step, _ in corrupt:
        folder = run_dir / "checkpoints" / step_dirname(step)
        aside = folder.with_name(f"corrupt-{folder.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(folder, aside)
    return (newest[1] if newest else None), corrupt


def clean_partial(run_dir: Path) -> None:
    for leftover in (run_dir / "checkpoints").glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def prune(run_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def random_state(generator: torch.Generator) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "sampler": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state: dict[str, Any], generator: torch.Generator) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sampler"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
