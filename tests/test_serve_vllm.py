"""grooves serve speaks vLLM's runtime-LoRA routes and token-level extensions: a real server on
127.0.0.1, the official openai client (``extra_body`` for vLLM's fields), httpx for the LoRA
routes. Expected numbers come from the library itself (a PEFT model loaded from the same
folder, a plain forward pass), never from the server."""

import json

import httpx
import openai
import pytest
import torch

from grooves.policy import LoRA, Policy, Sampling
from grooves.serve.app import ServerThread, build_server, create_app

HELLO = [{"role": "user", "content": "hello"}]


def write_adapter(folder, seed: int) -> None:
    """A PEFT folder for the tiny model whose B matrices are not zero (so it changes the output)."""
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    policy.save_adapter(folder)


def greedy_alone(folder, tokens: int = 8):
    """What the adapter in ``folder`` says greedily, decoded by the library with nothing else loaded."""
    from peft import PeftModel

    base = Policy.load("tiny")
    policy = Policy(PeftModel.from_pretrained(base.model, str(folder)).eval(), base.tokenizer, "tiny")
    return policy.sampler().generate([HELLO], sampling=Sampling(temperature=0, max_new_tokens=tokens))[0][0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    runs, elsewhere = root / "runs", root / "elsewhere"
    for folder, seed in ((runs / "adapters" / "a", 1), (runs / "adapters" / "b", 2), (elsewhere / "c", 3)):
        write_adapter(folder, seed)
    (runs / "escape").symlink_to(elsewhere / "c")  # inside the root by name, outside once resolved
    return runs, elsewhere


@pytest.fixture(scope="module")
def server(folders):
    served = build_server("tiny", runs=folders[0])
    with ServerThread(create_app(served)) as thread:
        yield served, thread.base_url
    served.engine.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0)


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[1]}/{route}", json=body, timeout=60)


def greedy(client, model: str, **extra):
    return client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0,
                                          extra_body={"return_token_ids": True, **extra})


def vllm_error(message: str, kind: str, status: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def test_a_loaded_lora_is_a_model_that_answers_as_its_folder_says(server, client, folders):
    runs, _ = folders
    folder = runs / "adapters" / "a"
    loaded = post(server, "load_lora_adapter", {"lora_name": "sql", "lora_path": str(folder)})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'sql' added successfully."
    try:
        card = next(m for m in client.models.list() if m.id == "sql")
        assert card.model_extra["root"] == str(folder.resolve()) and card.model_extra["parent"] == "tiny"
        raw = client.chat.completions.with_raw_response.create(
            model="sql", messages=HELLO, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
        reply = raw.parse()
        expected = greedy_alone(folder)
        assert reply.choices[0].model_extra["token_ids"] == expected.token_ids  # vLLM's name, per choice
        assert reply.model_extra["prompt_token_ids"] == Policy.load("tiny").chat_ids(HELLO)  # vLLM's, top level
        assert reply.system_fingerprint == "sql" and raw.headers["x-grooves-checkpoint"] == "sql"
        assert greedy(client, "tiny").choices[0].model_extra["token_ids"] != expected.token_ids  # the LoRA matters
    finally:
        post(server, "unload_lora_adapter", {"lora_name": "sql"})


def test_loading_a_loaded_name_is_refused_unless_it_is_an_in_place_reload(server, client, folders):
    runs, _ = folders
    first, second = runs / "adapters" / "a", runs / "adapters" / "b"
    assert post(server, "load_lora_adapter", {"lora_name": "v", "lora_path": str(first)}).status_code == 200
    try:
        again = post(server, "load_lora_adapter", {"lora_name": "v", "lora_path": str(second)})
        assert again.status_code == 400
        assert again.json() == vllm_error(
            "The lora adapter 'v' has already been loaded. If you want to load the adapter in place, set "
            "'load_inplace' to True.", "InvalidUserInput", 400)
        assert greedy(client, "v").choices[0].model_extra["token_ids"] == greedy_alone(first).token_ids
        reload = post(server, "load_lora_adapter", {"lora_name": "v", "lora_path": str(second), "load_inplace": True})
        assert reload.status_code == 200
        assert greedy(client, "v").choices[0].model_extra["token_ids"] == greedy_alone(second).token_ids
        assert len(server[0].registry.loaded()) == 1  # the old version was unloaded, not kept beside it
    finally:
        post(server, "unload_lora_adapter", {"lora_name": "v"})


def test_unloading_and_vllm_error_shapes(server, client, folders):
    runs, elsewhere = folders
    assert post(server, "load_lora_adapter", {"lora_name": "gone", "lora_path": str(runs / "adapters" / "a")}
                ).status_code == 200
    removed = post(server, "unload_lora_adapter", {"lora_name": "gone"})
    assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'gone' removed successfully."
    assert "gone" not in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError):
        greedy(client, "gone")
    twice = post(server, "unload_lora_adapter", {"lora_name": "gone"})
    assert twice.status_code == 404
    assert twice.json() == vllm_error("The lora adapter 'gone' cannot be found.", "NotFoundError", 404)

    missing = runs / "adapters" / "nothing-here"
    absent = post(server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(missing)})
    assert absent.status_code == 404
    assert absent.json() == vllm_error(f"Loading lora x failed: No adapter found for {missing}", "NotFoundError", 404)
    empty = post(server, "load_lora_adapter", {"lora_name": "", "lora_path": str(runs / "adapters" / "a")})
    assert empty.json() == vllm_error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
    unnamed = post(server, "load_lora_adapter", {"lora_path": str(runs / "adapters" / "a")})
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "lora_name"
    assert unnamed.json()["error"]["type"] == "BadRequestError" and unnamed.json()["error"]["code"] == 400


@pytest.mark.parametrize("where", ["outside", "dotdot", "symlink"])
def test_a_path_outside_the_allowed_roots_is_refused(server, client, folders, where):
    runs, elsewhere = folders
    path = {"outside": elsewhere / "c", "dotdot": runs / ".." / "elsewhere" / "c", "symlink": runs / "escape"}[where]
    refused = post(server, "load_lora_adapter", {"lora_name": "evil", "lora_path": str(path)})
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["type"] == "PermissionDeniedError" and error["code"] == 403 and str(path) in error["message"]
    assert "evil" not in [m.id for m in client.models.list()] and server[0].registry.loaded() == []


def test_prompt_logprobs_match_a_forward_pass_worked_out_here(client):
    policy = Policy.load("tiny")
    ids = policy.chat_ids(HELLO)
    with torch.no_grad():
        logp = torch.log_softmax(policy.causal_lm(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1,
                                           extra_body={"prompt_logprobs": 2})
    scored = reply.model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for position, token in enumerate(ids[1:]):
        entry = scored[position + 1]
        mine = logp[position]
        top = mine.topk(2).indices.tolist()
        assert set(entry) == {str(token), *map(str, top)}  # the prompt's token and the 2 likeliest
        assert entry[str(token)]["logprob"] == pytest.approx(mine[token].item(), abs=1e-4)
        assert entry[str(token)]["rank"] == int((mine >= mine[token]).sum())
        assert entry[str(top[0])]["rank"] == 1 or top[0] == token
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 2})
    assert refused.value.body["message"] == "`prompt_logprobs` are not available when `stream=True`."
    assert refused.value.body["param"] == "prompt_logprobs"


def test_streamed_token_ids_join_to_the_sample_and_the_last_chunk_names_the_weights(client):
    whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, seed=5, n=2,
                                           extra_body={"return_token_ids": True})
    joined, prompt, fingerprints = {0: [], 1: []}, None, set()
    for chunk in client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, seed=5, n=2,
                                                stream=True, extra_body={"return_token_ids": True}):
        prompt = prompt or chunk.model_extra.get("prompt_token_ids")
        fingerprints.add(chunk.system_fingerprint)
        for choice in chunk.choices:
            joined[choice.index] += choice.model_extra.get("token_ids") or []
    assert prompt == whole.model_extra["prompt_token_ids"]
    assert [joined[0], joined[1]] == [c.model_extra["token_ids"] for c in whole.choices]
    assert fingerprints == {None, "tiny"}


def test_legacy_completions_return_vllm_token_fields(client):
    policy = Policy.load("tiny")
    prompt = "the cat"
    ids = list(policy.tokenizer.encode(prompt, add_special_tokens=True))
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"return_token_ids": True, "prompt_logprobs": 0})
    choice = reply.choices[0].model_extra
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 4
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    assert all(set(entry) == {str(token)} for entry, token in zip(choice["prompt_logprobs"][1:], ids[1:]))
    assert reply.system_fingerprint == "tiny"
    assert json.loads(reply.model_dump_json())["choices"][0]["token_ids"] == choice["token_ids"]


def test_a_folder_peft_cannot_load_is_vllms_500_and_leaves_nothing_behind(server, client, folders):
    runs, _ = folders
    broken = runs / "adapters" / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["no_such_layer"]}')
    failed = post(server, "load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)})
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "InternalServerError" and failed.json()["error"]["code"] == 500
    assert "broken" not in [m.id for m in client.models.list()] and server[0].registry.loaded() == []
    assert greedy(client, "tiny").choices[0].finish_reason in {"stop", "length"}  # the server goes on


def test_a_name_of_any_text_is_served_and_its_header_cannot_be_forged(server, client, folders):
    runs, _ = folders
    name = "modèle\r\nX-Injected: 1"
    assert post(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(runs / "adapters" / "a")}
                ).status_code == 200
    try:
        raw = client.chat.completions.with_raw_response.create(model=name, messages=HELLO, max_tokens=2)
        assert raw.parse().system_fingerprint == name  # the body says it exactly
        assert raw.headers["x-grooves-checkpoint"] == "mod%C3%A8le%0D%0AX-Injected:%201"
        assert "x-injected" not in raw.headers
    finally:
        post(server, "unload_lora_adapter", {"lora_name": name})


def test_legacy_streams_carry_vllm_token_ids_too(client):
    whole = client.completions.create(model="tiny", prompt=["the cat", "a dog"], max_tokens=6, seed=9, n=2,
                                      extra_body={"return_token_ids": True})
    joined, prompts = {}, {}
    for chunk in client.completions.create(model="tiny", prompt=["the cat", "a dog"], max_tokens=6, seed=9, n=2,
                                           stream=True, extra_body={"return_token_ids": True}):
        for choice in chunk.choices:
            extra = choice.model_extra
            joined.setdefault(choice.index, []).extend(extra["token_ids"])
            if "prompt_token_ids" in extra:
                assert choice.index not in prompts  # on the first chunk of each choice only
                prompts[choice.index] = extra["prompt_token_ids"]
    for choice in whole.choices:
        assert joined[choice.index] == choice.model_extra["token_ids"]
        assert prompts[choice.index] == choice.model_extra["prompt_token_ids"]
