"""An inference engine as the sampler (``[sampler] url``), against a live ``grooves serve`` subprocess
speaking vLLM's routes: the same samples as the trainer's own decoder, the same adapter after
three steps, a killed server survived, a server that keeps old weights caught by the ``sampler``
detector, and a prompt the server read otherwise counted and trained only up to the break.
Faults come from a forwarding proxy in front of the real server; nothing about the server is faked."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
import torch

from grooves.policy import LoRA, Policy, Sampling
from grooves.policy.decoding import decode
from grooves.policy.engine import EngineError, EngineSampler, _seed
from grooves.policy.rows import Row
from helpers import tiny_config

PROMPTS = [[{"role": "user", "content": f"count to {i}"}] for i in range(3)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(runs, port: int, *extra: str, model: str = "tiny") -> subprocess.Popen:
    """``grooves serve`` on ``model`` (the tiny one) in its own process, answering once the model is loaded."""
    proc = subprocess.Popen([sys.executable, "-c", "from grooves.cli import main; main()", "serve", "--model", model,
                             "--port", str(port), "--runs", str(runs), *extra], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            if proc.poll() is not None:
                raise RuntimeError(f"grooves serve did not start: {proc.stderr.read()}") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("grooves serve did not answer within 240 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    runs, port = tmp_path_factory.mktemp("engine") / "runs", free_port()
    runs.mkdir()
    proc = start_server(runs, port)
    yield runs, f"http://127.0.0.1:{port}/v1"
    stop_server(proc)


class Proxy:
    """Forwards every request to ``target``; ``edit(path, body) -> body`` injects a fault first."""

    def __init__(self, target: str, edit):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def _forward(self, body):
                path = self.path.removeprefix("/v1")
                if body is not None:
                    body = proxy.edit(path, body)
                reply = httpx.request(self.command, target + path, json=body, timeout=120)
                self.send_response(reply.status_code)
                self.send_header("Content-Type", reply.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            def log_message(self, *args):
                pass

        self.edit = edit
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def engine_run(tmp_path, url: str, steps: int, edits: tuple = (), **sampler) -> tuple:
    """A tiny training run whose rollouts the engine at ``url`` samples; (run, its config).
    ``edits``: (old, new) replacements in the config text."""
    from grooves.training import load_config, run_config

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tiny_config(tmp_path, steps=steps)
    table = "".join(f"{key} = {json.dumps(value)}\n" for key, value in {"url": url, **sampler}.items())
    # the server's tiny model is the one of seed 0 (its random weights follow the seed)
    text = path.read_text().replace("seed = 3\n", "seed = 0\n", 1)
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    path.write_text(text + f"\n[sampler]\n{table}")
    config = load_config(path)
    return run_config(config, runs=tmp_path / "runs", progress=False), config


def nonzero_adapter(policy: Policy, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)


def publish(policy: Policy, runs, url: str, name: str, version: int) -> None:
    folder = runs / "published" / f"{name}-{version}"
    policy.save_adapter(folder)
    reply = httpx.post(url + "/load_lora_adapter", json={"lora_name": f"{name}@{version}",
                                                          "lora_path": str(folder)}, timeout=60)
    assert reply.status_code == 200, reply.text


def test_the_engine_samples_what_the_trainers_decoder_samples(served):
    runs, url = served
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    nonzero_adapter(policy, 1)
    publish(policy, runs, url, "same", 0)
    engine = EngineSampler(policy, openai.OpenAI(base_url=url, api_key="none", max_retries=0), "same@0")
    greedy = Sampling(temperature=0, max_new_tokens=12)
    remote = engine.generate(PROMPTS, n=2, sampling=greedy)
    local = policy.sampler().generate(PROMPTS, n=2, sampling=greedy)
    for theirs, ours in zip(remote, local):
        for a, b in zip(theirs, ours):
            assert a.token_ids == b.token_ids and a.prompt_ids == b.prompt_ids and not a.prefix_break
            assert a.text == b.text and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert any(len(c.token_ids) > 1 for group in remote for c in group)


def in_process(policy: Policy, prompts, n: int, sampling: Sampling, seeds: list[int]):
    """The trainer's own decoder with the engine's seeding (sample i of a prompt: seed + i)."""
    encoded = [policy.chat_ids(p) for p in prompts]
    rows = [Row(ids, sampling.temperature, sampling.top_p, sampling.max_new_tokens, (),
                torch.Generator().manual_seed(seed + i)) for ids, seed in zip(encoded, seeds) for i in range(n)]
    outputs = decode(policy, rows)
    return [outputs[k * n:(k + 1) * n] for k in range(len(prompts))], encoded


def test_three_steps_sampled_by_the_engine_make_the_in_process_adapter(served):
    """The same seeded steps, sampled through the server and by the trainer's own decoder: the same
    tokens, logprobs within 1e-4, and after three updates published to the server, adapters within 1e-5."""
    from peft import get_peft_model_state_dict

    from grooves.algorithms import preset
    from grooves.training.config import OptimConfig
    from grooves.training.trainer import Trainer
    from grooves.types import Group, Trajectory

    runs, url = served
    policies = [Policy.load("tiny", lora=LoRA(rank=4), seed=0) for _ in range(2)]
    trainers = [Trainer(p, preset("grpo"), OptimConfig(learning_rate=5e-2), max_completion_length=8,
                        remote_sampler=True, kl_every=0) for p in policies]
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    engine = EngineSampler(policies[0], openai.OpenAI(base_url=url, api_key="none", max_retries=0), "")
    for step in range(3):
        publish(policies[0], runs, url, "steps", step)
        engine.model = f"steps@{step}"
        remote = engine.generate(PROMPTS, n=4, sampling=sampling, generator=torch.Generator().manual_seed(step))
        generator = torch.Generator().manual_seed(step)
        seeds = [_seed(generator) for _ in PROMPTS]
        local, encoded = in_process(policies[1], PROMPTS, 4, sampling, seeds)
        batches = []
        for samples, ids in ((remote, None), (local, encoded)):
            groups = []
            for k, group in enumerate(samples):
                trajectories = [Trajectory(messages=[], prompt_ids=c.prompt_ids if ids is None else ids[k],
                                           completion_ids=c.token_ids, completion_mask=[1] * len(c.token_ids),
                                           logprobs=c.logprobs, finish_reason=c.finish_reason,
                                           reward=float(len(set(c.token_ids))), policy_version=step)
                                for c in group]
                groups.append(Group(task={"id": str(k)}, trajectories=trajectories))
            batches.append(groups)
        for a, b in zip(*batches):
            for x, y in zip(a.trajectories, b.trajectories):
                assert x.completion_ids == y.completion_ids and x.prompt_ids == y.prompt_ids
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4
        metrics = [trainer.train_step(groups) for trainer, groups in zip(trainers, batches)]
        assert all("train/skipped" not in m for m in metrics), metrics
    after = [get_peft_model_state_dict(p.model) for p in policies]
    moved = max(v.abs().max().item() for k, v in after[0].items() if "lora_B" in k)
    assert moved > 1e-3
    assert max((after[0][k] - after[1][k]).abs().max().item() for k in after[0]) < 1e-5


def test_a_run_through_the_engine_trains_publishes_and_records_each_version(served, tmp_path):
    runs, url = served
    run, config = engine_run(tmp_path, url, steps=2, adapters=str(runs / "engine-a"), keep=2)
    assert run.step == 2 and run.halted_by is None
    from grooves.runs.store import RunStore

    store = RunStore(run.dir)
    try:
        trajectories = [t for _, t in store.read_trajectories(2, "train")]
    finally:
        store.close()
    assert {t.metadata["sampler_model"] for t in trajectories} == {"tiny-run@1"}
    assert {t.policy_version for t in trajectories} == {1}
    last = run.metrics[-1]
    assert last["train/is_correction"] == 1.0 and "train/sampler_kl" in last and last["rollout/prefix_breaks"] == 0
    assert sorted(p.name for p in (runs / "engine-a").iterdir()) == ["step-000001", "step-000002"]  # keep = 2
    names = {m["id"] for m in httpx.get(url + "/models").json()["data"]}
    assert {"tiny-run@1", "tiny-run@2"} <= names and "tiny-run@0" not in names


def test_an_engine_folder_outside_the_runs_root_loads_when_named_with_lora_root(tmp_path):
    runs, allowed, port = tmp_path / "runs", tmp_path / "engine-adapters", free_port()
    runs.mkdir()
    proc = start_server(runs, port, "--lora-root", str(allowed))
    try:
        url = f"http://127.0.0.1:{port}/v1"
        run, _ = engine_run(tmp_path / "train", url, steps=1, adapters=str(allowed))
        assert run.step == 1 and (allowed / "step-000001").is_dir()
        policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
        policy.save_adapter(runs / "inside")  # the runs root is no longer allowed once roots are named
        refused = httpx.post(url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(runs / "inside")})
        assert refused.status_code == 403
    finally:
        stop_server(proc)


def test_two_engines_take_requests_in_turn_and_each_serves_every_version(tmp_path):
    shared = tmp_path / "shared-adapters"
    procs, urls = [], []
    try:
        for name in ("a", "b"):
            runs, port = tmp_path / name, free_port()
            runs.mkdir()
            procs.append(start_server(runs, port, "--lora-root", str(shared)))
            urls.append(f"http://127.0.0.1:{port}/v1")
        run, _ = engine_run(tmp_path / "train", urls, steps=2, adapters=str(shared))
        assert run.step == 2 and run.halted_by is None
        for url in urls:
            names = {m["id"] for m in httpx.get(url + "/models").json()["data"]}
            assert {"tiny-run@1", "tiny-run@2"} <= names
            assert httpx.get(url.removesuffix("/v1") + "/health").json()["generated_tokens"] > 0
    finally:
        for proc in procs:
            stop_server(proc)


def test_a_killed_server_is_waited_for_and_the_run_goes_on(tmp_path):
    """kill -9 after step 1, back 3 s later on the same port: every step trains once, the lost
    adapters are loaded again; a server that never comes back stops the run with a clear error."""
    runs, port = tmp_path / "served", free_port()
    runs.mkdir()
    proc = start_server(runs, port)
    url = f"http://127.0.0.1:{port}/v1"
    metrics_file = tmp_path / "runs" / "tiny-run" / "metrics.jsonl"
    restarted = {}

    def killer():
        nonlocal proc
        while not (metrics_file.exists() and '"step": 1' in metrics_file.read_text()):
            time.sleep(0.05)
        stop_server(proc)
        time.sleep(3)
        restarted["proc"] = start_server(runs, port)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        run, _ = engine_run(tmp_path, url, steps=3, max_wait=240, adapters=str(runs / "adapters"))
    finally:
        thread.join(timeout=300)
        if "proc" in restarted:
            stop_server(restarted["proc"])
    steps = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines()]
    assert steps == [0, 1, 2, 3] and run.step == 3 and run.halted_by is None

    with pytest.raises(EngineError, match=r"sampler.url: the server did not answer .* for 2 s"):
        engine_run(tmp_path / "gone", url, steps=1, max_wait=2)


EDITS = (("dropout = 0.1", "dropout = 0.0"), ("learning_rate = 0.01", "learning_rate = 0.05"))


@pytest.mark.parametrize("table, message", [
    ({"sampling": {"top_p": 0.9}}, "sampling.top_p = 0.9: an engine reports each token's logprob under the full "
                                   "distribution"),
    ({"train": {"max_off_policy_steps": 3}}, "sampler.keep = 3: the async pipeline samples versions up to "
                                             "train.max_off_policy_steps = 3 behind, so keep at least 4"),
    ({"train": {"async_sampler": "process", "max_off_policy_steps": 1}}, "train.async_sampler = 'process'"),
    ({"backend": {"url": "http://127.0.0.1:9"}}, "[sampler] samples through an engine: leave out [backend]"),
])
def test_what_an_engine_cannot_sample_is_refused_with_the_field(table, message):
    from grooves.training.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"sampler": {"url": "http://127.0.0.1:9/v1"}, **table})


def test_grooves_train_says_when_the_engine_is_gone_without_a_traceback(tmp_path):
    from typer.testing import CliRunner

    from grooves.cli import app

    path = tiny_config(tmp_path, steps=1)
    path.write_text(path.read_text() + f'\n[sampler]\nurl = "http://127.0.0.1:{free_port()}/v1"\nmax_wait = 1\n')
    result = CliRunner().invoke(app, ["train", str(path), "--runs", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "sampler.url: the server did not answer /load_lora_adapter for 1 s" in result.output
    assert "Traceback" not in result.output


def test_a_server_that_keeps_the_old_adapter_fires_the_sampler_detector(served, tmp_path):
    """A proxy answers every version with the run's first one: the server says it loaded each new
    adapter, but samples the old weights. The same run through the honest server raises nothing.
    (No LoRA dropout here: with it, the trainer's log-probs differ from any sampler's by design.)"""
    runs, url = served
    first = {}

    def stale(path, body):
        if path == "/completions":
            first.setdefault("model", body["model"])
            body["model"] = first["model"]
        return body

    proxy = Proxy(url.removesuffix("/v1") + "/v1", stale)
    try:
        run, _ = engine_run(tmp_path / "stale", proxy.url, steps=8, edits=EDITS, adapters=str(runs / "stale"),
                            keep=10)
    finally:
        proxy.close()
    honest, _ = engine_run(tmp_path / "honest", url, steps=8, edits=EDITS, adapters=str(runs / "honest"))
    from grooves.runs.store import RunStore

    def alerts(run):
        store = RunStore(run.dir)
        try:
            return [a for a in store.read_alerts() if a["detector"] == "sampler"]
        finally:
            store.close()
    stale_kl = [m.get("train/sampler_kl") for m in run.metrics]
    honest_kl = [m.get("train/sampler_kl") for m in honest.metrics]
    stale_gap = [m.get("rollout/engine_logprob_gap") for m in run.metrics]
    assert alerts(run), (stale_kl, honest_kl, stale_gap)
    assert not alerts(honest), (stale_kl, honest_kl)


def test_a_prompt_the_server_read_otherwise_is_counted_and_trained_up_to_the_break(served, tmp_path):
    """A proxy drops one token from every later turn's prompt (a template that loses a separator):
    each such turn is a prefix break, and no token from the first break on is trained."""
    from grooves.envs import Env
    from grooves.envs.rollout import env_groups, sampler_generate
    from grooves.envs.users import ScriptedUser
    from grooves.policy.engine import EnginePolicy

    class Talk(Env):
        name = "talk"
        weights = {"talked": 1.0}
        max_turns = 3

        def tasks(self, split="train", n=None, seed=0):
            return [{"id": "t", "prompt": "Hello.", "user_turns": ["Add 2.", "Now add 3."]}]

        def score(self, state):
            return {"talked": 1.0}

    runs, url = served
    policy = Policy.load("tiny", lora=LoRA(rank=4), seed=0)
    publish(policy, runs, url, "talk", 0)
    first_prompt = {}

    def drop_separator(path, body):
        if path == "/completions":
            ids = body["prompt"]
            first_prompt.setdefault("length", len(ids))
            if len(ids) > first_prompt["length"]:  # a later turn: lose the token after the first prompt
                body["prompt"] = ids[: first_prompt["length"]] + ids[first_prompt["length"] + 1:]
        return body

    proxy = Proxy(url, drop_separator)
    try:
        engine = EngineSampler(policy, openai.OpenAI(base_url=proxy.url, api_key="none", max_retries=0), "talk@0")
        view = EnginePolicy(policy, engine)
        env = Talk()
        env.user = ScriptedUser()
        generate = sampler_generate(view, 1.0, 1.0, torch.Generator().manual_seed(0))
        [group] = env_groups(view, env, env.tasks(), 2, generate, 6)
    finally:
        proxy.close()
    for trajectory in group.trajectories:
        state = trajectory.metadata["state"]
        assert state["turns"] >= 2 and state["counters"]["prefix_breaks"] == state["turns"] - 1
        first_turn = trajectory.completion_mask.index(0)  # the model's first turn, then the env's text
        assert sum(trajectory.completion_mask[first_turn:]) == 0  # nothing after the break is trained
        assert sum(trajectory.completion_mask) > 0
