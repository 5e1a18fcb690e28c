"""The service's own work, made cheaper without changing what the Tinker API answers, through the
official tinker SDK against the real server on 127.0.0.1:

- a datum runs from its first position in the loss (a group's prompt once), and the answer still
  holds a log-prob for every position, each the model's own log-softmax over the whole sequence;
- sampling requests for one checkpoint that wait for the worker together are decoded in one
  batch, each drawing from its own seed (the tokens it gets alone) and charged to its own tenant.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from grooves.backend.local import LocalService  # noqa: E402
from grooves.backend.positions import loss_start  # noqa: E402
from grooves.backend.service import ATTN, MLP  # noqa: E402
from grooves.policy import LoRA, Policy  # noqa: E402
from grooves.training.datums import Datum  # noqa: E402


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with LocalService("tiny", tmp_path_factory.mktemp("service"), tenants=["alice", "bob"]) as local:
        yield local

def test_loss_start_is_the_first_position_the_loss_reads():
    datum = Datum([5, 6, 7, 8], [6, 7, 8, 9], weights=[0, 0, 1, 1], advantages=[0, 0, 0, 0.5])
    assert loss_start(datum, "cross_entropy") == 2
    assert loss_start(datum, "ppo") == 3
    assert loss_start(Datum([5, 6], [6, 7]), "cross_entropy") == 0  # no weights: every position
    assert loss_start(Datum([5, 6, 7], [6, 7, 8], advantages=[0, 0, 0]), "cispo") == 2  # none: the last one


def model_logprobs(policy: Policy, tokens: list[int], targets: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = policy.causal_lm(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


def test_every_position_gets_its_logprob_when_only_the_completion_is_trained(service):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (9, 6)]
    rows = []  # two completions of the first prompt, one of the second; one datum without any advantage
    for prompt, completion, advantage in ((0, 5, 0.7), (0, 3, -0.4), (1, 4, 0.9), (1, 4, 0.0)):
        sequence = prompts[prompt] + torch.randint(3, 200, (completion,), generator=gen).tolist()
        on = [0.0] * (len(prompts[prompt]) - 1) + [1.0] * completion
        rows.append({"tokens": sequence[:-1], "target_tokens": sequence[1:],
                     "logprobs": [-5.0 * w for w in on], "advantages": [advantage * w for w in on]})
    sdk = tinker.ServiceClient(base_url=service.base_url, api_key=service.keys["alice"])
    try:
        training = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        path = training.save_weights_for_sampler("start").result().path[len("tinker://"):]
        model_id, kind, folder = path.split("/")
        weights = load_file(str(service.root / "alice" / model_id.replace(":", "-") / kind / folder / "adapter" /
                                "adapter_model.safetensors"))
        datums = [types.Datum(model_input=types.ModelInput.from_ints(r["tokens"]),
                              loss_fn_inputs={k: r[k] for k in ("target_tokens", "logprobs", "advantages")})
                  for r in rows]
        out = training.forward_backward(datums, "ppo").result()
    finally:
        sdk.close("success").result(timeout=60)
    local = Policy.load("tiny", lora=LoRA(rank=4, target_modules=ATTN + MLP), seed=0)
    set_peft_model_state_dict(local.model, weights)
    for row, output in zip(rows, out.loss_fn_outputs, strict=True):
        answered = torch.tensor(output["logprobs"].tolist())
        assert answered.shape == (len(row["tokens"]),)
        expected = model_logprobs(local, row["tokens"], row["target_tokens"])
        assert (answered - expected).abs().max().item() < 1e-5


def test_a_groups_prompt_runs_through_the_model_once_log_probs_and_loss_together(service):
    # the answer's log-probs of the prompt's positions come from the training forward's own hidden
    # states: no second forward of the prompt to fill them in
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 200, (12,), generator=gen).tolist()
    datums = []
    for advantage in (0.5, -0.3, 0.8):
        sequence = prompt + torch.randint(3, 200, (4,), generator=gen).tolist()
        on = [0.0] * (len(prompt) - 1) + [1.0] * 4
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(sequence[:-1]),
                                  loss_fn_inputs={"target_tokens": sequence[1:], "logprobs": [-5.0 * w for w in on],
                                                  "advantages": [advantage * w for w in on]}))
    tokens = []
    decoder = service.backend.policy.causal_lm.get_decoder()
    hook = decoder.register_forward_pre_hook(
        lambda module, args, kwargs: tokens.append((kwargs.get("input_ids") if args == () else args[0]).numel()),
        with_kwargs=True)
    sdk = tinker.ServiceClient(base_url=service.base_url, api_key=service.keys["alice"])
    try:
        training = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        out = training.forward_backward(datums, "ppo").result()
    finally:
        hook.remove()
        sdk.close("success").result(timeout=60)
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [15, 15, 15]
    assert sum(tokens) == len(prompt) + 3 * 3  # the prompt once, then each completion's own inputs


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_waiting_requests_decode_together_with_their_own_draws(service):
    prompts = {"alice": [[60, 61, 62, 63], [70, 71]], "bob": [[80, 81, 82]]}
    backend = service.backend
    batches: list[int] = []
    sample = backend.sample

    def counted(checkpoint, futures, jobs):
        batches.append(len(jobs))
        return sample(checkpoint, futures, jobs)

    backend.sample = counted
    clients = {name: tinker.ServiceClient(base_url=service.base_url, api_key=service.keys[name])
               for name in prompts}
    try:
        samplers = {name: c.create_sampling_client(base_model="tiny").result() for name, c in clients.items()}

        def request(name: str, i: int):
            params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=10 + i + 5 * (name == "bob"))
            return samplers[name].sample(types.ModelInput.from_ints(prompts[name][i]), 2, params)

        busy = threading.Event()
        backend.submit("alice", lambda: (busy.wait(60), ("json", {}))[1])  # holds the worker
        wait_until(lambda: backend.current is not None and not backend.current.done.is_set())
        waiting = [request("alice", 0), request("alice", 1), request("bob", 0)]
        wait_until(lambda: backend.queued() == 3)
        busy.set()
        together = [[s.tokens for s in f.result().sequences] for f in waiting]
        assert batches == [3]
        alone = [[s.tokens for s in request(n, i).result().sequences] for n, i in
                 (("alice", 0), ("alice", 1), ("bob", 0))]
        assert batches == [3, 1, 1, 1]
        assert together == alone
        assert all(len(tokens) == 6 for request_tokens in together for tokens in request_tokens)
        usage = {(tenant, requests, sampled) for tenant, model, requests, _, sampled, _ in backend.ledger.usage()
                 if model == "base"}
        assert usage == {("alice", 4, 4 * 2 * 6), ("bob", 2, 2 * 2 * 6)}
    finally:
        for client in clients.values():
            client.close("success").result(timeout=60)
        backend.sample = sample


def test_a_published_checkpoint_samples_its_own_weights_after_more_training(service):
    """The newest published weights are sampled with the training adapter itself (no copy loaded
    from disk); once the model trains on, the same sampler must still sample the checkpoint."""
    sdk = tinker.ServiceClient(base_url=service.base_url, api_key=service.keys["alice"])
    try:
        training = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        published = training.save_weights_and_get_sampling_client().result()
        prompt, params = types.ModelInput.from_ints([60, 61, 62]), types.SamplingParams(max_tokens=6, seed=7)
        live = published.sample(prompt, 2, params).result().sequences
        datum = types.Datum(model_input=types.ModelInput.from_ints([60, 61, 62, 63, 64]),
                            loss_fn_inputs={"target_tokens": [61, 62, 63, 64, 65]})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=0.5)).result()
        kept = published.sample(prompt, 2, params).result().sequences
        moved = training.save_weights_and_get_sampling_client().result().sample(prompt, 2, params).result().sequences
    finally:
        sdk.close("success").result(timeout=60)
    assert [s.tokens for s in kept] == [s.tokens for s in live]
    for a, b in zip(kept, live, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(moved[0].logprobs, live[0].logprobs)) > 1e-3  # the step changed it
