"""The batched LoRA (grooves.policy.lora_batch): a server's batch with each row on its own adapter
decodes in one pass of each layer, as every row would alone with its adapter on PEFT's own path.

References come from the library with the batched LoRA and the packed weights switched off (PEFT's
LoRA layers, one row at a time), never from the path under test."""

import threading
import time

import httpx
import openai
import pytest
import torch
from peft.tuners.lora import layer as peft_lora

from grooves.policy import LoRA, Policy, lora_batch, packing
from grooves.policy.decoding import BASE_ADAPTER, Row, decode
from grooves.serve.adapters import AdapterRegistry
from grooves.serve.app import ServerThread, build_server, create_app

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [12, 13, 14, 15, 16]]


def write_adapter(folder, seed: int, rank: int, targets="all-linear", alpha: float = 16.0) -> None:
    """A PEFT folder for the tiny model whose B matrices are not zero (so it changes the output)."""
    policy = Policy.load("tiny", lora=LoRA(rank=rank, alpha=alpha, target_modules=targets), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    policy.save_adapter(folder)


@pytest.fixture
def adapters(tmp_path):
    """Two adapters of different ranks, scalings and target modules, and a third to reload with."""
    runs = tmp_path / "runs"
    write_adapter(runs / "wide", 1, rank=3)
    write_adapter(runs / "narrow", 2, rank=6, targets=["q_proj", "v_proj", "down_proj"], alpha=3.0)
    write_adapter(runs / "new", 3, rank=3)
    return runs


def rows(names: list[str]) -> list[Row]:
    return [Row(list(prompt), temperature=0, max_new_tokens=3 + i, ignore_eos=True, adapter=name)
            for i, (prompt, name) in enumerate(zip(PROMPTS, names))]


def peft_alone(policy, monkeypatch, row_list: list[Row]):
    """Each row decoded alone on PEFT's path, the packed weights off."""
    monkeypatch.setattr(lora_batch, "BATCH_LORA", False)
    monkeypatch.setattr(packing, "PACK_LINEARS", False)
    try:
        return [decode(policy, [row])[0] for row in row_list]
    finally:
        monkeypatch.setattr(lora_batch, "BATCH_LORA", True)
        monkeypatch.setattr(packing, "PACK_LINEARS", True)


def batched(policy, monkeypatch, row_list: list[Row]):
    """The rows in one batch; PEFT's LoRA layers must not run (they are swapped out)."""
    calls = []
    real = peft_lora.Linear.forward
    monkeypatch.setattr(peft_lora.Linear, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    outputs = decode(policy, row_list)
    monkeypatch.setattr(peft_lora.Linear, "forward", real)
    assert calls == []
    assert not any(isinstance(m, lora_batch.BatchedLoRA) for m in policy.causal_lm.modules())  # swapped back
    return outputs


def assert_alike(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.parametrize("pack", [True, False])
def test_a_mixed_batch_decodes_as_each_row_alone(adapters, monkeypatch, pack):
    """Two ranks, two scalings, an adapter on three modules only, a base row and a repeated adapter;
    rows leave the batch at different lengths. With and without the packed weights."""
    monkeypatch.setattr(packing, "PACK_LINEARS", pack)
    policy = Policy.load("tiny")
    registry = AdapterRegistry(policy, adapters, lora_roots=[adapters])
    for name in ("wide", "narrow"):
        registry.load_lora(name, adapters / name, inplace=False)
    wide, narrow = (registry.acquire(registry.resolve(name), set()) for name in ("wide", "narrow"))
    names = [wide, narrow, BASE_ADAPTER, wide]
    got = batched(policy, monkeypatch, rows(names))
    monkeypatch.setattr(packing, "PACK_LINEARS", True)
    assert_alike(got, peft_alone(policy, monkeypatch, rows(names)))
    assert len({tuple(o.token_ids) for o in got[:3]}) == 3  # the adapters matter (rows 0 and 2 share a prompt)
    one = rows([narrow, narrow])  # one adapter in the batch: no mask
    assert_alike(batched(policy, monkeypatch, one), peft_alone(policy, monkeypatch, one))


def test_stacks_are_kept_and_follow_reloads_and_changed_weights(adapters, monkeypatch):
    """A second batch on the same adapters reuses their stacks; an in-place reload (a new folder
    under the same name) and a weight changed in place are both seen at the next batch."""
    policy = Policy.load("tiny")
    registry = AdapterRegistry(policy, adapters, lora_roots=[adapters])
    registry.load_lora("w", adapters / "wide", inplace=False)
    registry.load_lora("n", adapters / "narrow", inplace=False)

    def names():
        return [registry.acquire(registry.resolve(n), set()) if n != BASE_ADAPTER else n
                for n in ("w", "n", BASE_ADAPTER, "w")]

    first = batched(policy, monkeypatch, rows(names()))
    kept = dict(policy._lora_stacks)
    assert len(kept) == 1
    batched(policy, monkeypatch, rows(names()))
    assert dict(policy._lora_stacks) == kept  # made once
    backwards = rows([names()[i] for i in (1, 0, 2, 3)])  # the adapters in another order (requests arrive in any)
    assert_alike(batched(policy, monkeypatch, backwards), peft_alone(policy, monkeypatch, backwards))
    assert dict(policy._lora_stacks) == kept  # still made once

    registry.load_lora("w", adapters / "new", inplace=True)
    reloaded = batched(policy, monkeypatch, rows(names()))
    assert_alike(reloaded, peft_alone(policy, monkeypatch, rows(names())))
    assert reloaded[0].token_ids != first[0].token_ids  # the new weights answer
    assert reloaded[1].token_ids == first[1].token_ids

    with torch.no_grad():  # a weight changed in place, as a trainer would
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name and f".{names()[1]}." in name:
                parameter.mul_(-2.0)
    changed = batched(policy, monkeypatch, rows(names()))
    assert_alike(changed, peft_alone(policy, monkeypatch, rows(names())))
    assert changed[1].token_ids != first[1].token_ids
    assert len(policy._lora_stacks) <= lora_batch.STACKS_KEPT


def test_an_adapter_on_new_modules_is_batched_after_a_load_outside_the_registry(adapters, monkeypatch):
    """The list of LoRA layers is kept between batches; an adapter loaded straight through PEFT (as
    the training service loads its samplers), whose target modules no earlier adapter had, makes
    it be found again, so its new layers are batched too (PEFT's layers must not run)."""
    policy = Policy.load("tiny")
    registry = AdapterRegistry(policy, adapters, lora_roots=[adapters])
    registry.load_lora("n", adapters / "narrow", inplace=False)  # q, v and down only
    narrow = registry.acquire(registry.resolve("n"), set())
    batched(policy, monkeypatch, rows([narrow, BASE_ADAPTER]))
    policy.model.load_adapter(str(adapters / "wide"), adapter_name="wide_direct")  # every linear layer
    mixed = rows([narrow, "wide_direct", BASE_ADAPTER, "wide_direct"])
    assert_alike(batched(policy, monkeypatch, mixed), peft_alone(policy, monkeypatch, mixed))


def test_a_server_batches_mixed_adapters_as_each_alone(adapters, monkeypatch):
    """Over HTTP: a base request and two runtime LoRAs queued together run as one batch, and each
    reply's tokens and logprobs are those of the request alone on PEFT's path."""
    served = build_server("tiny", runs=adapters)
    with ServerThread(create_app(served)) as thread:
        client = openai.OpenAI(base_url=thread.base_url, api_key="unused", max_retries=0)
        for name in ("wide", "narrow"):
            httpx.post(f"{thread.base_url}/load_lora_adapter", timeout=60,
                       json={"lora_name": name, "lora_path": str(adapters / name)}).raise_for_status()
        replies = {}

        def ask(model):
            replies[model] = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0,
                logprobs=True, extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]

        release = threading.Event()
        served.engine.control(release.wait)  # park the worker until all three requests are queued
        threads = [threading.Thread(target=ask, args=(m,)) for m in ("tiny", "wide", "narrow")]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while served.engine.queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        batches = served.engine.batches
        release.set()
        for t in threads:
            t.join()
        assert served.engine.batches - batches == 1
        policy, registry = served.policy, served.registry
        prompt = policy.chat_ids([{"role": "user", "content": "hello"}])

        def alone():  # on the worker thread, the only one that touches the model
            return peft_alone(policy, monkeypatch, [
                Row(prompt, temperature=0, max_new_tokens=6, ignore_eos=True,
                    adapter=registry.acquire(registry.resolve(m), set()) if m != "tiny" else BASE_ADAPTER)
                for m in ("tiny", "wide", "narrow")])

        expected = served.engine.control(alone).result(timeout=60)
    served.engine.stop()
    for model, want in zip(("tiny", "wide", "narrow"), expected):
        reply = replies[model]
        assert reply.model_extra["token_ids"] == want.token_ids
        got = [entry.logprob for entry in reply.logprobs.content]
        assert max(abs(x - y) for x, y in zip(got, want.logprobs)) < 1e-4
    assert replies["wide"].model_extra["token_ids"] != replies["tiny"].model_extra["token_ids"]
