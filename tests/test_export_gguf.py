"""GGUF export for llama.cpp and Ollama: the files are read back with the ``gguf`` package's
reader, de-quantised, loaded into a transformers Llama and compared with grooves' logits."""

import json

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from grooves.cli import app
from grooves.policy import Policy
from grooves.policy.models import CHATML_TEMPLATE, load_model
from grooves.serve.gguf_export import permute_rope_rows

# llama.cpp's names for the llama architecture (gguf-py/gguf/tensor_mapping.py), written out
# here so the test does not read them from the code under test.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
CHATML_OLLAMA = (
    '{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
    '{{ range .Messages }}{{ if ne .Role "system" }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n'
    '{{ end }}{{ end }}<|im_start|>assistant\n'
)


def make_checkpoint(tmp_path, spec="tiny", step=3, targets="all-linear", **lora):
    """A checkpoint saved as training saves one, with a random (non-zero) LoRA B so it matters."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = load_model(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      init_lora_weights=False, **lora))
    checkpoint = tmp_path / "runs" / "r" / "checkpoints" / f"step-{step:04d}"
    Policy(peft_model, tokenizer, spec).save_adapter(checkpoint / "adapter")
    (checkpoint / "state.json").write_text(json.dumps({"step": step, "base_model": spec}))
    return tmp_path / "runs"


def read_gguf(path, only=None):
    """(metadata, tensors, tensor types) of a GGUF file; tensors (all, or those named in ``only``)
    de-quantised to float32 torch tensors."""
    reader = gguf.GGUFReader(str(path))
    fields = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
               for t in reader.tensors if only is None or t.name in only}
    return fields, tensors, {t.name: t.tensor_type.name for t in reader.tensors}


def unpermute(weights, n_head):
    """The inverse of llama.cpp's q/k row order: pairs (2i, 2i+1) back to (i, i + d/2)."""
    return weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:]) \
        .swapaxes(1, 2).reshape(weights.shape)


def hf_state(tensors, config):
    state = {"model.embed_tokens.weight": tensors["token_embd.weight"],
             "model.norm.weight": tensors["output_norm.weight"]}
    for name, value in tensors.items():
        if name.startswith("blk."):
            _, block, short, _ = name.split(".")
            if short == "attn_q":
                value = unpermute(value, config.num_attention_heads)
            if short == "attn_k":
                value = unpermute(value, config.num_key_value_heads)
            state[f"model.layers.{block}.{BLOCK_NAMES[short]}.weight"] = value
    return state


def logits_from_state(spec, state, ids):
    model, _ = load_model(spec)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the head is tied to token_embd
    model.tie_weights()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def grooves_logits(policy, ids):
    with torch.no_grad():
        expected = policy.model(input_ids=torch.tensor([ids])).logits
        with policy.reference():
            base = policy.model(input_ids=torch.tensor([ids])).logits
    return expected, base


def test_rope_rows_are_reordered_as_llama_cpp_pairs_them():
    # 2 heads of dim 4: each head's rows [0, 1, 2, 3] become [0, 2, 1, 3]
    rows = torch.arange(8.0).reshape(8, 1)
    assert permute_rope_rows(rows, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert torch.equal(unpermute(permute_rope_rows(rows, 2), 2), rows)


@pytest.mark.parametrize("gguf_type, tolerance", [("f32", 1e-5), ("f16", 2e-3)])
def test_merged_gguf_reads_back_with_grooves_logits(tmp_path, gguf_type, tolerance):
    runs = make_checkpoint(tmp_path)
    result = CliRunner().invoke(app, ["export", "r@latest", "--gguf", str(tmp_path / "out" / "m.gguf"),
                                      "--gguf-type", gguf_type, "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    assert "(step 3)" in result.output and "ollama create NAME -f" in result.output
    fields, tensors, types = read_gguf(tmp_path / "out" / "m.gguf")
    assert fields["general.architecture"] == "llama" and fields["general.type"] == "model"
    assert fields["general.name"] == "r@3"
    assert fields["general.file_type"] == (1 if gguf_type == "f16" else 0)  # MOSTLY_F16 / ALL_F32
    # the tiny model: 2 blocks, width 64, ffn 128, 4 heads of 16, 2 kv heads, 2048 positions
    assert [fields[f"llama.{k}"] for k in ("block_count", "embedding_length", "feed_forward_length",
                                           "attention.head_count", "attention.head_count_kv",
                                           "rope.dimension_count", "context_length", "vocab_size")] == \
        [2, 64, 128, 4, 2, 16, 2048, 259]
    assert fields["llama.rope.freq_base"] == 10000.0
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    # the byte tokenizer: 3 control tokens, then the 256 byte symbols, no merges (gguf cannot write [])
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "default"
    assert fields["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert fields["tokenizer.ggml.token_type"] == [3, 3, 3] + [1] * 256 and "tokenizer.ggml.merges" not in fields
    assert [fields[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown", "padding")] == [1, 2, 0, 2]
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert fields["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert len(tensors) == 2 + 2 * 9 and "output.weight" not in tensors  # the head is tied
    assert types["blk.0.attn_q.weight"] == gguf_type.upper() and types["blk.0.attn_norm.weight"] == "F32"

    policy = Policy.load("r@3", runs=runs)
    ids = policy.chat_ids([{"role": "user", "content": "Echo: item 3"}])
    expected, base = grooves_logits(policy, ids)
    assert (expected - base).abs().max() > 0.05  # the adapter changes the output
    got = logits_from_state("tiny", hf_state(tensors, load_model("tiny")[0].config), ids)
    assert (got - expected).abs().max() < tolerance

    modelfile = (tmp_path / "out" / "m.Modelfile").read_text()
    assert modelfile == ("# Ollama: ollama create NAME -f m.Modelfile   (written by grooves)\n"
                         "FROM ./m.gguf\n"
                         f'TEMPLATE """{CHATML_OLLAMA}"""\n'
                         'PARAMETER stop "<|im_end|>"\n')


def test_lora_gguf_over_its_base_gives_grooves_logits(tmp_path):
    """What llama.cpp computes with --lora: W x + (alpha / rank) * B (A x) on each pair."""
    runs = make_checkpoint(tmp_path, targets=["q_proj", "k_proj", "v_proj", "down_proj"])
    result = CliRunner().invoke(app, ["export", "r@3", "--gguf-lora", str(tmp_path / "a.gguf"),
                                      "--gguf-type", "f32", "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    fields, pairs, types = read_gguf(tmp_path / "a.gguf")
    assert fields["general.architecture"] == "llama" and fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora" and fields["adapter.lora.alpha"] == 8.0
    assert sorted(pairs) == sorted(f"blk.{b}.{m}.weight.lora_{ab}" for b in (0, 1)
                                   for m in ("attn_q", "attn_k", "attn_v", "ffn_down") for ab in "ab")
    assert set(types.values()) == {"F32"}
    assert pairs["blk.0.attn_k.weight.lora_a"].shape == (4, 64)  # (rank, in)
    assert pairs["blk.0.attn_k.weight.lora_b"].shape == (32, 4)  # (out: 2 kv heads of 16, rank)
    assert pairs["blk.1.ffn_down.weight.lora_a"].shape == (4, 128)

    _, tensors, _ = read_gguf(tmp_path / "a.base.gguf")
    for name in list(tensors):
        if name + ".lora_a" in pairs:
            a, b = pairs[name + ".lora_a"], pairs[name + ".lora_b"]
            tensors[name] = tensors[name] + fields["adapter.lora.alpha"] / b.shape[1] * (b @ a)
    policy = Policy.load("r@3", runs=runs)
    ids = policy.chat_ids([{"role": "user", "content": "Echo: item 3"}])
    expected, base = grooves_logits(policy, ids)
    assert (expected - base).abs().max() > 0.05
    got = logits_from_state("tiny", hf_state(tensors, load_model("tiny")[0].config), ids)
    assert (got - expected).abs().max() < 1e-5

    modelfile = (tmp_path / "a.Modelfile").read_text().splitlines()
    assert modelfile[1:3] == ["FROM ./a.base.gguf", "ADAPTER ./a.gguf"]


def test_rslora_scale_is_carried_in_alpha(tmp_path):
    """rsLoRA scales by alpha / sqrt(r) = 8 / 2; llama.cpp by alpha / r, so alpha = 8 * 2 = 16."""
    runs = make_checkpoint(tmp_path, targets=["q_proj"], use_rslora=True)
    result = CliRunner().invoke(app, ["export", "r@3", "--gguf-lora", str(tmp_path / "a.gguf"),
                                      "--gguf-type", "f32", "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    fields, pairs, _ = read_gguf(tmp_path / "a.gguf")
    assert fields["adapter.lora.alpha"] == 16.0
    _, tensors, _ = read_gguf(tmp_path / "a.base.gguf")
    for block in (0, 1):
        name = f"blk.{block}.attn_q.weight"
        tensors[name] = tensors[name] + 16.0 / 4 * (pairs[name + ".lora_b"] @ pairs[name + ".lora_a"])
    policy = Policy.load("r@3", runs=runs)
    ids = policy.chat_ids([{"role": "user", "content": "Echo: item 3"}])
    expected, _ = grooves_logits(policy, ids)
    got = logits_from_state("tiny", hf_state(tensors, load_model("tiny")[0].config), ids)
    assert (got - expected).abs().max() < 1e-5


def test_modelfile_leaves_a_template_that_is_not_chatml_to_ollama(tmp_path):
    from grooves.policy.models import byte_tokenizer
    from grooves.serve.modelfile import chatml_default_system, write_modelfile

    tokenizer = byte_tokenizer()
    assert chatml_default_system(tokenizer) == (True, None)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert chatml_default_system(tokenizer) == (False, None)
    text = write_modelfile(tmp_path / "m.gguf", tokenizer).read_text()
    assert "TEMPLATE" not in text and "FROM ./m.gguf\n" in text and "reads it from the GGUF" in text


def test_gguf_export_refuses_a_base_llama_cpp_names_differently(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grooves.policy.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen")
    tokenizer.save_pretrained(tmp_path / "qwen")
    runs = make_checkpoint(tmp_path, spec=str(tmp_path / "qwen"), targets=["q_proj"])
    for flag in ("--gguf", "--gguf-lora"):
        result = CliRunner().invoke(app, ["export", "r@3", flag, str(tmp_path / "q.gguf"), "--runs", str(runs)])
        assert result.exit_code == 2 and "llama-architecture bases" in result.output and "'qwen2'" in result.output
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".q.gguf*"))


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft, on the embedding LoRA
def test_gguf_export_refuses_what_it_cannot_write(tmp_path):
    runs = make_checkpoint(tmp_path)
    run = CliRunner().invoke
    (tmp_path / "taken.gguf").write_text("mine")
    taken = run(app, ["export", "r@3", "--gguf", str(tmp_path / "taken.gguf"), "--runs", str(runs)])
    assert taken.exit_code == 2 and "exists; choose another --gguf" in taken.output
    assert (tmp_path / "taken.gguf").read_text() == "mine"
    suffix = run(app, ["export", "r@3", "--gguf-lora", str(tmp_path / "a.bin"), "--runs", str(runs)])
    assert suffix.exit_code == 2 and "must end in .gguf" in suffix.output
    nothing = run(app, ["export", "r@3", "--runs", str(runs)])
    assert nothing.exit_code == 2 and "nothing to write" in nothing.output
    bad_type = run(app, ["export", "r@3", "--gguf", str(tmp_path / "m.gguf"), "--gguf-type", "q4",
                         "--runs", str(runs)])
    assert bad_type.exit_code == 2 and "--gguf-type 'q4'" in bad_type.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "taken.gguf"]  # no temp files left
    embedding = make_checkpoint(tmp_path / "e", targets=["embed_tokens", "q_proj"])
    refused = run(app, ["export", "r@3", "--gguf-lora", str(tmp_path / "e.gguf"), "--runs", str(embedding)])
    assert refused.exit_code == 2 and "LoRA on the embedding" in refused.output


@pytest.mark.slow
def test_bundled_gguf_matches_llama_cpps_own_conversion(tmp_path):
    """The bundled model ships as a GGUF made by llama.cpp's converter: the export's names,
    hyperparameters, tokenizer keys and (unadapted) q/k row order must agree with it."""
    from grooves.policy.models import bundled_gguf

    spec = "bundled:smollm2-135m-instruct"
    runs = make_checkpoint(tmp_path, spec=spec, targets=["v_proj", "down_proj"])
    result = CliRunner().invoke(app, ["export", "r@3", "--gguf", str(tmp_path / "m.gguf"),
                                      "--gguf-lora", str(tmp_path / "a.gguf"), "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    shipped = bundled_gguf(spec)[1]
    unadapted = ("blk.0.attn_q.weight", "blk.29.attn_k.weight", "blk.3.ffn_gate.weight", "output_norm.weight",
                 "blk.0.attn_v.weight")
    ours, tensors, types = read_gguf(tmp_path / "m.gguf")
    theirs, reference, their_types = read_gguf(shipped, only=unadapted)
    assert {k: v for k, v in ours.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in theirs.items() if k.startswith("tokenizer.")}
    assert len(ours["tokenizer.ggml.merges"]) == 48900 and ours["tokenizer.ggml.pre"] == "smollm"
    assert {k: v for k, v in ours.items() if k.startswith("llama.")} == \
        {k: v for k, v in theirs.items() if k.startswith("llama.")}
    assert sorted(types) == sorted(their_types) and len(types) == 272
    assert types["blk.0.attn_q.weight"] == "F16" and types["token_embd.weight"] == "F16"
    for name in unadapted[:-1]:
        # not adapted: the de-quantised shipped weights, to f16 rounding (a wrong row order is off by ~1)
        assert (tensors[name] - reference[name]).abs().max() <= 1e-3 * reference[name].abs().max(), name
    assert (tensors["blk.0.attn_v.weight"] - reference["blk.0.attn_v.weight"]).abs().max() > 1e-2

    policy = Policy.load("r@3", runs=runs)
    ids = policy.chat_ids([{"role": "user", "content": "Name a prime number."}])
    expected, base = grooves_logits(policy, ids)
    assert (expected - base).abs().max() > 0.1
    got = logits_from_state(spec, hf_state(tensors, policy.model.config), ids)
    assert (got - expected).abs().max() < 2e-2 * expected.abs().max()

    lora, pairs, _ = read_gguf(tmp_path / "a.gguf")
    assert lora["adapter.lora.alpha"] == 8.0 and len(pairs) == 2 * 2 * 30
    assert (tmp_path / "a.base.gguf").read_bytes() == shipped.read_bytes()  # the exact training base
    modelfile = (tmp_path / "m.Modelfile").read_text()
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM, trained by Hugging Face"""\n' in modelfile
