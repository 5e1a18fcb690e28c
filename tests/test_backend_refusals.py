"""grooves backend serve refuses what it should, early (issue 34, part 5), against the real server
on 127.0.0.1 (uvicorn over ``Backend`` with the tiny model): JSON nesting bounded, a body's size
bounded whatever the transfer encoding, every sampling field checked at submit, a client that
goes away logged in one line, and every 4xx/5xx logged with its reason."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import time

import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from grooves.backend import wire  # noqa: E402
from grooves.backend.app import create_app  # noqa: E402
from grooves.backend.service import Backend  # noqa: E402
from grooves.backend.tenants import Tenant  # noqa: E402
from grooves.serve.app import ServerThread  # noqa: E402

ALICE = "tml-alice-0000000000"
SESSION_BODY = {"tags": [], "user_metadata": {}, "sdk_version": "test"}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    backend = Backend("tiny", tmp_path_factory.mktemp("backend"))  # vocabulary 259, context 2048
    with ServerThread(create_app(backend, {ALICE: Tenant("alice", ALICE)})) as thread:
        port = thread.server.servers[0].sockets[0].getsockname()[1]
        yield backend, port
    backend.close()


@pytest.fixture
def http(service):
    with httpx.Client(base_url=f"http://127.0.0.1:{service[1]}", headers={"X-API-Key": ALICE}, timeout=30) as client:
        yield client


class Records(logging.Handler):
    """Every record of the service's logger and of uvicorn's error logger (where tracebacks go)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def logs():
    handler = Records()
    loggers = [logging.getLogger("grooves.backend"), logging.getLogger("uvicorn.error")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    yield handler
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


# --- JSON nesting -------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 33 + b"1" + b"}" * 33])
def test_json_nested_past_the_limit_is_400_with_the_reason(http, logs, body):
    response = http.post("/api/v1/create_session", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json() == {"detail": "the JSON body nests deeper than 32 levels"}
    assert not any(r.exc_info for r in logs.records)  # no RecursionError traceback
    assert http.get("/api/v1/healthz").json() == {"status": "ok"}


def test_brackets_inside_strings_and_nesting_up_to_the_limit_are_fine(http):
    body = dict(SESSION_BODY, tags=["[" * 1000, '\\"{' * 100])  # text, not structure
    assert http.post("/api/v1/create_session", json=body).status_code == 200
    # 32 levels: the outer object (1) and user_metadata's value nested 31 deep (the SDK type refuses it: 400 from
    # validation, not from the depth bound)
    deep = json.dumps(SESSION_BODY)[:-1] + ', "x": ' + "[" * 31 + "]" * 31 + "}"
    response = http.post("/api/v1/create_session", content=deep, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "nests deeper" not in response.json()["detail"]
    assert "CreateSessionRequest" in response.json()["detail"]


# --- body size, chunked -------------------------------------------------------------------


def padded(size: int) -> bytes:
    """A valid create_session body of exactly ``size`` bytes (JSON allows trailing spaces)."""
    text = json.dumps(SESSION_BODY).encode()
    return text + b" " * (size - len(text))


def chunks(body: bytes, size: int = 100):
    for start in range(0, len(body), size):  # a generator: httpx sends it chunked, without Content-Length
        yield body[start:start + size]


def test_a_chunked_body_over_the_limit_is_413_and_one_at_the_limit_is_read(http, monkeypatch):
    monkeypatch.setattr(wire, "MAX_BODY_BYTES", 1000)
    at_limit = http.post("/api/v1/create_session", content=chunks(padded(1000)),
                         headers={"Content-Type": "application/json"})
    assert at_limit.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in at_limit.request.headers
    assert at_limit.status_code == 200 and at_limit.json()["type"] == "create_session"
    over = http.post("/api/v1/create_session", content=chunks(padded(1001)),
                     headers={"Content-Type": "application/json"})
    assert over.status_code == 413 and over.json() == {"detail": "body over 1000 bytes"}
    protobuf = http.post("/api/v1/forward_backward", content=chunks(b"\x00" * 1001),
                         headers={"Content-Type": "application/x-protobuf"})
    assert protobuf.status_code == 413
    assert http.get("/api/v1/healthz").status_code == 200


# --- sampling fields, at submit ----------------------------------------------------------


def sample_body(prompt=(60, 61, 62), num_samples=1, **params) -> dict:
    return {"base_model": "tiny", "num_samples": num_samples, "sampling_params": params,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(prompt)}]}}


@pytest.mark.parametrize("body, reason", [
    (sample_body(seed=2**64), "sampling_params.seed must be 0..2**64-1, got 18446744073709551616"),
    (sample_body(seed=-1), "sampling_params.seed must be 0..2**64-1, got -1"),
    (sample_body(temperature=-0.5), "sampling_params.temperature must be a finite number >= 0, got -0.5"),
    (sample_body(temperature=math.inf), "sampling_params.temperature must be a finite number >= 0, got inf"),
    (sample_body(top_p=0.0), "sampling_params.top_p must be in (0, 1], got 0.0"),
    (sample_body(top_p=1.5), "sampling_params.top_p must be in (0, 1], got 1.5"),
    (sample_body(top_p=math.nan), "sampling_params.top_p must be in (0, 1], got nan"),
    (sample_body(max_tokens=0), "sampling_params.max_tokens must be 1..2045"),
    # 2048 context - 3 prompt tokens = 2045 new tokens at most
    (sample_body(max_tokens=2046), "sampling_params.max_tokens must be 1..2045 (the context of 2048 tokens less "
                                   "the prompt's 3), got 2046"),
    (sample_body(top_k=5), "not supported by this service: sampling_params.top_k"),
    (sample_body(stop=[]), "sampling_params.stop=[] (no stop at all) is not supported"),
    (sample_body(stop=[259]), "sampling_params.stop: token id 259 is outside the vocabulary (0..258)"),
    (sample_body(stop=["x" * 257]), "sampling_params.stop: each stop string must be 1..256 characters"),
    (sample_body(stop=["a"] * 17), "sampling_params.stop takes at most 16 entries, got 17"),
    (sample_body(num_samples=0), "num_samples must be 1..64, got 0"),
    (sample_body(num_samples=65), "num_samples must be 1..64, got 65"),
    (sample_body(prompt=(60, 259)), "prompt: token id 259 is outside the vocabulary (0..258)"),
    (sample_body(prompt=()), "prompt needs at least one token"),
])
def test_every_sampling_field_is_checked_at_submit(http, service, body, reason):
    before = len(service[0].futures)
    response = http.post("/api/v1/asample", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith(reason)
    assert len(service[0].futures) == before  # refused before anything was queued


@pytest.fixture(scope="module")
def model(service):
    """(session id, model id) of a rank-2 model of alice's."""
    with httpx.Client(base_url=f"http://127.0.0.1:{service[1]}", headers={"X-API-Key": ALICE}, timeout=30) as http:
        session = http.post("/api/v1/create_session", json=SESSION_BODY).json()["session_id"]
        created = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                          "base_model": "tiny", "lora_config": {"rank": 2}}).json()
        assert "error" not in http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]}).json()
        return session, created["model_id"]


@pytest.mark.parametrize("adam, reason", [
    ({"learning_rate": math.nan}, "adam_params.learning_rate must be a finite number >= 0, got nan"),
    ({"learning_rate": -1e-3}, "adam_params.learning_rate must be a finite number >= 0, got -0.001"),
    ({"beta1": 1.0}, "adam_params.beta1 must be a finite number in [0, 1), got 1.0"),
    ({"beta2": -0.1}, "adam_params.beta2 must be a finite number in [0, 1), got -0.1"),
    ({"eps": 0.0}, "adam_params.eps must be a finite number > 0, got 0.0"),
    ({"weight_decay": math.inf}, "adam_params.weight_decay must be a finite number >= 0, got inf"),
    ({"grad_clip_norm": -1.0}, "adam_params.grad_clip_norm must be a finite number >= 0 (0: no clipping), got -1.0"),
])
def test_adam_settings_are_checked_at_submit(http, service, model, adam, reason):
    body = {"model_id": model[1], "adam_params": {"learning_rate": 1e-3, **adam}}
    response = http.post("/api/v1/optim_step", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["detail"] == reason
    assert service[0].models[model[1]].trainer.step == 0  # no step was taken


@pytest.mark.parametrize("fields, reason", [
    ({"model_seq_id": 10**9}, "model_seq_id must be 0..999999999, got 1000000000"),
    ({"lora_config": {"rank": 2, "seed": 2**64}}, "lora_config.seed must be 0..2**64-1, got 18446744073709551616"),
])
def test_create_model_fields_are_checked_at_submit(http, model, fields, reason):
    body = {"session_id": model[0], "model_seq_id": 1, "base_model": "tiny", **fields}
    response = http.post("/api/v1/create_model", json=body)
    assert response.status_code == 400 and response.json()["detail"] == reason


def test_prompt_logprobs_last_n_is_refused_not_ignored(http):
    body = dict(sample_body(), prompt_logprobs=True, prompt_logprobs_last_n=1)
    response = http.post("/api/v1/asample", json=body)
    assert response.status_code == 400
    assert response.json()["detail"] == "not supported by this service: prompt_logprobs_last_n"


def test_the_largest_seed_samples(http):
    response = http.post("/api/v1/asample", json=sample_body(seed=2**64 - 1, max_tokens=2))
    assert response.status_code == 200
    done = http.post("/api/v1/retrieve_future", json={"request_id": response.json()["request_id"]})
    assert done.status_code == 200 and done.headers["content-type"] == "application/x-protobuf"  # the samples, not an error


# --- a client that goes away; every refusal logged ------------------------------------------


def test_a_client_that_disconnects_mid_body_is_one_log_line_without_a_traceback(service, logs):
    with socket.create_connection(("127.0.0.1", service[1])) as sock:
        sock.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: " + ALICE.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"tags": [')
        time.sleep(0.3)  # the route is waiting for the rest of the body
    deadline = time.monotonic() + 10
    while not any("disconnected" in line for line in logs.lines()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # anything else it would log about it (a traceback) comes now
    assert [line for line in logs.lines() if "disconnect" in line.lower()] == \
        ["POST /api/v1/create_session: the client disconnected before its request was read"]
    assert not any(r.exc_info for r in logs.records)
    assert not any("Exception in ASGI application" in line for line in logs.lines())


def test_every_4xx_is_logged_with_its_reason(service, http, logs):
    with httpx.Client(base_url=f"http://127.0.0.1:{service[1]}", timeout=30) as anonymous:
        assert anonymous.get("/api/v1/healthz").status_code == 401
    assert http.get("/api/v1/no_such_route").status_code == 404
    assert http.post("/api/v1/asample", json=sample_body(seed=2**64)).status_code == 400
    assert http.get("/api/v1/training_runs", params={"limit": "many"}).status_code == 400
    lines = logs.lines()
    assert "GET /api/v1/healthz -> 401: missing or unknown X-API-Key" in lines
    assert "GET /api/v1/no_such_route -> 404: Not Found" in lines
    assert "POST /api/v1/asample -> 400: sampling_params.seed must be 0..2**64-1, got 18446744073709551616" in lines
    assert any(line.startswith("GET /api/v1/training_runs -> 400: invalid request: query.limit") for line in lines)


def test_a_request_refused_on_the_worker_is_logged_with_its_reason(http, logs):
    session = http.post("/api/v1/create_session", json=SESSION_BODY).json()["session_id"]
    created = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                      "base_model": "tiny", "lora_config": {"rank": 2}}).json()
    http.post("/api/v1/retrieve_future", json={"request_id": created["request_id"]})
    saved = http.post("/api/v1/save_weights", json={"model_id": created["model_id"], "seq_id": 1, "path": "..x"})
    failed = http.post("/api/v1/retrieve_future", json={"request_id": saved.json()["request_id"]}).json()
    assert failed["category"] == "user" and "checkpoint name '..x'" in failed["error"]
    assert f"request {saved.json()['request_id']} of tenant alice refused: {failed['error']}" in logs.lines()


def test_the_depth_bound_covers_every_body_the_sdk_sends():
    """The deepest JSON body the SDK sends (a sample request: body -> prompt -> chunks -> chunk -> tokens) is well
    inside the bound; the bound is what ``parse_json`` enforces."""
    from tinker import types

    from grooves.backend import edge

    request = types.SampleRequest(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                                  sampling_params=types.SamplingParams(stop=["a"]), base_model="tiny")

    def depth(value) -> int:
        if isinstance(value, dict):
            return 1 + max(map(depth, value.values()), default=0)
        if isinstance(value, list):
            return 1 + max(map(depth, value), default=0)
        return 0

    assert depth(request.model_dump(mode="json")) == 5 < edge.MAX_JSON_DEPTH


def test_grooves_backend_serve_prints_each_refusal_and_disconnect_in_one_line(tmp_path):
    """The command itself (a subprocess): what an operator reads on stderr."""
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[tenants.alice]\nkey = "{ALICE}"\n')
    proc = subprocess.Popen([sys.executable, "-c", "from grooves.cli import main; main()", "backend", "serve",
                             "--model", "tiny", "--port", "0", "--keys", str(keys), "--runs", str(tmp_path)],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        banner = proc.stderr.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", banner).group(1))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-Key": ALICE}, timeout=60) as http:
            assert http.post("/api/v1/asample", json=sample_body(seed=2**64)).status_code == 400
            assert http.get("/api/v1/healthz", headers={"X-API-Key": "tml-nobody-0000000"}).status_code == 401
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: " + ALICE.encode() +
                         b"\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.5)
        time.sleep(0.5)
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=60)[1]
    lines = [line.split(" ", 3)[-1] for line in rest.splitlines()]  # without the date, time and level
    assert "POST /api/v1/asample -> 400: sampling_params.seed must be 0..2**64-1, got 18446744073709551616" in lines
    assert "GET /api/v1/healthz -> 401: missing or unknown X-API-Key" in lines
    assert "POST /api/v1/create_session: the client disconnected before its request was read" in lines
    assert "Traceback" not in rest
