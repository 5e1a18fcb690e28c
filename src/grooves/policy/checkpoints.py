"""Checkpoint names: ``RUN@STEP`` and ``RUN@latest`` wherever a model is named.

A run is a folder under the runs root (``--runs``, ``$GROOVES_RUNS`` or ``./runs``); its
checkpoints are ``checkpoints/step-000N/`` folders, each holding a PEFT ``adapter/`` folder
and ``state.json`` (which names the base model spec). Only complete checkpoints exist under
that name: they are written to a temporary folder and renamed.
"""

from __future__ import annotations

import hashlib
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
        newest, corrupt = newest_complete(run_dir)
        if newest is None:
            raise CheckpointError(f"every checkpoint of run {run!r} is corrupt (step {corrupt[0][0]}: {corrupt[0][1]})")
        return newest[1]
    if not step.isdigit():
        raise CheckpointError(f"step {step!r} in {name!r} must be a number or 'latest'")
    by_step = dict(checkpoints)
    if int(step) not in by_step:
        steps = ", ".join(str(s) for s, _ in checkpoints)
        raise CheckpointError(f"run {run!r} has no checkpoint at step {step}; it has: {steps}")
    problem = checkpoint_problem(by_step[int(step)])
    if problem:
        raise CheckpointError(f"checkpoint {name} is corrupt: {problem}")
    return by_step[int(step)]


def checkpoint_base_spec(checkpoint: Path) -> str:
    return json.loads((checkpoint / "state.json").read_text())["base_model"]


MANIFEST = "manifest.json"
"""Written last into a checkpoint: every file's size and SHA-256, so a damaged one is found."""


def write_manifest(folder: Path) -> None:
    files = {str(p.relative_to(folder)): _fingerprint(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_problem(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint folder (a missing, truncated or altered file), or None.

    A checkpoint from before manifests were written is checked for its files and a readable
    ``state.json`` only.
    """
    manifest = checkpoint / MANIFEST
    if not manifest.exists():
        return _legacy_problem(checkpoint)
    # Hashing is the cost of a check (serve resolves RUN@STEP on every request): a folder whose
    # files have the same sizes and times as when it was last checked gives the same answer.
    stamp = (str(checkpoint.resolve()), tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                                              for p in sorted(checkpoint.rglob("*")) if p.is_file()))
    if stamp not in _CHECKED:
        if len(_CHECKED) > 256:
            _CHECKED.clear()
        _CHECKED[stamp] = _manifest_problem(checkpoint, manifest)
    return _CHECKED[stamp]


_CHECKED: dict[tuple, str | None] = {}


def _manifest_problem(checkpoint: Path, manifest: Path) -> str | None:
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, expected in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, {expected['size']} were written"
        if _fingerprint(path)["sha256"] != expected["sha256"]:
            return f"{name} does not match the checksum written with it"
    return None


def _legacy_problem(checkpoint: Path) -> str | None:
    adapter = checkpoint / "adapter" / "adapter_model.safetensors"
    if not adapter.is_file() or adapter.stat().st_size == 0:
        return "adapter/adapter_model.safetensors is missing or empty"
    try:
        json.loads((checkpoint / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return "state.json is unreadable"
    return None


def _fingerprint(path: Path) -> dict:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def newest_complete(run_dir: Path) -> tuple[tuple[int, Path] | None, list[tuple[int, str]]]:
    """The newest checkpoint that verifies as ``(step, folder)``, and the newer ones that did
    not as ``[(step, problem)]``."""
    corrupt = []
    for step, path in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return (step, path), corrupt
        corrupt.append((step, problem))
    return None, corrupt
