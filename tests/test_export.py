"""Merge and export of a trained checkpoint."""

import json
import subprocess
import sys
import textwrap

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
