"""OpenPipe ART's own client trains on grooves (issue 34, part 1).

An ART-style program (written here, not copied from ART) with the real ``openpipe-art`` install:
``model.register(GroovesBackend(...))`` is the only grooves line. It samples through
``model.openai_client()``, gathers groups with ``art.gather_trajectory_groups``, trains with
``backend.train`` for 2 steps on the tiny model, and logs with ``model.log``; the run is an
ordinary grooves run folder trained on the exact ids the server sampled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of LiteLLM's price list
art = pytest.importorskip("art")

from grooves.backend.art import GroovesBackend, restore_transformers  # noqa: E402

# `import art` patches transformers for the whole process (docs/art.md); collecting this module
# must not break the tests collected with it, so the patch is undone at once.
restore_transformers()
from grooves.runs.store import RunStore  # noqa: E402

TOPICS = ("fruit", "tree")


async def rollout(model, topic: str):
    """An ART rollout: the agent asks the model, keeps the Choice, scores the reply."""
    client = model.openai_client()
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": f"Name a {topic}."}]
    completion = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                      max_tokens=6, logprobs=True)
    choice = completion.choices[0]
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=float(len(choice.message.content or "")),
                          metadata={"topic": topic})


async def program(backend):
    model = art.TrainableModel(name="art-agent", project="grooves-test", base_model="tiny")
    await model.register(backend)
    rounds = []
    for _ in range(2):
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, topic) for _ in range(4)) for topic in TOPICS), pbar_desc=None)
        result = await backend.train(model, groups, learning_rate=1e-2)
        await model.log(groups, metrics=result.metrics, step=result.step, split="train")
        rounds.append((groups, result))
    return model, rounds


@pytest.fixture
def ran(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    backend = GroovesBackend(runs=tmp_path / "runs", config={"lora": {"rank": 4}})

    async def go():
        try:
            model, rounds = await program(backend)
            return model, rounds, await model.get_step(), backend.sessions["art-agent"].run_dir
        finally:
            await backend.close()
    return asyncio.run(go())


def _server_ids(choice) -> dict:
    return choice.model_extra["grooves"]


def test_an_art_program_trains_two_steps_on_the_ids_the_server_sampled(ran, tmp_path):
    model, rounds, step, run_dir = ran
    assert step == 2 and [result.step for _, result in rounds] == [1, 2]
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} == {"step-0000", "step-0001", "step-0002"}
    store = RunStore(run_dir)
    for number, (groups, result) in enumerate(rounds, start=1):
        stored = [t for _, t in store.read_trajectories(number)]
        choices = [t.messages_and_choices[-1] for g in groups for t in g.trajectories]
        assert len(stored) == len(choices) == 8
        # the trainer got the server's own ids: prompt and completion, token for token
        assert [t.completion_ids for t in stored] == [_server_ids(c)["completion_token_ids"] for c in choices]
        assert [t.prompt_ids for t in stored] == [_server_ids(c)["prompt_token_ids"] for c in choices]
        assert [t.completion_ids for t in stored] == [c.model_extra["token_ids"] for c in choices]
        # sampled by the newest adapter: round 2 by the adapter of step 1
        assert {_server_ids(c)["adapter_step"] or 0 for c in choices} == {number - 1}
        rewards = [float(len(c.message.content or "")) for c in choices]
        assert result.metrics["reward/total"] == pytest.approx(statistics.fmean(rewards))
        assert result.metrics["train/retokenized_turns"] == 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert (run_dir / "config.toml").read_text().count('spec = "tiny"') == 1
    before = load_file(run_dir / "checkpoints/step-0000/adapter/adapter_model.safetensors")
    after = load_file(run_dir / "checkpoints/step-0001/adapter/adapter_model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # ART's own log lands inside the run folder
    assert (run_dir / "art/grooves-test/models/art-agent/history.jsonl").is_file()
    listed = subprocess.run([sys.executable, "-m", "grooves.cli", "runs"], capture_output=True, text=True,
                            env={**os.environ, "GROOVES_RUNS": str(tmp_path / "runs"), "COLUMNS": "200"})
    assert "art-agent@2" in listed.stdout, listed.stdout + listed.stderr


def test_model_name_and_inference_name_answer_from_the_newest_adapter(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    backend = GroovesBackend(runs=tmp_path / "runs", config={"lora": {"rank": 4}})

    async def go():
        model = art.TrainableModel(name="newest", project="p", base_model="tiny")
        await model.register(backend)
        client = model.openai_client()
        messages = [{"role": "user", "content": "Hi"}]
        group = art.TrajectoryGroup([await rollout(model, "fruit") for _ in range(2)])
        group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
        await backend.train(model, [group], learning_rate=1e-2)
        by_name = await client.chat.completions.with_raw_response.create(model=model.name, messages=messages,
                                                                         max_tokens=2)
        by_step = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                       max_tokens=2)
        await backend.close()
        return model, by_name.headers["x-grooves-checkpoint"], by_step

    model, served, by_step = asyncio.run(go())
    assert served == "newest@1" and by_step.system_fingerprint == "newest@1"
    assert model.get_inference_name() == "newest@1"


def test_art_options_grooves_would_ignore_are_refused_by_name(tmp_path):
    backend = GroovesBackend(runs=tmp_path / "runs", config={"lora": {"rank": 4}})

    async def go():
        model = art.TrainableModel(name="opts", project="p", base_model="tiny")
        await model.register(backend)
        group = art.TrajectoryGroup([await rollout(model, "fruit") for _ in range(2)])
        try:
            with pytest.raises(ValueError, match="advantage_balance=0.5"):
                await backend.train(model, [group], advantage_balance=0.5)
            with pytest.raises(ValueError, match="GroovesBackend\\(algorithm='ppo'\\)"):
                await backend.train(model, [group], loss_fn="ppo")
            with pytest.raises(TypeError, match="'colour'"):
                await backend.train(model, [group], colour="red")
            assert await model.get_step() == 0
        finally:
            await backend.close()
    asyncio.run(go())


def test_multi_turn_episodes_train_up_to_a_break_and_hand_made_choices_are_rendered(tmp_path, monkeypatch):
    """A cut first turn sent back edited breaks its episode's prefix: trained up to the break and
    counted, never dropped. A Choice without the server's ids is rendered and counted."""
    from openai.types.chat.chat_completion import Choice

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    backend = GroovesBackend(runs=tmp_path / "runs", config={"lora": {"rank": 4}})

    async def episode(model, edit: bool):
        client = model.openai_client()
        messages = [{"role": "user", "content": "Start."}]
        first = (await client.chat.completions.create(model=model.name, messages=messages, max_tokens=3,
                                                      temperature=0)).choices[0]
        text = first.message.content
        follow = {"role": "user", "content": "Go on."}
        sent = [*messages, {"role": "assistant", "content": "(edited) " + text if edit else text}, follow]
        second = (await client.chat.completions.create(model=model.name, messages=sent, max_tokens=3,
                                                       temperature=0)).choices[0]
        return art.Trajectory(messages_and_choices=[*messages, first, follow, second], reward=1.0 if edit else 0.0)

    async def go():
        model = art.TrainableModel(name="turns", project="p", base_model="tiny")
        await model.register(backend)
        whole, broken = await asyncio.gather(episode(model, False), episode(model, True))
        hand = Choice(index=0, finish_reason="stop", message={"role": "assistant", "content": "Paris"})
        made = art.Trajectory(messages_and_choices=[{"role": "user", "content": "Capital?"}, hand], reward=0.5)
        try:
            result = await backend.train(model, [art.TrajectoryGroup([whole, broken, made])])
            session = backend.sessions["turns"]
            eot, paris = session.policy.end_of_turn_id, session.policy.tokenizer.encode("Paris", add_special_tokens=False)
            return whole, broken, result, session.run_dir, [*paris, eot]
        finally:
            await backend.close()

    whole, broken, result, run_dir, paris_ids = asyncio.run(go())
    assert result.metrics["rollout/prefix_breaks"] == 1.0 and result.metrics["train/retokenized_turns"] == 1.0
    stored = [t for _, t in RunStore(run_dir).read_trajectories(1)]
    assert len(stored) == 3
    first_of_broken = broken.messages_and_choices[1].model_extra["grooves"]["completion_token_ids"]
    assert stored[1].metadata["prefix_break"] and stored[1].completion_ids == first_of_broken
    ids = [c.model_extra["grooves"] for c in (whole.messages_and_choices[1], whole.messages_and_choices[3])]
    assert stored[0].prompt_ids + stored[0].completion_ids == ids[1]["prompt_token_ids"] + ids[1]["completion_token_ids"]
    assert stored[0].completion_mask.count(1) == len(ids[0]["completion_token_ids"]) + len(ids[1]["completion_token_ids"])
    assert stored[2].metadata["retokenized"] and stored[2].completion_ids == paris_ids


def test_ruler_scores_a_group_through_grooves_serve_with_its_litellm_parameters(tmp_path, monkeypatch, caplog):
    """RULER's judge is grooves serve's base model, reached through LiteLLM's hosted_vllm provider.
    The tiny random model cannot judge, so greedy decoding fills RULER's JSON schema until
    max_tokens; the reply shows the schema was enforced by the server's grammar."""
    from art.rewards import ruler, ruler_score_group

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    caplog.set_level(logging.INFO, logger="grooves.serve")
    backend = GroovesBackend(runs=tmp_path / "runs", config={"lora": {"rank": 4}})

    async def go():
        model = art.TrainableModel(name="judged", project="p", base_model="tiny")
        await model.register(backend)
        group = art.TrajectoryGroup([await rollout(model, topic) for topic in TOPICS])
        params = {"api_base": model.inference_base_url, "api_key": model.inference_api_key, "max_tokens": 40,
                  "temperature": 0}
        try:
            swallowed = await ruler_score_group(group, "hosted_vllm/tiny", extra_litellm_params=params,
                                                swallow_exceptions=True)
            with pytest.raises(Exception) as raised:
                await ruler([t.messages() for t in group.trajectories], "hosted_vllm/tiny",
                            extra_litellm_params=params)
            return swallowed, raised.value
        finally:
            await backend.close()

    swallowed, error = asyncio.run(go())
    assert swallowed is None
    assert '{"scores": [{"trajectory_id": "' in str(error)  # the schema's keys, in its order
    judged = [r.getMessage() for r in caplog.records if "model=tiny " in r.getMessage()]
    assert len(judged) == 2 and all("completion_tokens=40 status=200" in line for line in judged)


def test_model_train_sft_is_one_grooves_step_of_cross_entropy_batches(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    backend = GroovesBackend(runs=tmp_path / "runs", config={"lora": {"rank": 4}})
    example = art.Trajectory(messages_and_choices=[{"role": "user", "content": "Capital of France?"},
                                                   {"role": "assistant", "content": "Paris"}])

    async def go():
        model = art.TrainableModel(name="sft", project="p", base_model="tiny")
        await model.register(backend)
        losses = []
        async for metrics in backend._train_sft(model, [example] * 6, art.TrainSFTConfig(learning_rate=1e-2,
                                                                                         batch_size=2)):
            losses.append(metrics["loss/train"])
        step = await model.get_step()
        await backend.close()
        return losses, step

    losses, step = asyncio.run(go())
    assert step == 1 and len(losses) == 3
    assert losses[2] < losses[1] < losses[0]  # the same examples each batch: each AdamW step lowers the NLL
    lines = [json.loads(x) for x in (tmp_path / "runs/sft/metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and lines[0]["loss/sft"] == pytest.approx(sum(losses) / 3)
