"""A tenant's models and checkpoints on disk, and the ``tinker://`` paths that name them.

A tenant's models live under ``ROOT/<tenant>/<run>/`` (``run`` is the model id with ``:`` made
``-``), each with ``model.json`` (its LoRA settings). ``save_state`` writes ``weights/<name>/``,
a named ``save_weights_for_sampler`` writes ``sampler_weights/<name>/`` (each: ``adapter/``,
``state.json``, and ``trainer.pt`` with the optimizer for ``weights``), and an unnamed one
publishes ``checkpoints/step-000N/``, which ``grooves serve --runs ROOT/<tenant>`` serves as
``<run>@N``. A ``tinker://`` path is only ever looked up under the caller's own tenant folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

from grooves.backend.queue import UserError
from grooves.policy.lora import LoRA
from grooves.policy.policy import Policy

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MODEL_ID = re.compile(r"^[0-9a-f]{32}:train:[0-9]{1,9}$")
KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> the SDK's checkpoint_type

# Llama-style module names for Tinker's train_attn / train_mlp / train_unembed.
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
UNEMBED = ["lm_head"]


class SharedBasePolicy(Policy):
    """A ``Policy`` over a PEFT model holding many named adapters; it saves the active one alone."""

    def save_adapter(self, folder: str | Path) -> None:
        folder = Path(folder)
        name = self.model.active_adapter
        staging = folder.with_name(folder.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(str(staging), selected_adapters=[name], save_embedding_layers=False)
        source = staging if name == "default" else staging / name
        shutil.move(str(source), str(folder))
        shutil.rmtree(staging, ignore_errors=True)
        config_path = folder / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = self.base_spec
        config_path.write_text(json.dumps(config, indent=2))


def run_folder(root: Path, tenant: str, model_id: str) -> Path:
    return root / tenant / model_id.replace(":", "-")


def resolve(root: Path, tenant: str, path: str) -> Path:
    """The folder a ``tinker://RUN/KIND/NAME`` path names, under the caller's own tenant only."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or not MODEL_ID.match(parts[0]) or parts[1] not in KINDS or not SAFE_NAME.match(parts[2]):
        raise UserError(f"{path!r} is not a checkpoint path of this service (tinker://MODEL_ID/weights/NAME "
                        "or tinker://MODEL_ID/sampler_weights/NAME)")
    folder = run_folder(root, tenant, parts[0]) / parts[1] / parts[2]
    if not (folder / "adapter" / "adapter_config.json").is_file():
        raise UserError(f"no checkpoint {path} for this API key", 404)
    return folder


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _checked_run(root: Path, tenant: str, run_id: str) -> Path:
    if not MODEL_ID.match(run_id or ""):
        raise UserError(f"{run_id!r} is not a model id of this service")
    folder = run_folder(root, tenant, run_id)
    if not (folder / "model.json").is_file():
        raise UserError(f"no model {run_id!r} for this API key", 404)
    return folder


def list_checkpoints(root: Path, tenant: str, run_id: str) -> list[dict]:
    """The checkpoints of one of the caller's models, as the SDK's ``Checkpoint``, oldest first per kind."""
    folder = _checked_run(root, tenant, run_id)
    found = []
    for kind, label in KINDS.items():
        for saved in sorted((folder / kind).glob("*")) if (folder / kind).is_dir() else []:
            if not saved.name.startswith(".") and (saved / "state.json").is_file():
                size = sum(p.stat().st_size for p in saved.rglob("*") if p.is_file())
                found.append({"checkpoint_id": f"{kind}/{saved.name}", "checkpoint_type": label,
                              "time": _iso(saved.stat().st_mtime),
                              "tinker_path": f"tinker://{run_id}/{kind}/{saved.name}", "size_bytes": size})
    return found


def training_run(root: Path, tenant: str, run_id: str, base_model: str, last_request: float | None) -> dict:
    """One of the caller's models as the SDK's ``TrainingRun``; without a request since the service
    started, ``last_request_time`` is the newest file the service wrote for it."""
    folder = _checked_run(root, tenant, run_id)
    lora = json.loads((folder / "model.json").read_text())["lora"]
    checkpoints = list_checkpoints(root, tenant, run_id)

    def newest(label: str) -> dict | None:
        of_kind = [c for c in checkpoints if c["checkpoint_type"] == label]
        return max(of_kind, key=lambda c: c["time"]) if of_kind else None

    if last_request is None:
        last_request = max(p.stat().st_mtime for p in [folder / "model.json", *folder.rglob("state.json")])
    return {"training_run_id": run_id, "base_model": base_model, "model_owner": tenant, "is_lora": True,
            "corrupted": False, "lora_rank": lora["rank"], "last_request_time": _iso(last_request),
            "last_checkpoint": newest("training"), "last_sampler_checkpoint": newest("sampler")}


def training_runs(root: Path, tenant: str) -> list[str]:
    """The ids of the caller's models, newest first."""
    folders = [f for f in (root / tenant).glob("*") if (f / "model.json").is_file()] \
        if (root / tenant).is_dir() else []
    folders.sort(key=lambda f: (f / "model.json").stat().st_mtime_ns, reverse=True)
    return [json.loads((f / "model.json").read_text())["model_id"] for f in folders]


def weights_info(root: Path, tenant: str, path: str, base_model: str) -> dict:
    """What loading a checkpoint needs, as the SDK's ``WeightsInfoResponse``."""
    saved = json.loads((resolve(root, tenant, path) / "state.json").read_text())
    targets = set(saved["lora"]["target_modules"])
    return {"base_model": base_model, "is_lora": True, "lora_rank": saved["lora"]["rank"],
            "train_attn": bool(targets & set(ATTN)), "train_mlp": bool(targets & set(MLP)),
            "train_unembed": bool(targets & set(UNEMBED))}


def save(policy, trainer, model_id: str, lora: LoRA, base_model: str, final: Path, with_optimizer: bool) -> None:
    """The active adapter (and the optimizer) into ``final``, atomically (temp + rename)."""
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_adapter(tmp / "adapter")
    if with_optimizer:
        torch.save(trainer.state_dict(), tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps({"model_id": model_id, "base_model": base_model,
                                                "step": trainer.step, "lora": lora.model_dump()}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def load(policy, trainer, model_id: str, lora: LoRA, folder: Path, with_optimizer: bool) -> None:
    """A checkpoint's adapter (and optimizer) into the named adapter ``model_id``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((folder / "state.json").read_text())
    if LoRA(**saved["lora"]) != lora:
        raise UserError(f"the checkpoint's LoRA ({saved['lora']}) differs from this model's ({lora.model_dump()})")
    weights = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
    set_peft_model_state_dict(policy.model, weights, adapter_name=model_id)
    if with_optimizer:
        if not (folder / "trainer.pt").is_file():
            raise UserError("this checkpoint has no optimizer state (it was saved for sampling)")
        trainer.load_state_dict(torch.load(folder / "trainer.pt", weights_only=False))
    else:
        trainer.step = saved["step"]


def sampler_name(checkpoint: Path | None) -> str:
    """The ledger's model column for sampling: the run the checkpoint belongs to, or "base"."""
    if checkpoint is None:
        return "base"
    inside = checkpoint.parent.name in (*KINDS, "checkpoints")
    return (checkpoint.parent.parent if inside else checkpoint).name
