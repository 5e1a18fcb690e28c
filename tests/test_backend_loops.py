"""Training loops through a live ``grooves backend serve`` with the official tinker SDK.

- the examples' loops (``examples/tinker_rl.py``, ``examples/tinker_sft.py``) on the bundled model:
  the RL loop raises the held-out demo reward, the SFT loop lowers the held-out loss;
- grooves' own loop as a client (``[backend]``, ``grooves.backend.client``): the remote step makes
  the same adapter as the local ``Trainer.train_step`` on the same groups, and ``grooves train
  --backend URL`` runs end to end with sampling and training on the service.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")

from typer.testing import CliRunner  # noqa: E402

from grooves.backend.local import LocalService  # noqa: E402
from helpers import tiny_config  # noqa: E402

BUNDLED = "bundled:smollm2-135m-instruct"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bundled_client(tmp_path_factory):
    with LocalService(BUNDLED, tmp_path_factory.mktemp("bundled")) as service:
        client = tinker.ServiceClient(base_url=service.base_url, api_key=service.keys["local"])
        yield client
        client.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def tiny_service(tmp_path_factory):
    with LocalService("tiny", tmp_path_factory.mktemp("tiny")) as service:
        yield service


@pytest.mark.slow
def test_rl_loop_example_raises_the_heldout_reward(bundled_client):
    rl = example("tinker_rl")
    lines = []
    # 12 steps, not the example's 8: sampling on the service is not bit-reproducible (requests
    # decode in batches that depend on their timing), so runs differ. From 0.527, seven runs on this
    # machine reached 0.525-0.755 after 8 steps (one fell, in a full `make test`) and 0.561-0.759
    # after 12 (four runs), and one more fell after 12 in a full `make test` on 12-07 (0.527 -> 0.524).
    # So 4 prompts a step, not 2: twice the groups behind each update (three runs passed, 160-170 s).
    # The test asks for a rise, not a fixed margin.
    settings = rl.RLSettings(steps=12, prompts_per_step=4)
    results = rl.rl_loop(bundled_client, BUNDLED, settings, log=lines.append)
    assert set(results) == {0, settings.steps} and len(lines) == settings.steps + 1
    assert results[settings.steps] > results[0], lines


@pytest.mark.slow
def test_sft_loop_example_lowers_the_heldout_loss(bundled_client):
    sft = example("tinker_sft")
    settings = sft.SFTSettings(steps=3, eval_every=0)
    results = sft.sft_loop(bundled_client, BUNDLED, settings, log=lambda line: None)
    assert set(results) == {0, 3}
    assert results[3] < 0.95 * results[0], results


@pytest.mark.parametrize("plan", [
    {},  # one pass, one mini-batch: the old policy is the sampler (ratio 1)
    {"minibatches": 2},  # two AdamW steps, the old log-probs from the service's forward
    {"num_iterations": 2},
    {"stale": True},  # trajectories from an older adapter: the truncated IS correction is on
    {"zero": True},  # no reward variance: both skip, the adapter does not move
])
def test_remote_step_makes_the_local_trainers_adapter(tiny_service, plan):
    """Same groups, same starting adapter: RemoteTrainer through the service and the local Trainer
    end at the same LoRA weights, one step plan for both (the weights folded into the advantages are
    exact), with mini-batches, several passes, the off-policy correction and the skip rule."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    from grooves.algorithms import preset
    from grooves.backend.client import RemotePolicy, RemoteTrainer
    from grooves.backend.service import ATTN, MLP
    from grooves.policy import LoRA, Policy
    from grooves.policy.sampler import Sampling
    from grooves.training.config import OptimConfig
    from grooves.training.gather import rollout_groups
    from grooves.training.trainer import Trainer

    remote = RemotePolicy(tiny_service.base_url, "tiny", rank=4, seed=0, api_key=tiny_service.keys["local"])
    try:
        tasks = [{"id": f"t{i}", "prompt": [{"role": "user", "content": f"count to {i}"}]} for i in range(2)]
        groups = rollout_groups(remote, tasks, [t["prompt"] for t in tasks], 4,
                                Sampling(temperature=1.0, max_new_tokens=6), torch.Generator().manual_seed(0), 0)
        for group in groups:
            for i, trajectory in enumerate(group.trajectories):
                trajectory.reward = 1.0 if plan.get("zero") else float(i % 3)
                if plan.get("stale"):
                    trajectory.policy_version = -1  # sampled before this trainer's step 0
                    trajectory.logprobs = [lp - 0.05 * (k % 2) for k, lp in enumerate(trajectory.logprobs)]
        assert all(len(t.logprobs) == len(t.completion_ids) > 0 for g in groups for t in g.trajectories)

        def adapter(name: str) -> dict[str, torch.Tensor]:
            path = remote.training.save_weights_for_sampler(name).result().path
            model_id, kind, folder = path[len("tinker://"):].split("/")
            files = list(tiny_service.root.glob(f"local/{model_id.replace(':', '-')}/{kind}/{folder}/adapter/"
                                                "adapter_model.safetensors"))
            return load_file(str(files[0]))

        local = Policy.load("tiny", lora=LoRA(rank=4, target_modules=ATTN + MLP), seed=0)  # the base: seed 0
        set_peft_model_state_dict(local.model, adapter("start"))
        algorithm = preset("grpo", num_iterations=plan.get("num_iterations", 1))
        optim = OptimConfig(learning_rate=1e-2)
        kwargs = dict(temperature=1.0, max_completion_length=6, total_steps=1, minibatches=plan.get("minibatches", 1))
        local_metrics = Trainer(local, algorithm, optim, kl_every=0, **kwargs).train_step(groups)
        remote_metrics = RemoteTrainer(remote, algorithm, optim, **kwargs).train_step(groups)
        after, mine = adapter("after"), get_peft_model_state_dict(local.model)
        assert set(after) == set(mine)
        moved = max(after[k].abs().max().item() for k in after if "lora_B" in k)  # B starts at 0
        if plan.get("zero"):
            assert remote_metrics["train/skipped"] == local_metrics["train/skipped"] == 1.0
            assert moved == 0.0
            return
        assert "train/skipped" not in remote_metrics and "train/skipped" not in local_metrics
        assert remote_metrics["train/grad_norm"] == pytest.approx(local_metrics["train/grad_norm"], rel=1e-3)
        assert remote_metrics["train/is_correction"] == local_metrics["train/is_correction"] \
            == float(bool(plan.get("stale")))
        if plan.get("stale"):
            assert remote_metrics["train/sampler_kl"] == pytest.approx(local_metrics["train/sampler_kl"], rel=1e-3)
            assert remote_metrics["train/is_ratio/max"] == pytest.approx(local_metrics["train/is_ratio/max"], rel=1e-4)
        assert moved > 1e-3  # the step changed the adapter
        assert max((after[k] - mine[k]).abs().max().item() for k in after) < 1e-5
    finally:
        remote.close()


def test_grooves_train_with_backend_samples_and_trains_on_the_service(tiny_service, tmp_path, monkeypatch):
    from grooves.backend.ledger import Ledger
    from grooves.cli import app

    monkeypatch.setenv("TINKER_API_KEY", tiny_service.keys["local"])
    path = tiny_config(tmp_path, steps=2)
    result = CliRunner().invoke(app, ["train", str(path), "--runs", str(tmp_path / "runs"), "--quiet",
                                      "--backend", tiny_service.base_url])
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "runs" / "tiny-run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/grad_norm" in r]
    assert trained and all(r["train/grad_norm"] > 0 for r in trained)
    assert any("val/reward/total" in r for r in rows)  # held-out validation sampled remotely too
    remote = json.loads((run_dir / "checkpoints" / "step-0002" / "adapter" / "remote.json").read_text())
    assert remote["state"].startswith("tinker://") and remote["service"] == tiny_service.base_url
    ledger = Ledger(tiny_service.root / "ledger.sqlite")
    usage = ledger.usage(None)
    ledger.close()
    assert sum(row[5] for row in usage) > 0 and sum(row[4] for row in usage) > 0  # trained and sampled tokens

    again = CliRunner().invoke(app, ["train", str(path), "--runs", str(tmp_path / "runs"), "--resume",
                                     "--backend", tiny_service.base_url])
    assert again.exit_code == 2 and "cannot be resumed yet" in again.output


@pytest.mark.parametrize("algorithm, message", [
    ('preset = "gspo"', "algorithm.loss: 'gspo' cannot run through [backend]"),
    ('preset = "dapo"\nbeta = 0.1', "algorithm.beta: a KL penalty"),
])
def test_backend_refuses_what_it_cannot_run(tmp_path, monkeypatch, algorithm, message):
    from grooves.cli import app

    monkeypatch.setenv("TINKER_API_KEY", "tml-nobody-0000000")
    path = tiny_config(tmp_path)
    path.write_text(path.read_text().replace('preset = "dapo"', algorithm))
    result = CliRunner().invoke(app, ["train", str(path), "--backend", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_backend_needs_an_api_key(tmp_path, monkeypatch):
    from grooves.cli import app

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["train", str(tiny_config(tmp_path)), "--backend", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "set the service's API key in $TINKER_API_KEY" in result.output
