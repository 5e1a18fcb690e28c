"""What the Tinker cookbook's loops need of grooves backend serve (issue 34, part 4), through the
official ``tinker`` SDK against the real server on 127.0.0.1: stop token ids in ``sample``, the
bundled model under its hub name, and ``RestClient``'s training-run and weights-info calls."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")

from tinker import types  # noqa: E402

from grooves.backend.local import LocalService  # noqa: E402

HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = types.ModelInput.from_ints([60, 61, 62, 63])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with LocalService("tiny", tmp_path_factory.mktemp("tiny"), tenants=["alice", "bob"]) as local:
        yield local


@pytest.fixture(scope="module")
def alice(service):
    client = tinker.ServiceClient(base_url=service.base_url, api_key=service.keys["alice"])
    yield client
    client.close("success").result(timeout=60)


def test_sample_stops_at_a_stop_token_id_and_keeps_it(alice):
    sampler = alice.create_sampling_client(base_model="tiny").result()
    seeded = types.SamplingParams(max_tokens=12, temperature=1.0, seed=5)  # the same draws each time
    free = sampler.sample(PROMPT, 1, seeded).result().sequences[0]
    assert len(free.tokens) == 12 and free.stop_reason == "length"
    # the first token that did not occur before it: stopping there cuts the sequence right after it
    cut = next(i for i in range(1, len(free.tokens)) if free.tokens[i] not in free.tokens[:i])
    stop = seeded.model_copy(update={"stop": [free.tokens[cut]]})
    stopped = sampler.sample(PROMPT, 1, stop).result().sequences[0]
    assert stopped.tokens == free.tokens[:cut + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut + 1], abs=1e-5)
    assert stopped.stop_reason == "stop"
    # the extra stop id was for that request only
    assert sampler.sample(PROMPT, 1, seeded).result().sequences[0].tokens == free.tokens


def test_rest_client_lists_and_describes_training_runs(service, alice):
    first = alice.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_mlp=False).result()
    second = alice.create_lora_training_client(base_model="tiny", rank=2, seed=1).result()
    state = first.save_state("one").result().path
    sampler_path = second.save_weights_for_sampler("two").result().path
    rest = tinker.RestClient(base_url=service.base_url, api_key=service.keys["alice"])

    listed = rest.list_training_runs(limit=2).result()
    assert [run.training_run_id for run in listed.training_runs] == [second.model_id, first.model_id]  # newest first
    assert listed.cursor.total_count >= 2 and listed.cursor.limit == 2 and listed.cursor.offset == 0
    page = rest.list_training_runs(limit=1, offset=1).result()
    assert [run.training_run_id for run in page.training_runs] == [first.model_id]

    run = rest.get_training_run_by_tinker_path(state).result()
    assert (run.training_run_id, run.base_model, run.model_owner, run.is_lora, run.lora_rank) == \
        (first.model_id, "tiny", "alice", True, 4)
    assert run.last_checkpoint.tinker_path == state and run.last_checkpoint.checkpoint_type == "training"
    assert run.last_sampler_checkpoint is None
    other = rest.get_training_run(second.model_id).result()
    assert other.last_sampler_checkpoint.tinker_path == sampler_path and other.last_checkpoint is None

    info = rest.get_weights_info_by_tinker_path(state).result()
    # tiny ties its output head to its embeddings, so train_unembed adapts nothing there
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, False)
    assert rest.get_weights_info_by_tinker_path(sampler_path).result().train_mlp is True

    bob_rest = tinker.RestClient(base_url=service.base_url, api_key=service.keys["bob"])
    assert first.model_id not in [r.training_run_id for r in bob_rest.list_training_runs().result().training_runs]
    with pytest.raises(Exception, match="404|no model"):
        bob_rest.get_training_run_by_tinker_path(state).result()
    with pytest.raises(Exception, match="404|no checkpoint"):
        bob_rest.get_weights_info_by_tinker_path(state).result()


@pytest.mark.slow
def test_the_bundled_model_answers_to_its_hub_name(tmp_path):
    with LocalService("bundled:smollm2-135m-instruct", tmp_path) as local:
        client = tinker.ServiceClient(base_url=local.base_url, api_key=local.keys["local"])
        try:
            rest = tinker.RestClient(base_url=local.base_url, api_key=local.keys["local"])
            names = [m.model_name for m in rest.get_server_capabilities().result().supported_models]
            assert names == ["bundled:smollm2-135m-instruct", HUB_NAME]
            training = client.create_lora_training_client(base_model=HUB_NAME, rank=2, seed=0).result()
            assert training.get_info().lora_rank == 2
            params = types.SamplingParams(max_tokens=3, temperature=0.0)
            by_hub = client.create_sampling_client(base_model=HUB_NAME).result().sample(PROMPT, 1, params).result()
            by_spec = client.create_sampling_client(base_model="bundled:smollm2-135m-instruct").result().sample(
                PROMPT, 1, params).result()
            assert by_hub.sequences[0].tokens == by_spec.sequences[0].tokens  # the same weights
        finally:
            client.close("success").result(timeout=60)
