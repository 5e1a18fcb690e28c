"""What the official openai SDK's helpers need from grooves serve (issue 13, items 4-7):
streamed tool calls, usage and top logprobs through ``chat.completions.stream``, token bytes,
the legacy completions API and ``models.retrieve``. Real server on 127.0.0.1, tiny model."""

import json

import openai
import pytest
import torch

from grooves.serve.app import ServerThread, build_server, create_app
from grooves.serve.responses import token_bytes

HELLO = [{"role": "user", "content": "hello"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    served = build_server("tiny")
    with ServerThread(create_app(served)) as thread:
        yield served, thread.base_url
    served.engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0)


def rebuilt(entries) -> bytes:
    return b"".join(bytes(e.bytes) for e in entries if e.bytes is not None)


def test_the_stream_helper_accumulates_tool_calls(client):
    with client.chat.completions.stream(model="tiny", messages=HELLO, max_tokens=80, seed=0, tools=[WEATHER],
                                        tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert call.function.parsed_arguments == json.loads(call.function.arguments)
    assert set(call.function.parsed_arguments) == {"city", "days"}
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and done[0].index == 0 and done[0].name == "get_weather"
    # the same request unstreamed gives the same call
    whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=80, seed=0, tools=[WEATHER],
                                           tool_choice="required").choices[0].message.tool_calls[0]
    assert whole.function.arguments == call.function.arguments


def test_raw_tool_call_deltas_carry_their_index(client):
    deltas = []
    for chunk in client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=80, seed=1, stream=True,
                                                tools=[WEATHER], tool_choice="required"):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
    assert [d.index for d in deltas] == [0]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"


def test_the_stream_helper_gets_usage_and_top_logprobs(client):
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=30, seed=2, logprobs=True, top_logprobs=3,
                  response_format={"type": "json_object"})
    with client.chat.completions.stream(stream_options={"include_usage": True}, **kwargs) as stream:
        final = stream.get_final_completion()
    whole = client.chat.completions.create(**kwargs)
    assert final.usage is not None and final.usage.model_dump() == whole.usage.model_dump()
    streamed, expected = final.choices[0].logprobs.content, whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected] and len(streamed) == whole.usage.completion_tokens
    for got, want in zip(streamed, expected):
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in want.top_logprobs], abs=1e-5)
        assert len(got.top_logprobs) == 3 and got.top_logprobs[0].logprob >= got.logprob - 1e-6


def test_usage_is_the_last_chunk_and_null_before(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, seed=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, seed=0, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


def test_logprob_bytes_are_the_tokens_own_and_rebuild_the_text(client):
    partial = 0
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, seed=seed, logprobs=True,
                                               top_logprobs=2)
        choice = reply.choices[0]
        assert rebuilt(choice.logprobs.content).decode("utf-8", errors="replace") == choice.message.content
        for entry in choice.logprobs.content:
            if entry.bytes is not None:
                assert len(entry.bytes) == 1  # the tiny model's tokenizer has one token per byte
                partial += entry.bytes[0] >= 0x80
    assert partial > 0  # some tokens were pieces of a multi-byte character
    with client.chat.completions.stream(model="tiny", messages=HELLO, max_tokens=24, seed=0, logprobs=True) as stream:
        for _ in stream:
            pass
        snapshot = stream.current_completion_snapshot.choices[0]
    assert rebuilt(snapshot.logprobs.content).decode("utf-8", errors="replace") == snapshot.message.content


def test_legacy_completions_echo_scores_the_prompt(server, client):
    prompt = "héllo € 😀"
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    tokens, logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
    assert len(tokens) == scored.usage.prompt_tokens == len(prompt.encode())  # one token per byte
    assert logprobs[0] is None and all(lp <= 0 for lp in logprobs[1:])
    assert tokens[:4] == ["h", "bytes:\\xc3", "bytes:\\xa9", "l"]
    assert choice.logprobs.top_logprobs[0] is None and all(len(t) == 2 for t in choice.logprobs.top_logprobs[1:])
    assert choice.logprobs.text_offset[:4] == [0, 1, 1, 2]  # "h", the two bytes of "é", "l"

    # the prompt's logprobs are the model's own: one forward pass, log-softmax, the next token's entry
    served = server[0]
    ids = served.policy.tokenizer.encode(prompt, add_special_tokens=True)
    with torch.no_grad():
        logits = served.policy.causal_lm(input_ids=torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)


def test_legacy_completions_several_prompts_n_and_streaming(client):
    reply = client.completions.create(model="tiny", prompt=["one", "two"], n=2, max_tokens=5, seed=3)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert 0 < reply.usage.completion_tokens <= 4 * 5
    texts = {}
    for chunk in client.completions.create(model="tiny", prompt=["one", "two"], n=2, max_tokens=5, seed=3,
                                           stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(4)] == [c.text for c in reply.choices]
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, echo=True, logprobs=1)
    assert ids.usage.prompt_tokens == 3 and len(ids.choices[0].logprobs.tokens) == 3 + 2
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="x", best_of=3, n=1)
    assert refused.value.body["param"] == "best_of"


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope@3")
    assert missing.value.body["code"] == "model_not_found"


@pytest.mark.slow
def test_token_bytes_of_the_bundled_tokenizer_rebuild_any_text(bundled_base):
    _, tokenizer = bundled_base
    text = "héllo € 😀 日本語"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [token_bytes(tokenizer, i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # some tokens hold part of a character
    assert token_bytes(tokenizer, tokenizer.eos_token_id) is None
