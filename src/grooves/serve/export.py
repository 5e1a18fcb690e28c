"""Deploying a checkpoint: merge the adapter into the base weights, or export it as a PEFT folder.

``merge_checkpoint`` writes a plain transformers model folder (safetensors, config,
tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads with no grooves import: the
lowest-latency way to serve one adapter. ``export_adapter`` writes the adapter as a
standard PEFT folder with a short model card (the exact base weights, step, rewards, run
config) whose ``base_model_name_or_path`` plain ``peft`` can load; ``export_base`` writes a
base model spec (the bundled GGUF included) as a plain transformers folder to ship with it.
Both write into a temporary folder and rename it, and refuse to overwrite a non-empty one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from grooves.policy.checkpoints import checkpoint_base_spec, resolve_checkpoint
from grooves.policy.models import base_provenance, bundled_folder, load_model
from grooves.policy.policy import Policy
from grooves.runs.store import read_metrics


BASE_MARKER = "grooves-base.json"


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


def export_adapter(name: str, out: str | Path, runs: str | Path | None = None,
                   with_base: str | Path | None = None) -> Path:
    """Copy ``RUN@STEP``'s adapter to ``out`` as a PEFT folder with a model card.

    ``adapter_config.json`` names a base that plain ``peft`` + ``transformers`` can load:
    ``with_base`` (written there by ``export_base``, or reused if it already holds this
    base), else the base's own folder or hub id; for the bundled model, the grooves cache
    folder on this machine (a plain transformers folder).
    """
    checkpoint = resolve_checkpoint(name, runs)
    spec = checkpoint_base_spec(checkpoint)
    provenance = base_provenance(spec)  # reads the whole GGUF for the bundled model: once
    with _output_folder(out) as tmp:
        if with_base is not None:
            if Path(with_base).resolve() == Path(out).resolve():
                raise ExportError("--with-base must be a folder other than --out")
            base_ref = str(export_base(spec, with_base, _run_dtype(checkpoint), "--with-base", provenance).resolve())
        else:
            base_ref = default_base_ref(spec)
        for file in (checkpoint / "adapter").iterdir():
            if file.is_file() and file.name != "README.md":
                shutil.copy2(file, tmp / file.name)
        adapter_config = json.loads((tmp / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = base_ref
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        (tmp / "README.md").write_text(model_card(checkpoint, base_ref, provenance))
    return Path(out)


def export_base(spec: str, out: str | Path, dtype: str = "float32", flag: str = "--out",
                provenance: dict | None = None) -> Path:
    """Write a base model spec as a plain transformers folder (safetensors, config with its
    architecture, tokenizer) with a card naming its exact weights; ``grooves-base.json``
    records them, so a folder that already holds the same base is reused as it is."""
    identity = {**(provenance or base_provenance(spec)), "dtype": dtype}
    marker = Path(out) / BASE_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == identity:
        return Path(out)
    with _output_folder(out, flag) as tmp:  # refuses a non-empty folder before the model loads
        model, tokenizer = load_model(spec, dtype=dtype)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / BASE_MARKER).write_text(json.dumps(identity, indent=2))
        (tmp / "README.md").write_text("\n".join([
            f"# {identity['spec']}: a base model written by `grooves base export`", "",
            *base_lines(identity), f"- stored as: {dtype} safetensors", "",
            "Load it with `transformers.AutoModelForCausalLM.from_pretrained(\"<this folder>\")`.", ""]))
    return Path(out)


def default_base_ref(spec: str) -> str:
    """What ``base_model_name_or_path`` says without ``--with-base``."""
    if spec == "bundled" or spec.startswith("bundled:"):
        return str(bundled_folder(spec).resolve())
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.is_dir() else spec


def base_lines(provenance: dict) -> list[str]:
    """Model-card lines that say exactly which weights the base is."""
    if "gguf" not in provenance:
        return [f"- base model: `{provenance['spec']}`: {provenance['source']}"]
    types = ", ".join(f"{count} {kind}" for kind, count in provenance["tensor_types"].items())
    return [
        f"- base model: `{provenance['spec']}`, the GGUF file `{provenance['gguf']}` shipped in the PyPI "
        f"package `{provenance['package']}` {provenance['package_version']} "
        f"(sha256 `{provenance['gguf_sha256']}`)",
        f"- quantisation: GGUF file type {provenance['gguf_file_type']} (tensors: {types}; the token "
        f"embedding, tied to the output head, is {provenance['token_embedding_type']}), de-quantised to "
        f"{provenance['dequantised_to']} by transformers' GGUF loader",
        "- these weights are NOT bit-identical to the unquantised SmolLM2-135M-Instruct release on the "
        "Hugging Face hub: on that release the adapter gives different outputs",
    ]


def model_card(checkpoint: Path, base_ref: str, provenance: dict) -> str:
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
        *base_lines(provenance),
        f"- `base_model_name_or_path`: `{base_ref}`",
        f"- training steps: {step}",
        f"- LoRA: rank {adapter.get('r')}, alpha {adapter.get('lora_alpha')}, "
        f"targets {adapter.get('target_modules')}",
        f"- reward at export: train {_num(train.get('reward/total'))} (step {train.get('step', '-')}), "
        f"held-out {_num(val.get('val/reward/total'))} (step {val.get('step', '-')})", "",
        "Load it with plain PEFT and generate (the base is read from `base_model_name_or_path`; "
        "edit that field if you move the base folder; run it from this folder):", "",
        "```python",
        "from peft import AutoPeftModelForCausalLM",
        "from transformers import AutoTokenizer",
        f"model, tokenizer = AutoPeftModelForCausalLM.from_pretrained(\".\"), AutoTokenizer.from_pretrained(\"{base_ref}\")",
        "ids = tokenizer.apply_chat_template([{\"role\": \"user\", \"content\": \"Hello!\"}], "
        "add_generation_prompt=True, return_tensors=\"pt\", return_dict=True)",
        "print(tokenizer.decode(model.generate(**ids, max_new_tokens=24)[0, ids[\"input_ids\"].shape[1]:]))",
        "```", "",
        f"with vLLM: `vllm serve {base_ref} --enable-lora --lora-modules {run_dir.name}=<this folder>"
        f"{_vllm_rank_flag(adapter.get('r') or 8)}` (not run in grooves' CI), or with grooves: "
        f"`grooves.Policy.load(\"{provenance['spec']}\", adapter=\"<this folder>\")`.", "",
        "## Run config", "", "```toml", config.rstrip(), "```", "",
    ]
    return "\n".join(lines)


def _vllm_rank_flag(rank: int) -> str:
    # vLLM's default --max-lora-rank is 16 and it accepts powers of two above that.
    return "" if rank <= 16 else f" --max-lora-rank {1 << (rank - 1).bit_length()}"


def _run_dtype(checkpoint: Path) -> str:
    """The dtype the run trained in (its recorded config), float32 when not recorded."""
    import tomllib

    config = checkpoint.parent.parent / "config.toml"
    if not config.exists():
        return "float32"
    return tomllib.loads(config.read_text()).get("model", {}).get("dtype", "float32")


def _num(value) -> str:
    return "-" if value is None else f"{value:.4f}"


class _output_folder:
    """A temporary folder next to ``out`` that becomes ``out`` when the block succeeds."""

    def __init__(self, out: str | Path, flag: str = "--out"):
        self.out, self.flag = Path(out), flag

    def __enter__(self) -> Path:
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise ExportError(f"{self.out} exists and is not empty; choose another {self.flag}")
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
