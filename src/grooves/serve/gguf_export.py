"""Leaving grooves for llama.cpp and Ollama: a checkpoint as GGUF files.

``export_gguf`` merges ``RUN@STEP``'s adapter into its base and writes one GGUF model file;
``export_gguf_lora`` writes the adapter alone as a GGUF LoRA file (what llama.cpp's
``--lora`` and Ollama's ``ADAPTER`` load) with its base model GGUF beside it. Each writes an
Ollama ``Modelfile`` next to the GGUF.

Names and metadata follow llama.cpp's own converters (``convert_hf_to_gguf.py``,
``convert_lora_to_gguf.py``) through the ``gguf`` package's tables, for the llama
architecture (SmolLM2, Llama):

- tensors are renamed by ``gguf.get_tensor_name_map`` (``model.layers.N.self_attn.q_proj``
  -> ``blk.N.attn_q``); the query and key rows are permuted as llama.cpp's converter does
  (its rotary kernel pairs dimensions (2i, 2i+1), transformers' (i, i + head_dim/2)). For a
  LoRA pair only ``lora_b`` (the output rows) is permuted: P(W + s B A) = P W + s (P B) A.
- a merged model stores matrices as f16 (``--gguf-type f16``, the default, llama.cpp's
  ``MOSTLY_F16``) or f32, norms always as f32; nothing is quantised. A LoRA file is f32.
- llama.cpp scales a LoRA pair by ``adapter.lora.alpha / rank``, PEFT's ``alpha / r`` (for
  rsLoRA's ``alpha / sqrt(r)`` the alpha written is ``alpha * sqrt(r)``).
- the tokenizer: for the bundled model its GGUF's ``tokenizer.*`` keys are copied as they
  are (llama.cpp's own conversion of it); for another base they are built from its byte-level
  BPE tokenizer (``tokenizer.ggml.pre = default``). A BPE with no merges at all (grooves' tiny
  test model) gets no ``tokenizer.ggml.merges`` key, which the ``gguf`` writer cannot write
  empty; llama.cpp refuses such a vocabulary, so that file is for reading back, not serving.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grooves.policy.checkpoints import checkpoint_base_spec, resolve_checkpoint
from grooves.policy.models import bundled_gguf, load_model
from grooves.policy.policy import Policy
from grooves.serve.export import ExportError
from grooves.serve.modelfile import modelfile_path, write_modelfile

GGUF_TYPES = ("f16", "f32")


@dataclass(frozen=True)
class GgufExport:
    """What an export wrote: the GGUF, the base beside a LoRA file, the Modelfile, the step."""

    gguf: Path
    modelfile: Path
    step: int
    base: Path | None = None


def export_gguf(name: str, out: str | Path, runs: str | Path | None = None,
                gguf_type: str = "f16") -> GgufExport:
    """Merge ``RUN@STEP``'s adapter into its base and write it as one GGUF model file."""
    out = Path(out)
    _refuse_existing("--gguf", gguf_type, out, modelfile_path(out))
    checkpoint = resolve_checkpoint(name, runs)
    step = _step(checkpoint)
    policy = Policy.load(name, runs=runs)
    merged = policy.model.merge_and_unload()
    with _output_file(out) as tmp:
        write_model_gguf(merged, policy.tokenizer, tmp, policy.base_spec, gguf_type, f"{_run(checkpoint)}@{step}")
    modelfile = write_modelfile(out, policy.tokenizer)
    return GgufExport(out, modelfile, step)


def export_gguf_lora(name: str, out: str | Path, runs: str | Path | None = None,
                     gguf_type: str = "f16") -> GgufExport:
    """Write ``RUN@STEP``'s adapter as a GGUF LoRA file, its base as ``<out stem>.base.gguf``.

    For the bundled model the base is a copy of the shipped GGUF: the exact (quantised)
    weights the adapter was trained on. Another base is written as ``gguf_type``.
    """
    out = Path(out)
    base_out = out.with_name(f"{out.stem}.base.gguf")
    _refuse_existing("--gguf-lora", gguf_type, out, base_out, modelfile_path(out))
    checkpoint = resolve_checkpoint(name, runs)
    step = _step(checkpoint)
    spec = checkpoint_base_spec(checkpoint)
    adapter = checkpoint / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    model, tokenizer = load_model(spec)
    with _output_file(out) as tmp:
        write_lora_gguf(adapter, config, model.config, tmp, f"{_run(checkpoint)}@{step}")
    with _output_file(base_out) as tmp:
        if _is_bundled(spec):
            shutil.copyfile(bundled_gguf(spec)[1], tmp)
        else:
            write_model_gguf(model, tokenizer, tmp, spec, gguf_type, spec)
    modelfile = write_modelfile(out, tokenizer, base=base_out)
    return GgufExport(out, modelfile, step, base_out)


# --- the model file -----------------------------------------------------------------


def write_model_gguf(model, tokenizer, path: Path, spec: str, gguf_type: str, name: str) -> None:
    """Write a llama-architecture transformers model (weights, hyperparameters, tokenizer)."""
    import gguf

    config = model.config
    _check_llama(config)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if gguf_type == "f16" else gguf.LlamaFileType.ALL_F32)
    _add_hyperparameters(writer, config)
    _add_tokenizer(writer, tokenizer, spec, config.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd as the output head when output.weight is absent
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(f"tensor {hf_name!r} has no GGUF name for the llama architecture")
        data = _llama_order(hf_name, tensor.detach().float(), config)
        dtype = np.float16 if gguf_type == "f16" and data.dim() > 1 else np.float32
        writer.add_tensor(gguf_name, data.numpy().astype(dtype))
    _finish(writer)


def _check_llama(config) -> None:
    if config.model_type != "llama":
        raise ExportError(f"GGUF export supports llama-architecture bases (SmolLM2, Llama); this base is "
                          f"{config.model_type!r}: export it with --out and convert it with llama.cpp's "
                          f"convert_lora_to_gguf.py")


def _add_hyperparameters(writer, config) -> None:
    import gguf

    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope_type != "default":
        raise ExportError(f"rope type {rope_type!r} is not written by grooves' GGUF export (default and linear are)")


def _add_tokenizer(writer, tokenizer, spec: str, vocab_size: int) -> None:
    """The bundled GGUF's tokenizer keys as they are, else ones built from a byte-level BPE."""
    import gguf

    if _is_bundled(spec):
        reader = gguf.GGUFReader(str(bundled_gguf(spec)[1]))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                writer.add_key_value(key, field.contents(), field.types[0],
                                     field.types[1] if len(field.types) > 1 else None)
        return
    tokens, types, merges = bpe_vocab(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)  # none for a BPE without merges: gguf cannot write an empty array
    for token_id, add in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                          (tokenizer.eos_token_id, writer.add_eos_token_id),
                          (tokenizer.unk_token_id, writer.add_unk_token_id),
                          (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if token_id is not None:
            add(token_id)
    ids = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(bool(ids) and ids[0] == tokenizer.bos_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def bpe_vocab(tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens by id, their llama.cpp token types and the merges of a byte-level BPE tokenizer."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ExportError("GGUF export writes byte-level BPE (gpt2-style) tokenizers; this base's tokenizer is "
                          f"{spec['model']['type']} with a {(spec.get('decoder') or {}).get('type')} decoder")
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:  # rows past the tokenizer: llama.cpp's converter names them [PADi]
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL if i not in added else
                         gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, [int(t) for t in types], merges


# --- the LoRA file ------------------------------------------------------------------


def write_lora_gguf(adapter: Path, config: dict, model_config, path: Path, name: str) -> None:
    """Write a PEFT adapter's A and B matrices as llama.cpp's ``.lora_a`` / ``.lora_b`` pairs."""
    import gguf
    from safetensors.torch import load_file

    _check_llama(model_config)
    for field in ("use_dora", "modules_to_save", "alpha_pattern"):
        if config.get(field):
            raise ExportError(f"adapter_config.json: {field} is set; llama.cpp's LoRA format has no place for it")
    rank = config["r"]
    # llama.cpp scales by alpha / rank; rsLoRA's alpha / sqrt(rank) is the same with alpha * sqrt(rank)
    alpha = config["lora_alpha"] * (rank ** 0.5 if config.get("use_rslora") else 1.0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model_config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name(name)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    for key in sorted(weights):
        if ".lora_embedding_" in key:
            raise ExportError(f"LoRA on the embedding {key.split('.lora_embedding_')[0]!r} is not written to GGUF "
                              f"(grooves writes LoRA on the linear layers of the blocks)")
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise ExportError(f"adapter tensor {key!r} is not a LoRA A or B matrix; llama.cpp cannot load it")
            continue
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]  # model.layers.0.self_attn.q_proj
        target = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if target is None or target.startswith(("token_embd", "output.")):
            raise ExportError(f"LoRA on {module!r} is not written to GGUF (grooves writes LoRA on the linear "
                              f"layers of the blocks)")
        lora_a = weights[key].float()  # (r, in)
        lora_b = _llama_order(module + ".weight", weights[key.replace(".lora_A.", ".lora_B.")].float(),
                              model_config)  # (out, r)
        writer.add_tensor(target + ".lora_a", lora_a.numpy().astype(np.float32))
        writer.add_tensor(target + ".lora_b", lora_b.numpy().astype(np.float32))
    _finish(writer)


# --- shared pieces ------------------------------------------------------------------


def permute_rope_rows(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder each head's rows from Hugging Face's rotary layout to llama.cpp's.

    Rows ``[0, 1, ..., d-1]`` of a head (d = head_dim) become ``[0, d/2, 1, d/2+1, ...]``:
    llama.cpp rotates the pairs (2i, 2i+1) where transformers rotates (i, i + d/2).
    """
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _llama_order(hf_name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute_rope_rows(tensor, config.num_attention_heads)
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute_rope_rows(tensor, config.num_key_value_heads)
    return tensor


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _is_bundled(spec: str) -> bool:
    return spec == "bundled" or spec.startswith("bundled:")


def _step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "state.json").read_text())["step"])


def _run(checkpoint: Path) -> str:
    return checkpoint.parent.parent.name


def _refuse_existing(flag: str, gguf_type: str, out: Path, *beside: Path) -> None:
    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf-type {gguf_type!r}: use one of {', '.join(GGUF_TYPES)}")
    if out.suffix != ".gguf":
        raise ExportError(f"{flag} {out}: the file name must end in .gguf")
    for path in (out, *beside):
        if path.exists():
            raise ExportError(f"{path} exists; choose another {flag}")


class _output_file:
    """A temporary file next to ``out`` that becomes ``out`` when the block succeeds."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent)
        os.close(fd)
        self.tmp = Path(name)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o666 & ~umask)  # mkstemp makes it private; the export is an ordinary file
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            os.replace(self.tmp, self.out)
        else:
            self.tmp.unlink(missing_ok=True)
