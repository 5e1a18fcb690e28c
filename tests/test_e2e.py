"""A short end-to-end training run on the bundled model, through the public API and the CLI."""

import math
import sqlite3

import pytest
import torch
from typer.testing import CliRunner

import grooves as gr
from grooves.cli import app
from grooves.tasks import titles


@pytest.mark.slow
def test_short_run_on_the_bundled_model(bundled_policy, tmp_path):
    runs = tmp_path / "runs"
    run = gr.train(
        bundled_policy, tasks="builtin:titles", reward=titles.reward(), algorithm="dapo",
        steps=2, group_size=4, tasks_per_step=1, name="e2e", runs=runs,
        config={"sampling": {"max_completion_length": 12}, "optim": {"learning_rate": 1e-3},
                "algorithm": {"preset": "dapo", "dynamic_sampling": False},
                "log": {"val_size": 3, "val_every": 2, "save_every": 1}},
        progress=False,
    )
    assert run.step == 2 and [m["step"] for m in run.metrics] == [0, 1, 2]
    step = run.metrics[1]
    for key in ("reward/total", "reward/format", "reward/grounded", "completion_len", "entropy",
                "train/grad_norm", "frac_reward_zero_std", "train/tokens_per_s"):
        assert key in step and math.isfinite(step[key]), key
    assert 0.0 <= step["reward/total"] <= 1.0
    assert set(run.evaluations) == {0, 2} and len(run.evaluations[2].rewards) == 3
    # the adapter moved away from its zero-initialised B matrices
    lora_b = [p for n, p in bundled_policy.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)
    with sqlite3.connect(runs / "e2e" / "run.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM trajectories WHERE split = 'train'").fetchone()[0] == 8

    # the checkpoint is usable by name, with its base model found from the adapter's state
    sampled = CliRunner().invoke(app, ["sample", "e2e@latest", "Write a title: grooves trains adapters.",
                                       "--runs", str(runs), "--temperature", "0", "--max-tokens", "8"])
    assert sampled.exit_code == 0, sampled.output
    reloaded = gr.Policy.load("e2e@2", runs=runs)
    ids = reloaded.chat_ids([{"role": "user", "content": "hi"}])
    with torch.no_grad():
        expected = bundled_policy.model(input_ids=torch.tensor([ids])).logits
        assert torch.allclose(reloaded.model(input_ids=torch.tensor([ids])).logits, expected, atol=1e-4)

    # merged into the base, it loads in plain transformers and gives the same logits
    merged = CliRunner().invoke(app, ["merge", "e2e@2", "--out", str(tmp_path / "merged"), "--runs", str(runs)])
    assert merged.exit_code == 0, merged.output
    from test_export import plain_transformers_logits

    merged_logits = plain_transformers_logits(tmp_path / "merged", ids, tmp_path)
    # W + BA against W x + B(A x): fp32 rounding, relative to the logits' scale (up to ~40 here;
    # a wrong merge is off by 0.1 or more). A fixed 1e-4 failed at 1.2e-4 on one trained adapter.
    tolerance = 1e-5 * expected.abs().max()
    assert (merged_logits - expected).abs().max() <= tolerance
    with torch.no_grad(), bundled_policy.model.disable_adapter():
        base = bundled_policy.model(input_ids=torch.tensor([ids])).logits
    assert (expected - base).abs().max() > 10 * tolerance  # the adapter's effect is far above the tolerance


def test_public_api_names_stay_functions_after_submodule_imports():
    import grooves.training.loop  # noqa: F401  (a submodule import must not shadow gr.train)

    assert callable(gr.train) and gr.train.__module__ == "grooves.training.api"
    assert gr.algorithms.dapo().name == "dapo"
    with pytest.raises(AttributeError):
        gr.not_a_name
