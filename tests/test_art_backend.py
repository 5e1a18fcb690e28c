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

from grooves.backend.art import GroovesBackend  # noqa: E402
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
