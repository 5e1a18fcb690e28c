"""grooves serve, driven by the official openai client over real HTTP on 127.0.0.1."""

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from grooves.policy import Policy, Sampling
from grooves.serve.app import ServerThread, build_server, create_app
from grooves.training import load_config, run_config
from helpers import tiny_config

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    config = load_config(tiny_config(root, steps=2))
    config.optim.learning_rate = 0.05
    run_config(config, runs=root / "runs", progress=False)
    return root / "runs"


@pytest.fixture(scope="module")
def server(runs):
    served = build_server("tiny", runs=runs, aliases={"echo": "tiny-run@2"}, max_queue=4)
    with ServerThread(create_app(served)) as thread:
        yield served, thread.base_url
    served.engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0)


def ask(client, model="tiny", **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "hello"}])
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=model, **kwargs)


def test_models_lists_base_checkpoints_and_aliases(client):
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "tiny" and "echo" in ids
    assert {"tiny-run@2", "tiny-run@latest"} <= set(ids)


def test_completion_n_seed_and_usage(client):
    one = ask(client, n=3, seed=7, temperature=1.0)
    again = ask(client, n=3, seed=7, temperature=1.0)
    assert [c.message.content for c in one.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in one.choices}) > 1  # n samples differ from each other
    assert one.usage.completion_tokens <= 3 * 8 and one.usage.prompt_tokens > 0
    assert {c.finish_reason for c in one.choices} <= {"stop", "length"}


def test_greedy_reply_and_token_ids_match_the_library(server, client):
    reply = ask(client, temperature=0, max_tokens=10, extra_body={"return_token_ids": True})
    policy = Policy.load("tiny")
    messages = [{"role": "user", "content": "hello"}]
    expected = policy.sampler().generate([messages], sampling=Sampling(temperature=0, max_new_tokens=10))[0][0]
    extension = reply.model_extra["grooves"]
    assert extension["prompt_token_ids"] == policy.chat_ids(messages) and extension["adapter_step"] is None
    choice = reply.choices[0]
    assert choice.model_extra["grooves"]["completion_token_ids"] == expected.token_ids
    assert choice.message.content == expected.text


def test_streaming_gives_the_same_text(client):
    full = ask(client, seed=3, max_tokens=12, n=2)
    pieces = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=12, n=2, seed=3, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert [pieces[0], pieces[1]] == [c.message.content for c in full.choices]
    assert finish == {0: full.choices[0].finish_reason, 1: full.choices[1].finish_reason}


def test_stop_strings_and_logprobs(client):
    text = ask(client, temperature=0, max_tokens=12).choices[0].message.content
    stop = text[2:4]
    stopped = ask(client, temperature=0, max_tokens=12, stop=[stop], logprobs=True, top_logprobs=2)
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == text[: text.find(stop)]
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)


def test_json_schema_output_always_parses(client):
    schema = {"type": "object", "properties": {"score": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["score", "ok"]}
    for seed in range(3):
        reply = ask(client, seed=seed, max_tokens=60, temperature=1.0,
                    response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        data = json.loads(reply.choices[0].message.content)
        assert isinstance(data["score"], int) and isinstance(data["ok"], bool)
    # free strings: a random model never closes them; the budget guard closes them in time
    for seed in range(3):
        obj = ask(client, seed=seed, max_tokens=40, response_format={"type": "json_object"})
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        assert obj.choices[0].finish_reason == "stop"


FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "Forecast.",
    "parameters": {"type": "object", "properties": {"days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["days", "unit"]}}}


def test_forced_tool_choice_returns_a_parsed_call(client):
    reply = ask(client, seed=0, max_tokens=80, tools=[WEATHER, FORECAST],
                tool_choice={"type": "function", "function": {"name": "forecast"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "forecast" and isinstance(arguments["days"], int) and arguments["unit"] in "cf"
    with pytest.raises(openai.BadRequestError, match="not among the request's tools"):
        ask(client, tools=[FORECAST], tool_choice={"type": "function", "function": {"name": "nope"}})


def test_adapters_by_name_alias_and_runtime_changes(server, client, runs):
    base = ask(client, temperature=0, max_tokens=10).choices[0].message.content
    by_step = ask(client, "tiny-run@2", temperature=0, max_tokens=10, extra_body={"return_token_ids": True})
    by_alias = ask(client, "echo", temperature=0, max_tokens=10)
    assert by_step.choices[0].message.content == by_alias.choices[0].message.content != base
    assert by_step.model_extra["grooves"]["adapter_step"] == 2
    local = Policy.load("tiny-run@2", runs=runs)
    expected = local.sampler().generate(["hello"], sampling=Sampling(temperature=0, max_new_tokens=10))[0][0]
    assert by_step.choices[0].message.content == expected.text

    # the adapter routes, through the openai client's generic post/delete
    added = client.post("/adapters", body={"name": "prod", "checkpoint": "tiny-run@latest"}, cast_to=object)
    assert added["step"] == 2
    assert ask(client, "prod", temperature=0, max_tokens=10).choices[0].message.content == expected.text
    for bad in ("../etc", "a/b", ""):
        with pytest.raises(openai.BadRequestError):
            client.post("/adapters", body={"name": bad, "checkpoint": "tiny-run@2"}, cast_to=object)
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
        client.post("/adapters", body={"name": "x", "checkpoint": "../../etc@1"}, cast_to=object)
    assert client.delete("/adapters/prod", cast_to=object)["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        ask(client, "prod")
    with pytest.raises(openai.NotFoundError):
        client.delete("/adapters/nothing-here", cast_to=object)


def test_a_reply_names_the_checkpoint_that_answered(server, client, runs):
    """``RUN@latest``, an alias and a step all say which weights served them, in the body
    (``system_fingerprint``) and in a header, streamed too; the base says its own name."""
    from grooves.policy.checkpoints import list_checkpoints

    newest = list_checkpoints(runs / "tiny-run")[-1][0]
    for model, served in (("tiny-run@latest", f"tiny-run@{newest}"), ("echo", "tiny-run@2"),
                          ("tiny-run@2", "tiny-run@2"), ("tiny", "tiny")):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert raw.parse().system_fingerprint == served and raw.headers["x-grooves-checkpoint"] == served
    with client.chat.completions.with_streaming_response.create(
            model="tiny-run@latest", messages=[{"role": "user", "content": "hello"}], max_tokens=2,
            stream=True) as response:
        assert response.headers["x-grooves-checkpoint"] == f"tiny-run@{newest}"
        fingerprints = {chunk.system_fingerprint for chunk in response.parse()}
    assert fingerprints == {None, f"tiny-run@{newest}"}  # on the last chunk, as vLLM sends it
    legacy = client.completions.create(model="tiny-run@latest", prompt="hi", max_tokens=2)
    assert legacy.system_fingerprint == f"tiny-run@{newest}"


def test_latest_follows_a_run_that_keeps_training(server, client, runs, tmp_path):
    before = ask(client, "tiny-run@latest", max_tokens=4, extra_body={"return_token_ids": True})
    step = before.model_extra["grooves"]["adapter_step"]
    config = load_config(tiny_config(tmp_path, steps=step + 1))
    config.optim.learning_rate = 0.05
    run_config(config, out=runs / "tiny-run", resume=True, progress=False)
    after = ask(client, "tiny-run@latest", max_tokens=4, extra_body={"return_token_ids": True})
    assert after.model_extra["grooves"]["adapter_step"] == step + 1


def test_requests_are_batched_across_adapters(server, client):
    served = server[0]
    results = {}

    def call(name, seed):
        results[(name, seed)] = ask(client, name, seed=seed, max_tokens=6).choices[0].message.content

    release = threading.Event()
    served.engine.control(release.wait)  # park the worker until all four requests are queued
    threads = [threading.Thread(target=call, args=(name, seed)) for name in ("tiny", "echo") for seed in (1, 2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while served.engine.queue.qsize() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    batches = served.engine.batches
    release.set()
    for t in threads:
        t.join()
    assert len(results) == 4 and served.engine.batches - batches == 1  # base and adapter rows in one batch
    # a seeded sample is the same whatever shares its batch
    assert results[("tiny", 1)] == ask(client, seed=1, max_tokens=6).choices[0].message.content
    assert results[("echo", 1)] == ask(client, "echo", seed=1, max_tokens=6).choices[0].message.content


def test_errors_follow_the_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError) as missing:
        ask(client, "no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        ask(client, max_tokens=100_000)
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        ask(client, messages=[{"role": "robot", "content": "x"}])
    http = httpx.Client(base_url=server[1])
    broken = http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "error" in broken.json() and "Traceback" not in broken.text
    with pytest.raises(openai.BadRequestError) as missing_field:
        client.post("/chat/completions", body={"messages": [{"role": "user", "content": "x"}]}, cast_to=object)
    assert missing_field.value.body["param"] == "model"


def test_a_burst_beyond_the_queue_gets_429_with_retry_after(server):
    served, url = server
    statuses = []

    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)  # no retries: see every 429

    def call():
        try:
            ask(client, max_tokens=5)
            statuses.append((200, None))
        except openai.RateLimitError as error:
            statuses.append((error.status_code, error.response.headers.get("retry-after")))

    release = threading.Event()
    served.engine.control(release.wait)  # the worker is busy until released: the queue (4) fills
    threads = [threading.Thread(target=call) for _ in range(12)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(statuses) < 8 and time.monotonic() < deadline:  # 12 requests, 4 queue places
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join()
    assert sorted(statuses) == [(200, None)] * 4 + [(429, "1")] * 8


def test_api_key(runs):
    served = build_server("tiny", runs=runs, api_key="sesame")
    try:
        with ServerThread(create_app(served)) as thread:
            with pytest.raises(openai.AuthenticationError):
                ask(openai.OpenAI(base_url=thread.base_url, api_key="wrong", max_retries=0))
            ok = ask(openai.OpenAI(base_url=thread.base_url, api_key="sesame", max_retries=0))
            assert ok.choices[0].message.content is not None
            assert httpx.get(thread.base_url.removesuffix("/v1") + "/health").status_code == 200
    finally:
        served.engine.stop()


@pytest.mark.slow
def test_bundled_model_json_is_always_parseable(bundled_base, tmp_path):
    from grooves.serve.adapters import AdapterRegistry
    from grooves.serve.app import Server
    from grooves.serve.engine import Engine

    model, tokenizer = bundled_base
    policy = Policy(model, tokenizer, "bundled:smollm2-135m-instruct")
    registry = AdapterRegistry(policy, tmp_path)
    served = Server(policy, registry, Engine(policy, registry).start())
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                               "score": {"type": "integer"}}, "required": ["title", "score"]}
    try:
        with ServerThread(create_app(served)) as thread:
            client = openai.OpenAI(base_url=thread.base_url, api_key="x", max_retries=0)
            reply = client.chat.completions.create(
                model="bundled:smollm2-135m-instruct", n=4, seed=0, max_tokens=40,
                messages=[{"role": "user", "content": "Rate the title 'Cats sit on mats' from 1 to 10."}],
                response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": schema}})
            for choice in reply.choices:
                data = json.loads(choice.message.content)
                assert isinstance(data["title"], str) and isinstance(data["score"], int)
            free = client.chat.completions.create(
                model="bundled:smollm2-135m-instruct", n=4, seed=1, max_tokens=60,
                messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                response_format={"type": "json_object"})
            for choice in free.choices:
                assert isinstance(json.loads(choice.message.content), dict)
            call = client.chat.completions.create(
                model="bundled:smollm2-135m-instruct", seed=0, max_tokens=60, tools=[WEATHER],
                messages=[{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}],
                tool_choice="required").choices[0].message.tool_calls[0]
            assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    finally:
        served.engine.stop()
        del policy
        torch.set_grad_enabled(True)
