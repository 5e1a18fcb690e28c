"""Deploying a checkpoint: merge the adapter into the base weights, or export it as a PEFT folder.

``merge_checkpoint`` writes a plain transformers model folder (safetensors, config,
tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads with no grooves import: the
lowest-latency way to serve one adapter. ``export_adapter`` writes the adapter as a
standard PEFT folder with a short model card (base model, step, rewards, run config).
Both write into a temporary folder and rename it, and refuse to overwrite a non-empty one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from grooves.policy.checkpoints import checkpoint_base_spec, resolve_checkpoint
from grooves.policy.policy import Policy
from grooves.training.store import read_metrics


class ExportError(ValueError):
    """The output folder cannot be written; the message says why."""


def merge_checkpoint(name: str, out: str | Path, runs: str | Path | None = None) -> Path:
    """Merge ``RUN@STEP``'s adapter into its base model and save a plain transformers folder."""
    policy = Policy.load(name, runs=runs)
    merged = policy.model.merge_and_unload()
    with _output_folder(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        policy.tokenizer.save_pretrained(tmp)
    return Path(out)


def export_adapter(name: str, out: str | Path, runs: str | Path | None = None) -> Path:
    """Copy ``RUN@STEP``'s adapter to ``out`` as a PEFT folder with a model card."""
    checkpoint = resolve_checkpoint(name, runs)
    with _output_folder(out) as tmp:
        for file in (checkpoint / "adapter").iterdir():
            if file.is_file() and file.name != "README.md":
                shutil.copy2(file, tmp / file.name)
        (tmp / "README.md").write_text(model_card(checkpoint))
    return Path(out)


def model_card(checkpoint: Path) -> str:
    run_dir = checkpoint.parent.parent
    state = json.loads((checkpoint / "state.json").read_text())
    step = state["step"]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] <= step]
    train = next((r for r in reversed(rows) if r.get("reward/total") is not None), {})
    val = next((r for r in reversed(rows) if r.get("val/reward/total") is not None), {})
    adapter = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
    config = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").exists() else "(not recorded)"
    lines = [
        f"# {run_dir.name}@{step}: a LoRA adapter trained with grooves", "",
        f"- base model: `{checkpoint_base_spec(checkpoint)}`",
        f"- training steps: {step}",
        f"- LoRA: rank {adapter.get('r')}, alpha {adapter.get('lora_alpha')}, "
        f"targets {adapter.get('target_modules')}",
        f"- reward at export: train {_num(train.get('reward/total'))} (step {train.get('step', '-')}), "
        f"held-out {_num(val.get('val/reward/total'))} (step {val.get('step', '-')})", "",
        "Load it onto the same base model with PEFT:", "",
        "```python",
        "from peft import PeftModel",
        "model = PeftModel.from_pretrained(base_model, \"<this folder>\")",
        "```", "",
        "or with grooves: `grooves.Policy.load(base_spec, adapter=\"<this folder>\")`.", "",
        "## Run config", "", "```toml", config.rstrip(), "```", "",
    ]
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.4f}"


class _output_folder:
    """A temporary folder next to ``out`` that becomes ``out`` when the block succeeds."""

    def __init__(self, out: str | Path):
        self.out = Path(out)

    def __enter__(self) -> Path:
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ExportError(f"{self.out} exists and is not empty; choose another --out")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.out.exists():
                self.out.rmdir()  # an empty folder the user made for us
            os.replace(self.tmp, self.out)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
