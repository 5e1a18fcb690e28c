"""Tenants of grooves backend serve: isolation on every route, metering, budgets (402), a full
queue (429). Raw HTTP with bodies encoded by the tinker SDK's own encoder where the SDK itself
would pause (402) or cannot send the request; the SDK where it can."""

from __future__ import annotations

import threading
import time

import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from grooves.backend.app import create_app  # noqa: E402
from grooves.backend.ledger import Ledger, Prices, load_prices  # noqa: E402
from grooves.backend.service import Backend  # noqa: E402
from grooves.backend.tenants import Tenant  # noqa: E402
from grooves.serve.app import ServerThread  # noqa: E402

ALICE, BOB, CAROL = "tml-alice-0000000000", "tml-bob-00000000000000", "tml-carol-000000000000"
DATUM = types.Datum(model_input=types.ModelInput.from_ints(list(range(60, 69))),
                    loss_fn_inputs={"target_tokens": list(range(61, 70)), "weights": [1.0] * 9})


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    env = pytest.MonkeyPatch()
    env.setenv("HF_HUB_OFFLINE", "1")  # the tokenizer the SDK loads is a local folder
    root = tmp_path_factory.mktemp("backend")
    # 1 USD per trained token: carol's budget of 20 USD covers two forward_backwards of 9 tokens and a bit
    backend = Backend("tiny", root, max_queue=3, prices=Prices(prompt=0.0, sample=0.0, train=1e6),
                      budgets={"carol": 20.0})
    tenants = {ALICE: Tenant("alice", ALICE), BOB: Tenant("bob", BOB), CAROL: Tenant("carol", CAROL, 20.0)}
    with ServerThread(create_app(backend, tenants)) as thread:
        port = thread.server.servers[0].sockets[0].getsockname()[1]
        yield backend, f"http://127.0.0.1:{port}"
    backend.close()
    env.undo()


def http(service, key):
    return httpx.Client(base_url=service[1], headers={"X-API-Key": key}, timeout=60)


def wait(client, request_id):
    while True:
        response = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if response.headers.get("content-type", "").startswith("application/json"):
            body = response.json()
            if isinstance(body, dict) and body.get("type") == "try_again":
                continue
            return response.status_code, body
        return response.status_code, response.content


def new_model(client) -> tuple[str, str]:
    session = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                          "sdk_version": "test"}).json()["session_id"]
    created = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                         "base_model": "tiny", "lora_config": {"rank": 2}}).json()
    assert wait(client, created["request_id"])[0] == 200
    return session, created["model_id"]


def fwdbwd(client, model_id, seq_id):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[DATUM], loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    body = forward_backward_request_to_proto(request).SerializeToString()  # the SDK's own encoder
    return client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})


def test_every_route_hides_another_tenants_things(service):
    with http(service, ALICE) as alice, http(service, BOB) as bob:
        session, model_id = new_model(alice)
        assert wait(alice, fwdbwd(alice, model_id, 1).json()["request_id"])[0] == 200
        saved = alice.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 2, "path": "s"}).json()
        path = wait(alice, saved["request_id"])[1]["path"]
        sampler = alice.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}).json()["sampling_session_id"]
        pending = alice.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id, "seq_id": 3,
                                                                        "path": "p"}).json()["request_id"]
        run = model_id
        bob_session, bob_model = new_model(bob)

        refused = {
            "heartbeat": bob.post("/api/v1/session_heartbeat", json={"session_id": session}),
            "finish": bob.post(f"/api/v1/sessions/{session}/finish", json={}),
            "create_model in her session": bob.post("/api/v1/create_model", json={
                "session_id": session, "model_seq_id": 5, "base_model": "tiny"}),
            "get_info": bob.post("/api/v1/get_info", json={"model_id": model_id}),
            "forward_backward": fwdbwd(bob, model_id, 4),
            "optim_step": bob.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 4,
                                                               "adam_params": {"learning_rate": 1.0}}),
            "save_weights (overwrite)": bob.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 4,
                                                                               "path": "s"}),
            "save_weights_for_sampler": bob.post("/api/v1/save_weights_for_sampler", json={"model_id": model_id,
                                                                                           "seq_id": 4}),
            "sampling session on her path": bob.post("/api/v1/create_sampling_session", json={
                "session_id": session, "sampling_session_seq_id": 1, "model_path": path}),
            "his session, her path": bob.post("/api/v1/create_sampling_session", json={
                "session_id": bob_session, "sampling_session_seq_id": 1, "model_path": path}),
            "load her state into his model": bob.post("/api/v1/load_weights", json={
                "model_id": bob_model, "seq_id": 1, "path": path, "optimizer": True}),
            "create his model from her state": bob.post("/api/v1/load_weights", json={
                "session_id": bob_session, "model_seq_id": 3, "path": path, "optimizer": True}),
            "get sampler": bob.get(f"/api/v1/samplers/{sampler}"),
            "sample with her sampler": bob.post("/api/v1/asample", json={
                "sampling_session_id": sampler, "seq_id": 0, "num_samples": 1,
                "prompt": {"chunks": [{"tokens": [60, 61], "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": 2}}),
            "sample her path": bob.post("/api/v1/asample", json={
                "model_path": path, "num_samples": 1,
                "prompt": {"chunks": [{"tokens": [60, 61], "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": 2}}),
            "list checkpoints": bob.get(f"/api/v1/training_runs/{run}/checkpoints"),
            "delete checkpoint": bob.delete(f"/api/v1/training_runs/{run}/checkpoints/weights/s"),
        }
        for what, response in refused.items():
            assert response.status_code == 404, (what, response.status_code, response.text)
        # her future is as unknown to him as one that never existed
        assert bob.post("/api/v1/retrieve_future", json={"request_id": pending}).status_code == 410
        # and everything of hers is still there
        assert wait(alice, pending)[0] == 200
        listed = alice.get(f"/api/v1/training_runs/{run}/checkpoints").json()["checkpoints"]
        assert {c["checkpoint_id"] for c in listed} == {"weights/s", "sampler_weights/p"}
        assert alice.delete(f"/api/v1/training_runs/{run}/checkpoints/weights/s").status_code == 200
        assert [c["checkpoint_id"] for c in alice.get(f"/api/v1/training_runs/{run}/checkpoints").json()[
            "checkpoints"]] == ["sampler_weights/p"]


@pytest.mark.parametrize("path", ["tinker://../../alice/x/weights/s", "tinker://abc/weights/../../../etc",
                                  "tinker://%s:train:0/weights/..", "tinker://%s:train:0/../weights/s",
                                  "file:///etc/passwd", "tinker://%s:train:0/weights/a/b"])
def test_crafted_and_traversing_paths_are_refused(service, path):
    with http(service, BOB) as bob:
        session, model_id = new_model(bob)
        crafted = path.replace("%s", session)
        response = bob.post("/api/v1/load_weights", json={"model_id": model_id, "seq_id": 1, "path": crafted,
                                                          "optimizer": False})
        assert response.status_code in (400, 404) and "tinker" in response.json()["detail"]
        response = bob.delete(f"/api/v1/training_runs/{model_id}/checkpoints/weights/..%2F..%2Fx")
        assert response.status_code in (400, 404)
    assert service[0].root.joinpath("bob").is_dir()  # nothing outside the tenant folders was touched


def test_metering_charges_each_request_once_and_budget_answers_402(service):
    backend = service[0]
    with http(service, CAROL) as carol:
        _, model_id = new_model(carol)
        first = fwdbwd(carol, model_id, 1).json()["request_id"]
        assert fwdbwd(carol, model_id, 1).json()["request_id"] == first  # the SDK's retry: same request
        assert wait(carol, first)[0] == 200
        assert wait(carol, fwdbwd(carol, model_id, 2).json()["request_id"])[0] == 200
        assert backend.ledger.spent("carol", backend.prices) == pytest.approx(18.0)  # 2 x 9 tokens, not 3
        assert wait(carol, fwdbwd(carol, model_id, 3).json()["request_id"])[0] == 200  # 18 < 20: allowed
        over = fwdbwd(carol, model_id, 4)
        assert over.status_code == 402 and "budget" in over.json()["detail"]
        # saving is not metered: a tenant over budget can still keep its work
        saved = carol.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 4, "path": "keep"})
        assert wait(carol, saved.json()["request_id"])[0] == 200
    (tenant, model, requests, prompt, sampled, trained), = [r for r in backend.ledger.usage() if r[0] == "carol"]
    assert (model, requests, prompt, sampled, trained) == (model_id, 3, 0, 0, 27)


def test_usage_command_prints_tokens_and_cost(service, tmp_path):
    from typer.testing import CliRunner

    from grooves.cli import app

    prices = tmp_path / "prices.toml"
    prices.write_text("prompt = 0.1\nsample = 0.2\ntrain = 1000000\n")
    assert load_prices(prices) == Prices(0.1, 0.2, 1e6)
    runs = service[0].root.parent / "usage-runs"
    (runs / "backend").mkdir(parents=True, exist_ok=True)
    ledger = Ledger(runs / "backend" / "ledger.sqlite")
    ledger.record("r1", "dana", "m1", "forward_backward", trained=7)
    ledger.record("r1", "dana", "m1", "forward_backward", trained=7)  # a retry: not charged again
    ledger.record("r2", "dana", "base", "sample", prompt=3, sampled=5)
    ledger.close()
    result = CliRunner().invoke(app, ["backend", "usage", "--runs", str(runs), "--prices", str(prices)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "7.000000" in result.output  # 7 trained tokens at 1 USD each
    assert "0.000001" in result.output  # 3 x 0.1 + 5 x 0.2 USD per million
    result = CliRunner().invoke(app, ["backend", "usage", "--runs", str(runs), "--since", "yesterday"])
    assert result.exit_code == 2 and "--since 'yesterday'" in result.output


def test_a_full_queue_answers_429_and_the_sdk_backs_off_until_there_is_room(service):
    backend = service[0]
    with http(service, ALICE) as alice:
        _, model_id = new_model(alice)
    release = threading.Event()
    try:
        backend.submit("alice", lambda: release.wait(30) and ("json", {}))  # the worker is busy with this
        while backend.queued():
            time.sleep(0.01)
        for _ in range(3):  # max_queue = 3
            backend.submit("bob", lambda: ("json", {}))
        with http(service, ALICE) as alice:
            full = fwdbwd(alice, model_id, 1)
        assert full.status_code == 429 and "queue is full" in full.json()["detail"]
        client = tinker.ServiceClient(base_url=service[1], api_key=ALICE)
        threading.Timer(1.5, release.set).start()
        start = time.monotonic()
        training = client.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
        assert training.forward_backward([DATUM], "cross_entropy").result().metrics["loss:sum"] > 0
        assert time.monotonic() - start >= 1.0  # it waited for room, then went through
        client.close("success").result(timeout=60)  # a close that never answers fails, not hangs
    finally:
        release.set()
