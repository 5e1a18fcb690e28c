"""grooves drift: weight change of hand-set LoRA updates, exact KL, forgetting, the command."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from grooves.cli import app
from grooves.policy import LoRA, Policy
from grooves.workflows.drift import (
    DriftError, ModuleDrift, lora_deltas, measure, token_kl, total_drift, weight_drift,
)
from grooves.runs.store import RunStore
from grooves.types import Group, Trajectory

runner = CliRunner()
MODULE = "model.layers.0.self_attn.q_proj"


def hand_adapter(folder, a_value: float, b_value: float, noise: float = 0.0):
    """A rank-2, alpha-4 adapter (scale 2) on the tiny model: every LoRA matrix zero except
    A[0, 0] = a_value and B[0, 0] = b_value of layer 0's q_proj, so ΔW = 2·a·b at (0, 0) only.
    ``noise`` > 0 instead fills every B with random values (an adapter that changes outputs)."""
    policy = Policy.load("tiny", lora=LoRA(rank=2, alpha=4, dropout=0.0), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_" in name:
                parameter.zero_()
                if noise:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * noise)
        if not noise:
            layer = policy.causal_lm.model.layers[0].self_attn.q_proj
            layer.lora_A["default"].weight[0, 0] = a_value
            layer.lora_B["default"].weight[0, 0] = b_value
    policy.save_adapter(folder)
    return folder


def checkpoint(root, run: str, step: int, **adapter):
    folder = root / run / "checkpoints" / f"step-{step:04d}"
    hand_adapter(folder / "adapter", **adapter)
    (folder / "state.json").write_text(json.dumps({"step": step, "base_model": "tiny"}))
    return f"{run}@{step}"


def base_weight():
    return Policy.load("tiny", seed=0).causal_lm.state_dict()[f"{MODULE}.weight"].float()


def test_a_known_update_gives_its_norm(tmp_path):
    deltas = lora_deltas(hand_adapter(tmp_path / "a", 1.0, 3.0))
    delta = deltas[f"{MODULE}.weight"]
    assert delta[0, 0].item() == pytest.approx(6.0)  # scale 2 · 1 · 3
    assert torch.linalg.norm(delta).item() == pytest.approx(6.0)
    assert all(torch.count_nonzero(d) == 0 for name, d in deltas.items() if name != f"{MODULE}.weight")

    w0 = base_weight()
    base = {name: w0 if name == f"{MODULE}.weight" else torch.ones_like(d) for name, d in deltas.items()}
    (row,) = [r for r in weight_drift(base, {}, deltas) if r.module == f"{MODULE}.weight"]
    assert row.delta_norm == pytest.approx(6.0) and row.weight_norm == pytest.approx(torch.linalg.norm(w0).item())
    assert row.kind == "q_proj"

    # From A (ΔW = 6 at (0, 0)) to B (ΔW = 2 · 1 · (-1) = -2 there): |-2 - 6| = 8, over ‖W0 + ΔW_A‖.
    other = lora_deltas(hand_adapter(tmp_path / "b", 1.0, -1.0))
    (row,) = [r for r in weight_drift(base, deltas, other) if r.module == f"{MODULE}.weight"]
    w00 = w0[0, 0].item()
    expected = math.sqrt(torch.linalg.norm(w0).item() ** 2 - w00 ** 2 + (w00 + 6) ** 2)
    assert row.delta_norm == pytest.approx(8.0) and row.weight_norm == pytest.approx(expected, rel=1e-5)


def test_totals_are_the_ratio_of_summed_squares():
    rows = [ModuleDrift("l.0.q_proj.weight", 3.0, 4.0), ModuleDrift("l.1.q_proj.weight", 4.0, 3.0),
            ModuleDrift("l.0.v_proj.weight", 0.0, 10.0)]
    total, by_kind = total_drift(rows)
    assert total == pytest.approx(5.0 / math.sqrt(125.0))
    assert by_kind == {"q_proj": pytest.approx(1.0), "v_proj": 0.0}
    assert rows[0].relative == 0.75


def test_token_kl_by_hand():
    p = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    q = torch.log(torch.tensor([[1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]]))
    expected = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)
    assert token_kl(p, q).tolist() == pytest.approx([expected, 0.0], abs=1e-6)
    assert token_kl(p + 7.0, q).tolist() == pytest.approx([expected, 0.0], abs=1e-6)  # logits, not probabilities


def val_run(root, run: str):
    store = RunStore(root / run)
    prompts = ["Echo: item 1", "Echo: item 2 item 2", "Echo: item 1"]  # one repeated: used once
    store.record_groups(3, [Group({"id": f"v{i}"}, [Trajectory(
        [{"role": "user", "content": text}, {"role": "assistant", "content": "x"}], [1], [2], [1], [0.0], reward=0.5)])
        for i, text in enumerate(prompts)], split="val")
    store.close()


def test_measure_outputs_of_checkpoints(tmp_path):
    root = tmp_path / "runs"
    zero = checkpoint(root, "r", 1, a_value=1.0, b_value=0.0)  # ΔW = 0: the base in disguise
    moved = checkpoint(root, "r", 2, a_value=0.0, b_value=0.0, noise=0.5)
    val_run(root, "r")

    same = measure("base", zero, runs=root, max_new_tokens=6)
    assert same.total == 0.0 and same.kl == {"base": 0.0, zero: pytest.approx(0.0, abs=1e-6)}
    assert same.prompts == 2 and same.untrained_tasks == 24
    assert same.forgetting[zero] == pytest.approx(same.forgetting["base"], abs=1e-5)

    report = measure(zero, moved, runs=root, max_new_tokens=6)
    assert report.total > 0 and report.kl[moved] > 1e-4
    assert report.forgetting[moved] != pytest.approx(report.forgetting[zero], abs=1e-5)
    assert json.loads(json.dumps(report.to_dict()))["kl_to_base"][moved] == pytest.approx(report.kl[moved])


def test_errors_are_clear(tmp_path):
    root = tmp_path / "runs"
    ckpt = checkpoint(root, "r", 1, a_value=1.0, b_value=1.0)
    with pytest.raises(DriftError, match="both sides are the base"):
        measure("base", "base", runs=root)
    with pytest.raises(DriftError, match="no held-out prompts"):
        measure("base", ckpt, runs=root)
    with pytest.raises(DriftError, match="not 'base', a checkpoint"):
        measure("base", str(tmp_path), runs=root)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(DriftError, match="line 1: 'prompt' must be a string"):
        measure("base", ckpt, runs=root, prompts_file=bad)


def test_the_command(tmp_path):
    root = tmp_path / "runs"
    ckpt = checkpoint(root, "r", 1, a_value=1.0, b_value=3.0)
    report = tmp_path / "drift.json"
    result = runner.invoke(app, ["drift", "base", ckpt, "--runs", str(root), "--weights-only", "--top", "1",
                                 "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert f"{MODULE}.weight" in result.output and "q_proj" in result.output
    assert json.loads(report.read_text())["modules"][0]["delta_norm"] >= 0
    missing = runner.invoke(app, ["drift", "base", "r@9", "--runs", str(root)])
    assert missing.exit_code == 2 and "no checkpoint at step 9" in missing.output
    assert "Traceback" not in missing.output
