"""grooves backend serve, driven by the official tinker SDK over real HTTP on 127.0.0.1.

No mocks on either side: a real uvicorn server over ``Backend`` with the tiny random model, and
``tinker.ServiceClient`` from the installed SDK (raw HTTP only where the SDK cannot express the
request: malformed bodies, crafted paths, repeated seq_ids).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types  # noqa: E402

from grooves.backend.app import create_app  # noqa: E402
from grooves.backend.service import Backend  # noqa: E402
from grooves.backend.tenants import KeysError, Tenant, load_tenants  # noqa: E402
from grooves.serve.app import ServerThread  # noqa: E402

ALICE, BOB = "tml-alice-0000000000", "tml-bob-00000000000000"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    env = pytest.MonkeyPatch()
    env.setenv("HF_HUB_OFFLINE", "1")  # the tokenizer the SDK loads is a local folder
    root = tmp_path_factory.mktemp("backend")
    backend = Backend("tiny", root)
    tenants = {ALICE: Tenant("alice", ALICE), BOB: Tenant("bob", BOB)}
    with ServerThread(create_app(backend, tenants)) as thread:
        port = thread.server.servers[0].sockets[0].getsockname()[1]
        yield backend, f"http://127.0.0.1:{port}"
    backend.close()
    env.undo()


@pytest.fixture
def alice(service):
    client = tinker.ServiceClient(base_url=service[1], api_key=ALICE)
    yield client
    client.close("success").result(timeout=60)  # a close that never answers fails, not hangs


def text_datum(tokenizer, text: str) -> types.Datum:
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def test_sft_steps_through_the_sdk_lower_the_loss(alice):
    training = alice.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    datum = text_datum(tokenizer, "the grooves carved by pre-training")
    losses = []
    for _ in range(8):
        out = training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(out.metrics["loss:sum"])
        # loss:sum is the weighted sum of the returned per-token logprobs
        assert out.metrics["loss:sum"] == pytest.approx(-sum(out.loss_fn_outputs[0]["logprobs"].tolist()), rel=1e-4)
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.92 * losses[0], losses
    info = training.get_info()
    assert info.lora_rank == 4 and info.model_data.model_name == "tiny"


def test_rl_round_trip_sample_train_publish_sample(alice):
    """The cookbook's loop shape: sample -> importance_sampling -> optim_step -> new sampler."""
    training = alice.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([60, 61, 62, 63])
    result = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=5, seed=3, temperature=1.0)).result()
    assert len(result.sequences) == 4
    datums = []
    for i, seq in enumerate(result.sequences):
        assert len(seq.tokens) == len(seq.logprobs) > 0
        tokens = prompt.to_ints() + seq.tokens
        n = len(tokens) - 1
        prompt_part = prompt.length - 1
        advantage = 1.0 if i == 0 else -1.0 / 3
        datums.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * prompt_part + list(seq.logprobs),
                            "advantages": [0.0] * prompt_part + [advantage] * (n - prompt_part)}))
    out = training.forward_backward(datums, "importance_sampling").result()
    # on-policy: the trainer's logprobs of the sampled tokens equal the sampler's
    for datum, seq, output in zip(datums, result.sequences, out.loss_fn_outputs):
        trained = output["logprobs"].tolist()[prompt.length - 1:]
        assert np.allclose(trained, seq.logprobs, atol=1e-4)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = training.save_weights_and_get_sampling_client().result()
    best = result.sequences[0]
    scored = after.sample(types.ModelInput.from_ints(prompt.to_ints() + best.tokens), 1,
                          types.SamplingParams(max_tokens=1), include_prompt_logprobs=True).result()
    raised = sum(scored.prompt_logprobs[prompt.length:])
    assert raised > sum(best.logprobs)  # the rewarded completion became more likely


def test_save_state_and_create_from_state_restore_weights_and_optimizer(alice):
    training = alice.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    datum = text_datum(training.get_tokenizer(), "restart me")
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(adam).result()
    path = training.save_state("two").result().path
    assert path.endswith("/weights/two")

    def continue_two(client):
        losses = []
        for _ in range(2):
            losses.append(client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            client.optim_step(adam).result()
        return losses

    straight = continue_two(training)
    resumed = alice.create_training_client_from_state_with_optimizer(path).result()
    assert continue_two(resumed) == pytest.approx(straight, rel=1e-5)  # same Adam moments, same steps


def test_named_sampler_weights_and_base_sampling(alice):
    training = alice.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    path = training.save_weights_for_sampler("fresh").result().path
    assert path.endswith("/sampler_weights/fresh")
    params = types.SamplingParams(max_tokens=4, seed=7, temperature=0.0)
    prompt = types.ModelInput.from_ints([70, 71, 72])
    named = alice.create_sampling_client(model_path=path).result().sample(prompt, 1, params).result()
    base = alice.create_sampling_client(base_model="tiny").result().sample(prompt, 1, params).result()
    # a fresh LoRA (B = 0) is the base model
    assert named.sequences[0].tokens == base.sequences[0].tokens


# --- raw HTTP: what the SDK cannot send ------------------------------------------------------


def raw(service, key=ALICE):
    return httpx.Client(base_url=service[1], headers={"X-API-Key": key}, timeout=30)


def new_model(service, key=ALICE) -> str:
    with raw(service, key) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                            "sdk_version": "test"}).json()["session_id"]
        created = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                          "base_model": "tiny", "lora_config": {"rank": 2}}).json()
        assert "error" not in http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}).json()
        return created["model_id"]


def test_unknown_key_is_401(service):
    with raw(service, "tml-nobody-000000000") as http:
        assert http.post("/api/v1/client/config", json={"sdk_version": "x"}).status_code == 401


@pytest.mark.parametrize("body", [b"\xff\xff\xff", b"\x0a\x05hello\x12"])
def test_malformed_protobuf_is_400_and_the_service_stays_up(service, body):
    with raw(service) as http:
        response = http.post("/api/v1/forward_backward", content=body,
                             headers={"Content-Type": "application/x-protobuf"})
        assert response.status_code == 400 and "protobuf" in response.json()["detail"]
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}


def test_a_retried_seq_id_is_applied_once(service):
    model_id = new_model(service)
    backend = service[0]
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}}
    with raw(service) as http:
        first = http.post("/api/v1/optim_step", json=body).json()["request_id"]
        again = http.post("/api/v1/optim_step", json=body).json()["request_id"]
        assert first == again
        http.post("/api/v1/retrieve_future", json={"request_id": first})
    assert backend.models[model_id].trainer.step == 1


def test_another_tenants_model_checkpoints_and_futures_are_not_found(service, alice):
    training = alice.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    path = training.save_state("secret").result().path
    sampler_path = training.save_weights_for_sampler("secret").result().path
    bob_model = new_model(service, BOB)
    with raw(service, BOB) as http:
        assert http.post("/api/v1/get_info", json={"model_id": training.model_id}).status_code == 404
        opt = http.post("/api/v1/optim_step", json={"model_id": training.model_id, "seq_id": 9,
                                                   "adam_params": {"learning_rate": 1.0}})
        assert opt.status_code == 404
        for crafted in (path, sampler_path):
            load = http.post("/api/v1/load_weights", json={"model_id": bob_model, "seq_id": 1, "path": crafted,
                                                          "optimizer": True})
            assert load.status_code == 404, crafted
        for traversal in ("tinker://../alice/weights/secret", f"tinker://{training.model_id}/weights/../../x",
                          "tinker://x/weights/..", "/etc/passwd"):
            load = http.post("/api/v1/load_weights", json={"model_id": bob_model, "seq_id": 1, "path": traversal,
                                                          "optimizer": False})
            assert load.status_code == 400, traversal
    bob = tinker.ServiceClient(base_url=service[1], api_key=BOB)
    try:
        with pytest.raises(Exception, match="404|no checkpoint"):
            bob.create_sampling_client(model_path=sampler_path).result().sample(
                types.ModelInput.from_ints([70]), 1, types.SamplingParams(max_tokens=2)).result()
    finally:
        bob.close("success").result(timeout=60)  # a close that never answers fails, not hangs


def test_unsupported_requests_get_a_clear_400(service):
    model_id = new_model(service)
    with raw(service) as http:
        response = http.post("/api/v1/create_model", json={"session_id": "x", "model_seq_id": 0,
                                                           "base_model": "Qwen/Qwen3-8B"})
        assert response.status_code == 404  # the session is not alice's
        response = http.post("/api/v1/optim_step", json={"model_id": model_id, "adam_params": {"lr": 1}})
        assert response.status_code == 400 and "OptimStepRequest" in response.json()["detail"]


def test_keys_file_errors_name_the_entry(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[tenants.alice]\nkey = "sk-123456789012"\n')
    with pytest.raises(KeysError, match="tenants.alice.key must be a string that starts with 'tml-'"):
        load_tenants(keys)
    keys.write_text('[tenants.alice]\nkey = "tml-1234567890"\nbudget_usd = 2\n[tenants.bob]\nkey = "tml-1234567890"\n')
    with pytest.raises(KeysError, match="also the key of tenant 'alice'"):
        load_tenants(keys)
    keys.write_text('[tenants.alice]\nkey = "tml-1234567890"\nbudget_usd = 2.5\n')
    assert load_tenants(keys)["tml-1234567890"] == Tenant("alice", "tml-1234567890", 2.5)


def test_training_clients_share_one_base_model(service, alice):
    backend = service[0]
    alice.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    alice.create_lora_training_client(base_model="tiny", rank=2, seed=1).result()
    bases = {id(p) for n, p in backend.policy.model.named_parameters() if "lora_" not in n}
    assert len(bases) == sum(1 for n, _ in backend.policy.model.named_parameters() if "lora_" not in n)
    assert len(backend.policy.model.peft_config) >= 2  # several adapters, one set of base weights
    assert all(not p.requires_grad for n, p in backend.policy.model.named_parameters() if "lora_" not in n)
    assert torch.is_tensor(next(backend.policy.model.parameters()))


def test_cli_refuses_a_bad_keys_file_without_a_traceback(tmp_path):
    from typer.testing import CliRunner

    from grooves.cli import app

    keys = tmp_path / "keys.toml"
    keys.write_text("[tenants.alice]\nkey = 12\n")
    result = CliRunner().invoke(app, ["backend", "serve", "--keys", str(keys), "--model", "tiny", "--port", "0"])
    assert result.exit_code == 2
    assert "tenants.alice.key must be a string" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["backend", "serve", "--keys", str(tmp_path / "none.toml"), "--model", "tiny"])
    assert result.exit_code == 2 and "cannot read the keys file" in result.output


def test_tenants_take_turns_on_the_worker(service):
    backend = service[0]
    release, order = threading.Event(), []
    backend.submit("carol", lambda: release.wait(30) and ("json", {}))
    while backend.queued():
        time.sleep(0.01)
    futures = [backend.submit(t, lambda t=t, i=i: order.append(f"{t}{i}") or ("json", {}))
               for t, i in (("alice", 1), ("alice", 2), ("alice", 3), ("bob", 1), ("bob", 2))]
    release.set()
    for future in futures:
        assert future.done.wait(30)
    assert order == ["alice1", "bob1", "alice2", "bob2", "alice3"]


def test_oversized_compressed_and_non_protobuf_bodies_are_refused(service, monkeypatch):
    from grooves.backend import wire

    with raw(service) as http:
        response = http.post("/api/v1/forward_backward", content=b"{}", headers={"Content-Type": "application/json"})
        assert response.status_code == 415 and "protobuf" in response.json()["detail"]
        response = http.post("/api/v1/forward_backward", content=b"\x00" * 10,
                             headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
        assert response.status_code == 415
        monkeypatch.setattr(wire, "MAX_BODY_BYTES", 100)
        response = http.post("/api/v1/forward_backward", content=b"\x00" * 101,
                             headers={"Content-Type": "application/x-protobuf"})
        assert response.status_code == 413 and "100 bytes" in response.json()["detail"]
        assert http.get("/api/v1/healthz").status_code == 200


def test_the_routes_do_not_load_the_training_loop():
    """backend/app needs the trainer's primitives, not the loop (issue 30): a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys, grooves.backend.app; "
            "print(sorted(m for m in sys.modules if m.startswith('grooves.training')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "grooves.training.trainer" in loaded
    assert "grooves.training.loop" not in loaded and "grooves.training.api" not in loaded
