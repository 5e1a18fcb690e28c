"""Trajectory capture from openai-client rollouts against grooves serve."""

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from grooves import algorithms
from grooves.policy import LoRA, Policy, Sampling
from grooves.serve.app import ServerThread, build_server, create_app
from grooves.serve.capture import CaptureError, RecordedCall, Recorder, merge_turns
from grooves.training.step import drop_stale
from grooves.training.trainer import Trainer
from grooves.types import Trajectory


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    served = build_server("tiny", runs=tmp_path_factory.mktemp("runs"))
    with ServerThread(create_app(served)) as thread:
        yield openai.OpenAI(base_url=thread.base_url, api_key="x", max_retries=0)
    served.engine.stop()


def test_a_captured_call_is_the_trajectory_the_sampler_would_make(client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    recorder = Recorder(client)
    recorder.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    captured = recorder.trajectories()[0]
    policy = Policy.load("tiny")
    sampled = policy.sampler().generate([messages], sampling=Sampling(temperature=0, max_new_tokens=12))[0][0]
    assert captured.prompt_ids == sampled.prompt_ids and captured.completion_ids == sampled.token_ids
    assert captured.logprobs == pytest.approx(sampled.logprobs, abs=1e-5)
    assert captured.finish_reason == sampled.finish_reason and captured.completion_mask == [1] * 12
    assert captured.messages[-1] == {"role": "assistant", "content": sampled.text}
    assert captured.metadata["policy_step"] == 0


def test_an_episode_of_several_calls_masks_the_tokens_between_turns(client):
    recorder = Recorder(client)
    messages = [{"role": "user", "content": "Start."}]
    first = recorder.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    recorder.create(model="tiny", messages=messages, temperature=0, max_tokens=6)
    turn1, turn2 = (call.trajectories()[0] for call in recorder.calls)
    episode = recorder.episode()
    assert episode.prompt_ids == turn1.prompt_ids
    assert episode.prompt_ids + episode.completion_ids == turn2.prompt_ids + turn2.completion_ids
    between = len(turn2.prompt_ids) - len(turn1.prompt_ids) - len(turn1.completion_ids)
    assert episode.completion_mask == [1] * len(turn1.completion_ids) + [0] * between + [1] * len(turn2.completion_ids)
    assert episode.metadata["turns"] == 2
    broken = Trajectory(**{**turn2.__dict__, "prompt_ids": [7] + turn2.prompt_ids[1:]})
    with pytest.raises(CaptureError, match="does not extend"):
        merge_turns([turn1, broken])


def test_a_response_without_token_ids_is_refused(client):
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(CaptureError, match="grooves serve"):
        RecordedCall([], response).trajectories()


def test_captured_groups_train_and_stale_ones_are_dropped(client):
    recorder = Recorder(client)
    recorder.create(model="tiny", messages=[{"role": "user", "content": "Go."}], n=4, max_tokens=6, seed=1)
    group = recorder.group({"id": "go"})
    for t, r in zip(group.trajectories, (1.0, 0.0, 0.5, 0.2)):
        t.reward = r
    trainer = Trainer(Policy.load("tiny", lora=LoRA(rank=4)), algorithms.grpo(), max_completion_length=6,
                      max_staleness=1)
    trainer.step = 5  # the captured trajectories come from step 0: five updates old
    metrics = trainer.train_step([group])
    assert metrics["train/trajectories_stale"] == 4 and metrics["train/skipped"] == 1.0
    fresh, dropped = drop_stale([group], 1, 1)
    assert dropped == 0 and len(fresh[0].trajectories) == 4
    assert "train/skipped" not in Trainer(Policy.load("tiny", lora=LoRA(rank=4)), algorithms.grpo(),
                                          max_completion_length=6, max_staleness=1).train_step([group])


def test_the_capture_example_trains_against_a_live_server(tmp_path):
    example = Path(__file__).resolve().parent.parent / "examples" / "capture_openai.py"
    result = subprocess.run([sys.executable, str(example), "--model", "tiny", "--steps", "2", "--runs", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "step 2: reward" in result.stdout and "served capture@1" in result.stdout
    assert sorted(p.name for p in (tmp_path / "capture" / "checkpoints").iterdir()) == [
        "step-0000", "step-0001", "step-0002"]
