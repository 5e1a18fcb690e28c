"""grooves serve under bad input and faults (issue 13, items 1-3): real servers on 127.0.0.1,
the official openai client, the real CLI in a subprocess where the process itself is tested."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

import grooves.serve.engine as engine_module
from grooves.serve.app import ServerThread, build_server, create_app
from grooves.serve.engine import Failed, GenerationRequest
from grooves.serve.protocol import ChatCompletionRequest
from grooves.serve.responses import choice_message

HELLO = [{"role": "user", "content": "hello"}]
GROOVES = str(Path(sys.executable).parent / "grooves")


@pytest.fixture(scope="module")
def server():
    served = build_server("tiny", api_key="sesame", max_body_bytes=64 * 1024)
    with ServerThread(create_app(served)) as thread:
        yield served, thread.base_url
    served.engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1], api_key="sesame", max_retries=0)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[1], headers={"Authorization": "Bearer sesame"}, timeout=60) as h:
        yield h


def post_chat(http, **body):
    return http.post("/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 4, **body})


def test_a_seed_beyond_64_bits_is_a_400_and_later_requests_are_served(server, http, client):
    for seed in (2**64, 2**63, -(2**63) - 1):
        reply = post_chat(http, seed=seed)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed"
    assert client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, seed=2**63 - 1).choices
    assert http.get(server[1].removesuffix("/v1") + "/health").json()["engine"] == "running"


def test_the_engine_survives_a_request_that_fails_inside_it(server, client, monkeypatch):
    served, _ = server
    # The seed that killed the worker thread, handed to the engine past the HTTP checks.
    events = []
    done = threading.Event()
    served.engine.submit(GenerationRequest(model="tiny", prompt_ids=[5, 6, 7], seed=2**64, max_tokens=2,
                                           deliver=lambda e: (events.append(e), done.set())))
    assert done.wait(30) and isinstance(events[0], Failed) and "Overflow" in str(events[0].error)
    assert served.engine.running
    # A generation that raises: that request gets a 500 in OpenAI's shape, the next one is served.
    real_decode = engine_module.decode
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(engine_module, "decode", failing_once)
    with pytest.raises(openai.InternalServerError) as failed:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
    assert failed.value.status_code == 500 and failed.value.body["type"] == "server_error"
    assert "injected fault" not in json.dumps(failed.value.body)  # the detail goes to the log only
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, seed=1)
    assert reply.usage.completion_tokens >= 1 and len(calls) == 2


def test_health_reports_a_stopped_engine_and_requests_get_503_not_a_hang():
    served = build_server("tiny")
    with ServerThread(create_app(served)) as thread:
        served.engine.stop()
        health = httpx.get(thread.base_url.removesuffix("/v1") + "/health")
        assert health.status_code == 503 and health.json()["engine"] == "stopped"
        client = openai.OpenAI(base_url=thread.base_url, api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError) as stopped:
            client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
        assert stopped.value.status_code == 503 and stopped.value.body["code"] == "engine_stopped"


def test_only_the_bearer_scheme_and_every_route_but_health_needs_the_key(server):
    base = server[1].removesuffix("/v1")
    for header in ("sesame", "Basic sesame", "Token sesame", "Bearer wrong"):
        reply = httpx.get(f"{server[1]}/models", headers={"Authorization": header})
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server[1]}/models", headers={"Authorization": "bearer sesame"}).status_code == 200
    assert httpx.get(f"{base}/openapi.json").status_code == 401
    assert httpx.get(f"{base}/docs").status_code == 401
    assert "/v1/chat/completions" in httpx.get(f"{base}/openapi.json",
                                               headers={"Authorization": "Bearer sesame"}).json()["paths"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_a_body_over_the_limit_is_413_before_any_work(http):
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 100_000}]}
    reply = http.post("/chat/completions", json=huge)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit counts what arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"y" * 1000
        yield b'"}]}'

    chunked = http.post("/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "invalid_request_error"


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenising(server, http):
    served, _ = server
    chars = 60_000  # under the body limit; the tiny model's tokens are single bytes: 60000 > 2048 tokens
    reply = post_chat(http, messages=[{"role": "user", "content": "z" * chars}])
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"at least {chars // served.longest_token} tokens" in error["message"]
    legacy = http.post("/completions", json={"model": "tiny", "prompt": "z" * chars})
    assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "no spaces allowed"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0].function.parameters"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
    ("get_weather", "tools"),
])
def test_a_malformed_tools_list_is_a_400_naming_the_field(http, tools, param):
    reply = post_chat(http, tools=tools)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_refused_and_invalid_parameters_name_their_param(http, body, param):
    reply = post_chat(http, **body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and error["message"].startswith(param)


def test_nan_and_unknown_routes_get_openai_shaped_errors(http):
    nan = http.post("/chat/completions", content=b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}],'
                                                 b' "temperature": NaN}', headers={"content-type": "application/json"})
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
    for method, path, status in (("GET", "/nothing", 404), ("POST", "/models", 405)):
        reply = http.request(method, path)
        error = reply.json()["error"]
        assert reply.status_code == status and set(error) == {"message", "type", "param", "code"}


def test_parallel_tool_calls_false_returns_one_call():
    text = ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    both = ChatCompletionRequest(model="m", messages=HELLO, tools=tools)
    one = ChatCompletionRequest(model="m", messages=HELLO, tools=tools, parallel_tool_calls=False)
    assert [c["function"]["name"] for c in choice_message(both, text, "stop")[0]["tool_calls"]] == ["f", "g"]
    assert [c["function"]["name"] for c in choice_message(one, text, "stop")[0]["tool_calls"]] == ["f"]


def test_one_log_line_per_request_without_prompt_or_key(client, caplog):
    caplog.set_level(logging.INFO, logger="grooves.serve")
    reply = client.chat.completions.create(model="tiny", max_tokens=3, seed=0,
                                           messages=[{"role": "user", "content": "my secret words"}])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # the server logs a request once its response is sent, so the client can be back first
    deadline = time.monotonic() + 10
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "grooves.serve"]
        if any(line.startswith("GET /v1/models/no-such-model") for line in lines) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    chat = [line for line in lines if line.startswith("POST /v1/chat/completions")]
    assert chat == [f"POST /v1/chat/completions model=tiny prompt_tokens={reply.usage.prompt_tokens} "
                    f"completion_tokens={reply.usage.completion_tokens} status=200 " + chat[0].split()[-1]]
    assert chat[0].split()[-1].endswith("ms")
    assert any(line.startswith("GET /v1/models/no-such-model status=404") for line in lines)
    assert not any("secret" in line or "sesame" in line for line in lines)


# --- the CLI process -------------------------------------------------------------------


def test_a_busy_port_fails_fast_with_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([GROOVES, "serve", "--model", "tiny", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "serving" not in lines[0]


@pytest.mark.slow  # a CLI process per signal (~5-10 s each)
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_cli_server_promptly_even_with_requests_waiting(tmp_path, stop_signal):
    env = {**os.environ, "GROOVES_API_KEY": "sesame"}
    process = subprocess.Popen([GROOVES, "serve", "--model", "tiny", "--port", "0", "--runs", str(tmp_path)],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stderr.readline()
        assert "serving tiny" in line
        url = line.strip().split(" on ")[-1]
        http = httpx.Client(base_url=url, headers={"Authorization": "Bearer sesame"}, timeout=60)
        assert post_chat(http, seed=2**64).status_code == 400  # the wedge of old: the engine must live on
        outcomes = []

        def long_request():
            try:
                outcomes.append(post_chat(http, max_tokens=2000, n=16, ignore_eos=True).status_code)
            except httpx.HTTPError as error:
                outcomes.append(type(error).__name__)

        waiting = [threading.Thread(target=long_request) for _ in range(2)]
        for thread in waiting:
            thread.start()
        time.sleep(1.0)
        started = time.monotonic()
        process.send_signal(stop_signal)
        process.wait(timeout=15)
        assert time.monotonic() - started < 10, time.monotonic() - started
        for thread in waiting:
            thread.join(timeout=10)
        assert len(outcomes) == 2 and 200 not in outcomes  # halted, not finished
        log = process.stderr.read()
        assert "POST /v1/chat/completions model=tiny" in log and "status=400" in log and "sesame" not in log
    finally:
        if process.poll() is None:
            process.kill()
