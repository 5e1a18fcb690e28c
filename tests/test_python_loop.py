"""grooves' own Python loop (issue 34, part 2): ``TrainingSession`` owns, serves and trains one model.

Everything real: the in-process ``grooves serve`` on 127.0.0.1, the official ``openai`` clients
(sync and async), the tiny random-weight model, SQLite. Numbers are worked out from the replies.
"""

from __future__ import annotations

import asyncio
import io
import json
import statistics

import openai
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from grooves.policy.checkpoints import resolve_checkpoint
from grooves.runs.store import RunStore
from grooves.serve.capture import CaptureError, merge_turns
from grooves.training.runfolder import RunExistsError
from grooves.training.session import TrainingSession, gather_groups
from grooves.types import Group

CONFIG = {"lora": {"rank": 4}, "optim": {"learning_rate": 1e-2}}


def session(tmp_path, name="loop", **kwargs) -> tuple[TrainingSession, io.StringIO]:
    out = io.StringIO()
    return TrainingSession(name, "tiny", runs=tmp_path / "runs", config=CONFIG,
                           console=Console(file=out, width=200), **kwargs), out


def adapter(run_dir, step: int) -> dict:
    return load_file(run_dir / f"checkpoints/step-{step:04d}/adapter/adapter_model.safetensors")


def test_the_run_folder_is_whole_and_latest_served_before_the_first_step(tmp_path):
    s, _ = session(tmp_path)
    try:
        assert {p.name for p in s.run_dir.iterdir()} >= {"config.toml", "metrics.jsonl", "run.sqlite", "checkpoints"}
        assert resolve_checkpoint("loop@latest", tmp_path / "runs").name == "step-0000"
        reply = s.client(max_retries=0).chat.completions.create(model=s.model_name, max_tokens=2,
                                                                messages=[{"role": "user", "content": "Hi"}])
        assert reply.system_fingerprint == "loop@0"
        assert 'spec = "tiny"' in (s.run_dir / "config.toml").read_text()
    finally:
        s.close()
    with pytest.raises(RunExistsError, match="resume"):
        session(tmp_path)


def test_async_clients_gather_groups_concurrently_then_train_and_serve_the_new_step(tmp_path):
    s, out = session(tmp_path)
    client = s.async_client(max_retries=0)
    in_flight, most = 0, 0

    async def one_group(topic: str) -> Group:
        nonlocal in_flight, most
        if topic == "broken":
            raise RuntimeError("the agent's tool crashed")
        recorder = s.async_recorder(client)
        in_flight += 1
        most = max(most, in_flight)
        await recorder.create(model=s.model_name, n=3, max_tokens=5, seed=7,
                              messages=[{"role": "user", "content": f"Name a {topic}."}])
        in_flight -= 1
        group = recorder.group({"id": topic})
        for t in group.trajectories:
            t.reward = float(len(t.completion_ids) + t.completion_ids[0] % 3)
        return group

    async def go():
        groups = await gather_groups([one_group(t) for t in ("fruit", "broken", "tree")], console=s.console)
        metrics = s.train(groups)
        after = await client.chat.completions.create(model=s.model_name, max_tokens=2,
                                                     messages=[{"role": "user", "content": "Hi"}])
        return groups, metrics, after

    try:
        groups, metrics, after = asyncio.run(go())
    finally:
        s.close()
    assert most == 2  # both live groups were in flight at once
    assert sorted(g.task["id"] for g in groups) == ["fruit", "tree"]
    assert "a group failed: RuntimeError: the agent's tool crashed" in out.getvalue()
    assert "groups 3/3 (1 failed, 6 trajectories)" in out.getvalue()
    rewards = [t.reward for g in groups for t in g.trajectories]
    assert metrics["reward/total"] == pytest.approx(statistics.fmean(rewards))
    assert after.system_fingerprint == "loop@1" and s.step == 1
    stored = RunStore(s.run_dir).read_trajectories(1)
    assert sorted(t.completion_ids for _, t in stored) == sorted(t.completion_ids for g in groups for t in g.trajectories)
    lines = [json.loads(x) for x in (s.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1]
    # resuming continues the same run: the step and the served checkpoint
    again, _ = session(tmp_path, resume=True)
    try:
        assert again.step == 1
        reply = again.client(max_retries=0).chat.completions.create(model=again.model_name, max_tokens=2,
                                                                    messages=[{"role": "user", "content": "Hi"}])
        assert reply.system_fingerprint == "loop@1"
    finally:
        again.close()


def test_steps_without_reward_variance_are_printed_and_three_in_a_row_raise_an_alert(tmp_path):
    s, out = session(tmp_path)
    try:
        recorder = s.recorder()
        recorder.create(model=s.model_name, n=2, max_tokens=3, messages=[{"role": "user", "content": "Go."}])
        group = recorder.group({"id": "go"})
        for t in group.trajectories:
            t.reward = 1.0  # every reward equal: nothing to learn
        metrics = [s.train([group]) for _ in range(3)]
    finally:
        s.close()
    text = out.getvalue()
    for step in (1, 2, 3):
        assert f"step {step} skipped: no group had reward variance (1 groups of 2" in text
    assert [m.get("alerts/no_signal", 0.0) for m in metrics] == [0.0, 0.0, 1.0]
    alerts = RunStore(s.run_dir).read_alerts()
    assert [(a["step"], a["detector"]) for a in alerts] == [(3, "no_signal")]
    assert "3 steps in a row trained nothing" in alerts[0]["message"]
    first, last = adapter(s.run_dir, 0), adapter(s.run_dir, 3)
    assert all(torch.equal(first[k], last[k]) for k in first)  # skipped steps leave the adapter as it was


def test_a_turn_cut_at_max_tokens_never_costs_its_siblings(tmp_path):
    """Part 3: a first turn cut at max_tokens in the middle of a character (the tiny model's byte
    tokens) comes back as text the template re-tokenises differently, so the second prompt does not
    extend it: that episode is trained up to the break and counted; its sibling trains whole."""
    s, _ = session(tmp_path)
    client = s.async_client(max_retries=0)

    async def episode(**sampling):
        recorder = s.async_recorder(client)
        messages = [{"role": "user", "content": "Start."}]
        first = await recorder.create(model=s.model_name, messages=messages, max_tokens=3, **sampling)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Go on."}]
        await recorder.create(model=s.model_name, messages=messages, max_tokens=3, **sampling)
        return recorder, recorder.episode()

    async def go():
        return await asyncio.gather(episode(temperature=0), episode(seed=0))

    try:
        (whole_rec, whole), (cut_rec, cut) = asyncio.run(go())
        whole.reward, cut.reward = 1.0, 0.0
        metrics = s.train([Group({"id": "start"}, [whole, cut])])
    finally:
        s.close()
    turn1, turn2 = (call.trajectories()[0] for call in cut_rec.calls)
    assert turn1.finish_reason == "length" and "\ufffd" in turn1.messages[-1]["content"]  # cut mid-character
    with pytest.raises(CaptureError, match="turn 2's prompt does not extend"):
        merge_turns([turn1, turn2])  # what the strict merge says, and what used to sink the group
    assert cut.metadata["prefix_break"] and cut.metadata["turns"] == 1 and cut.metadata["turns_sampled"] == 2
    broke = cut.metadata["prefix_break_at"]
    assert broke["turn"] == 2 and broke["expected"] != broke["got"]
    assert cut.completion_ids == turn1.completion_ids and cut.completion_mask == [1, 1, 1]
    assert whole.metadata["turns"] == 2 and "prefix_break" not in whole.metadata
    assert metrics["rollout/prefix_breaks"] == 1.0 and "train/skipped" not in metrics
    assert len(RunStore(s.run_dir).read_trajectories(1)) == 2


def test_a_running_grooves_serve_can_be_the_sampler(tmp_path):
    """server_url: the session trains here and writes checkpoints where that server reads them."""
    from grooves.serve.app import ServerThread, build_server, create_app

    served = build_server("tiny", runs=tmp_path / "runs")
    with ServerThread(create_app(served)) as http:
        s, _ = session(tmp_path, server_url=http.base_url)
        try:
            client = s.client(max_retries=0)
            recorder = s.recorder()
            recorder.create(model=s.model_name, n=2, max_tokens=3, messages=[{"role": "user", "content": "Go."}])
            group = recorder.group({"id": "go"})
            group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
            s.train([group])
            reply = client.chat.completions.create(model=s.model_name, max_tokens=2,
                                                   messages=[{"role": "user", "content": "Hi"}])
        finally:
            s.close()
            served.engine.stop()
    assert isinstance(client, openai.OpenAI) and reply.system_fingerprint == "loop@1"


def test_an_older_step_served_between_updates_stays_out_of_later_checkpoints(tmp_path):
    s, _ = session(tmp_path)

    def step() -> None:
        recorder = s.recorder()
        recorder.create(model=s.model_name, n=2, max_tokens=3, messages=[{"role": "user", "content": "Go."}])
        group = recorder.group({"id": "go"})
        group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
        s.train([group])

    try:
        step()
        old = s.client(max_retries=0).chat.completions.create(model="loop@0", max_tokens=2,
                                                              messages=[{"role": "user", "content": "Hi"}])
        step()
    finally:
        s.close()
    assert old.system_fingerprint == "loop@0"  # loaded from its checkpoint beside the live adapter
    folder = s.run_dir / "checkpoints/step-0002/adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json",
                                                         "adapter_model.safetensors"]
