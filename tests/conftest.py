"""Shared fixtures. The bundled model is loaded once per test session (converted from its
GGUF on first use on a machine, then read from the grooves cache)."""

from __future__ import annotations

import copy

import pytest

from grooves.policy import LoRA, Policy
from grooves.policy.models import load_model


@pytest.fixture(scope="session")
def bundled_base():
    """(model, tokenizer) of the bundled model; never modified by tests."""
    return load_model("bundled:smollm2-135m-instruct")


@pytest.fixture
def bundled_policy(bundled_base):
    """A fresh bundled policy with a new rank-8 LoRA adapter (a private copy of the weights)."""
    from peft import get_peft_model
    import torch

    model, tokenizer = bundled_base
    model = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(model, LoRA(rank=8).to_peft())
    model.eval()
    return Policy(model, tokenizer, "bundled:smollm2-135m-instruct")


@pytest.fixture
def tiny_policy():
    return Policy.load("tiny", lora=LoRA(rank=4), seed=0)


@pytest.fixture(autouse=True)
def _runs_root(tmp_path, monkeypatch):
    """Runs never land in the working tree."""
    monkeypatch.setenv("GROOVES_RUNS", str(tmp_path / "runs"))
