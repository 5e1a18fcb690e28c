"""Each loss the service accepts, through the official SDK, is grooves' loss function on the same
batch: ``loss:sum`` is the summed loss computed directly from the model's logits with the
function in ``grooves.algorithms.losses``, ``optim_step``'s gradient norm is that loss's gradient
norm, and the adapter after the step is an AdamW step on that gradient (within 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from grooves.algorithms import grpo  # noqa: E402
from grooves.algorithms.losses import TINKER_LOSSES  # noqa: E402
from grooves.backend.local import LocalService  # noqa: E402
from grooves.backend.service import ATTN, MLP  # noqa: E402
from grooves.policy import LoRA, Policy  # noqa: E402
from grooves.training.datums import AdamParams  # noqa: E402
from grooves.training.trainer import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with LocalService("tiny", tmp_path_factory.mktemp("losses")) as service:
        client = tinker.ServiceClient(base_url=service.base_url, api_key=service.keys["local"])
        yield client, service.root
        client.close("success").result(timeout=60)


def batch(seed: int, prompt: int, completion: int) -> dict[str, list]:
    """A datum as the cookbook builds one: the sequence shifted by one, loss inputs 0 on the prompt."""
    gen = torch.Generator().manual_seed(seed)
    sequence = torch.randint(3, 200, (prompt + completion,), generator=gen).tolist()
    on = [0.0] * (prompt - 1) + [1.0] * completion
    advantage = float(torch.randn(1, generator=gen))
    # old log-probs near the model's own (about -5.5 per token) so that some ratios clip, some do not
    logprobs = [0.0] * (prompt - 1) + (-torch.rand(completion, generator=gen) - 5).tolist()
    return {"tokens": sequence[:-1], "target_tokens": sequence[1:], "weights": on, "logprobs": logprobs,
            "advantages": [advantage * w for w in on]}


def sdk_datum(row: dict, loss_fn: str) -> types.Datum:
    names = ["target_tokens", "weights"] if loss_fn == "cross_entropy" else ["target_tokens", "logprobs", "advantages"]
    return types.Datum(model_input=types.ModelInput.from_ints(row["tokens"]),
                       loss_fn_inputs={name: row[name] for name in names})


def saved_adapter(training, root, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model_id, kind, folder = training.save_weights_for_sampler(name).result().path[len("tinker://"):].split("/")
    return load_file(str(root / "local" / model_id.replace(":", "-") / kind / folder / "adapter" /
                         "adapter_model.safetensors"))


@pytest.mark.parametrize("loss_fn, config", [
    ("cross_entropy", None), ("importance_sampling", None), ("ppo", None), ("cispo", None),
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.05}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.5}),
])
def test_forward_backward_through_the_sdk_is_grooves_loss_on_the_same_batch(client, loss_fn, config):
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    sdk, root = client
    training = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    rows = [batch(1, 4, 5), batch(2, 3, 7)]
    local = Policy.load("tiny", lora=LoRA(rank=4, target_modules=ATTN + MLP), seed=0)  # the base: seed 0
    set_peft_model_state_dict(local.model, saved_adapter(training, root, "start"))
    adam = dict(learning_rate=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)

    out = training.forward_backward([sdk_datum(r, loss_fn) for r in rows], loss_fn, loss_fn_config=config).result()
    stepped = training.optim_step(types.AdamParams(**adam)).result()

    loss, eps_low, eps_high = TINKER_LOSSES[loss_fn]
    if config:  # Tinker's thresholds are ratio bounds: 1 - eps_low and 1 + eps_high
        eps_low, eps_high = 1 - config["clip_low_threshold"], config["clip_high_threshold"] - 1
    total = torch.zeros(())
    for row in rows:
        logits = local.causal_lm(input_ids=torch.tensor([row["tokens"]])).logits[0].float()  # (N, V)
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row["target_tokens"])[:, None]).T  # (1, N)
        old, adv = torch.tensor([row["logprobs"]]), torch.tensor([row["advantages"]])
        weights = torch.tensor([row["weights"]]) if loss_fn == "cross_entropy" else torch.ones_like(logp)
        total = total + (loss(logp, old, adv, (weights > 0).float(), eps_low, eps_high).per_token * weights).sum()
    total.backward()
    grad_norm = math.sqrt(sum(p.grad.square().sum().item() for p in local.trainable_parameters()))

    assert out.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-4, abs=1e-6)
    assert grad_norm > 0
    assert stepped.metrics["grad_norm:mean"] == pytest.approx(grad_norm, rel=1e-4)
    Trainer(local, grpo()).optim_step(AdamParams(adam["learning_rate"], adam["beta1"], adam["beta2"], adam["eps"]))
    after, mine = saved_adapter(training, root, "after"), get_peft_model_state_dict(local.model)
    assert set(after) == set(mine)
    assert max((after[k] - mine[k]).abs().max().item() for k in after) < 1e-5


def test_forward_backward_custom_runs_client_side_over_forward_and_cross_entropy(client):
    """The SDK's custom loss: a forward for the log-probs, the loss and its gradient on this machine,
    then a cross_entropy backward with weights = -dC/dlogp. A custom loss equal to cross_entropy
    with weights 2 must train exactly as cross_entropy with weights 2 does."""
    sdk, root = client
    row = batch(3, 4, 6)
    twice = {**row, "weights": [2.0 * w for w in row["weights"]]}
    runs = []
    for custom in (False, True):
        training = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        if custom:
            def loss(data, logprobs_list):
                weights = torch.tensor(row["weights"])
                return -(logprobs_list[0] * weights).sum() * 2.0, {"twice:sum": 1.0}

            out = training.forward_backward_custom([sdk_datum(row, "cross_entropy")], loss).result()
        else:
            out = training.forward_backward([sdk_datum(twice, "cross_entropy")], "cross_entropy").result()
        # eps well above the gradients: the step is about lr * g / eps, so a wrong scale would show
        training.optim_step(types.AdamParams(learning_rate=1.0, eps=10.0)).result()
        runs.append((out, saved_adapter(training, root, f"custom-{custom}")))
    (plain, plain_adapter), (custom_out, custom_adapter) = runs
    assert custom_out.metrics["twice:sum"] == 1.0
    assert max((plain_adapter[k] - custom_adapter[k]).abs().max().item() for k in plain_adapter) < 1e-6
