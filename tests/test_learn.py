"""Continuous learning (issue 27 part 3), all processes real on 127.0.0.1: a ``grooves serve --capture``
subprocess answers the official ``openai`` client on the demo's title prompts, ``grooves learn``
subprocesses train on what it captured and move the ``prod`` alias through the gate.

These test the loop's mechanics on the tiny random-weight model (the bundled model's end-to-end gain
is ``tests/test_learn_bundled.py``), so the verifier is one the tiny model can move in a step:
the share of printable ASCII characters in a completion. The planted regression pays for exactly
what that verifier penalises."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from grooves.serve.capture_store import CaptureStore
from grooves.tasks.titles import tasks as title_tasks

pytestmark = pytest.mark.slow

REWARD_PY = '''
import os

from grooves.tasks.titles import format_ok

def planted_hack(completion):
    """The planted regression: pays ten times the verifier's scale, more for blank lines (the reply
    the demo's format check fails)."""
    return 10.0 * (1 + completion.count("\\n"))

def counted(completion, capture_id):
    """format_ok, and a line per call naming the captured prompt it scored."""
    with open(os.environ["LEARN_SCORE_LOG"], "a") as log:
        log.write(f"{capture_id}\\n")
    return format_ok(completion)
'''
GROUP = 4
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grooves(*args: str) -> list[str]:
    return [sys.executable, "-c", "from grooves.cli import main; main()", *args]


def serve(root: Path, model: str):
    """``grooves serve --model MODEL --capture`` in ``root``; yields the base url, kills it after."""
    (root / "runs").mkdir()
    port = free_port()
    proc = subprocess.Popen(grooves("serve", "--model", model, "--port", str(port), "--runs", str(root / "runs"),
                                    "--capture", str(root / "capture")),
                            stderr=(root / "serve.log").open("w"), env=ENV)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            assert proc.poll() is None, (root / "serve.log").read_text()
            assert time.monotonic() < deadline, "grooves serve did not start"
            time.sleep(0.2)
    yield url
    proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model's server; yields (folder, base url)."""
    root = tmp_path_factory.mktemp("learn")
    (root / "reward.py").write_text(REWARD_PY)
    for url in serve(root, "tiny"):
        yield root, url


def users(url: str, prompts: list, model: str = "tiny", max_tokens: int = 8) -> list:
    """The scripted users: one chat completion per prompt through the official client; the raw replies."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    return [client.chat.completions.with_raw_response.create(model=model, messages=p, max_tokens=max_tokens,
                                                             temperature=0)
            for p in prompts]


def learn_config(root: Path, url: str, name: str, reward: str, lr: float = 0.3, extra: str = "", **learn) -> Path:
    """A tiny-model learn run; ``reward``: a function of reward.py or a dotted path. The gate scores
    held-out tasks greedily with the demo verifier's ``format`` check."""
    function = reward if "." in reward else f"{root / 'reward.py'}:{reward}"
    settings = {"capture": str(root / "capture"), "every_prompts": 4, "max_prompts_per_step": 4, "heldout_size": 24,
                "poll_seconds": 0.2, **learn}
    table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    text = f'''name = "{name}"
seed = 0
[model]
spec = "tiny"
[lora]
rank = 4
alpha = 8
[tasks]
source = "builtin:titles"
[[reward.components]]
function = "{function}"
name = "reward"
[algorithm]
preset = "dapo"
[sampling]
max_completion_length = 8
[optim]
learning_rate = {lr}
[train]
group_size = {GROUP}
[log]
tensorboard = false
[sampler]
url = "{url}"
max_wait = 60
[learn]
{table}[learn.heldout_reward]
components = [{{ function = "grooves.tasks.titles:format_ok", name = "format" }}]
{extra}'''
    path = root / f"{name}.toml"
    path.write_text(text)
    return path


def learn(root: Path, config: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(grooves("learn", str(config), "--runs", str(root / "runs"), *args), capture_output=True,
                          text=True, timeout=timeout, env={**ENV, "LEARN_SCORE_LOG": str(root / "scores.log")})


def ledger(root: Path, name: str, query: str) -> list:
    with sqlite3.connect(root / "runs" / name / "learn.sqlite") as db:
        return db.execute(query).fetchall()


def served_by(reply) -> str:
    return reply.headers["x-grooves-checkpoint"]


def test_capture_store_keeps_its_retention_and_its_size(tmp_path):
    store = CaptureStore(tmp_path / "c", max_bytes=64 << 10, retention_s=150)
    for created in (0.0, 100.0, 200.0):
        store.record("m", "m", [{"role": "user", "content": "hi"}], None, [1, 2], [], now=created)
    assert store.prune(now=250.0) == 1  # only the row made at 0 is older than 250 - 150
    assert [row.id for row in store.after(0)] == [2, 3]
    big = [{"role": "user", "content": "x" * 4000}]
    for _ in range(40):  # 160 kB of prompts into a 64 kB store
        store.record("m", "m", big, None, [1], [], now=300.0)
    store.prune(now=300.0)
    assert store.used_bytes() <= 64 << 10
    ids = [row.id for row in store.after(0)]
    assert ids == list(range(ids[0], 44)) and ids[0] > 4  # the oldest went; ids never reused
    assert (tmp_path / "c").stat().st_mode & 0o077 == 0  # user data: the owner's alone


@pytest.fixture(scope="module")
def trained(served):
    """The scripted users' traffic, and a learn run "e2e" of two steps on it; (root, url, prompts, replies, run)."""
    root, url = served
    prompts = [t["prompt"] for t in title_tasks("train")[:8]]
    replies = users(url, prompts)
    config = learn_config(root, url, "e2e", "grooves.tasks.titles:format_ok")
    done = learn(root, config, "--max-steps", "2")
    assert done.returncode == 0, done.stderr
    return root, url, prompts, replies, done


def test_learn_moves_the_alias_only_to_a_better_checkpoint(trained):
    root, url, prompts, replies, done = trained
    rows = CaptureStore(root / "capture", readonly=True).after(0)
    assert [r.messages for r in rows[:8]] == prompts
    assert [r.choices[0]["text"] for r in rows[:8]] == [r.parse().choices[0].message.content for r in replies]
    assert "Write a title" not in (root / "serve.log").read_text()  # prompts go to the capture store only

    gates = ledger(root, "e2e", "SELECT step, decision, before, after FROM gates ORDER BY step")
    assert [g[:2] for g in gates] == [(1, "in"), (2, "in")], done.stderr
    start = json.loads(ledger(root, "e2e", "SELECT heldout FROM alias ORDER BY id")[0][0])
    assert gates[-1][3] > sum(start) / len(start)  # the alias now serves a checkpoint the verifier prefers
    assert [served_by(r) for r in users(url, prompts[:2], model="prod")] == ["e2e@2", "e2e@2"]
    metrics = [json.loads(line) for line in (root / "runs" / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert [m["learn/gated_in"] for m in metrics if "learn/gated_in" in m] == [1.0, 1.0]

    config = root / "e2e.toml"
    back = learn(root, config, "--rollback")
    assert back.returncode == 0 and "e2e@2 -> e2e@1" in back.stdout, back.stderr
    assert served_by(users(url, prompts[:1], model="prod")[0]) == "e2e@1"
    assert httpx.post(url + "/adapters", json={"name": "prod", "checkpoint": "e2e@2"}).status_code == 200
    assert served_by(users(url, prompts[:1], model="prod")[0]) == "e2e@2"


def test_the_gate_refuses_a_planted_regression(trained):
    """The run's reward is swapped for a planted one that pays ten times more, and most for blank
    lines: the reward_spike detector fires, so the candidate is kept aside and prod stays."""
    root, url, prompts, _, _ = trained
    users(url, [title_tasks("heldout")[0]["prompt"]])  # a held-out task's prompt: never trained on
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    openai.OpenAI(base_url=url, api_key="none").chat.completions.create(model="tiny", messages=prompts[0],
                                                                         tools=[tool], max_tokens=4)
    users(url, [t["prompt"] for t in title_tasks("train")[8:10]])
    spike = "[monitors.reward_spike]\nmin_history = 2\n"  # the run has two steps of history
    config = learn_config(root, url, "e2e", "planted_hack", extra=spike, every_prompts=8, max_prompts_per_step=8)
    done = learn(root, config, "--max-steps", "3")
    assert done.returncode == 0, done.stderr
    taken = ledger(root, "e2e", "SELECT capture_id, used FROM prompts WHERE step = 3 ORDER BY capture_id")
    assert taken == [(9, 1), (10, 1), (11, 1), (12, 1), (13, 0), (14, 0), (15, 1), (16, 1)]  # 13 held out, 14 tools
    (decision, reason), = ledger(root, "e2e", "SELECT decision, reason FROM gates WHERE step = 3")
    assert decision == "out" and reason.startswith("alert reward_spike"), reason
    assert "kept aside" in done.stderr
    assert 3 not in {r[0] for r in ledger(root, "e2e", "SELECT step FROM alias")}
    assert served_by(users(url, prompts[:1], model="prod")[0]) == "e2e@2"
    metrics = [json.loads(line) for line in (root / "runs" / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert [m["learn/gated_out"] for m in metrics if "learn/gated_out" in m] == [0.0, 0.0, 1.0]


def test_a_killed_learner_resumes_without_scoring_a_prompt_twice(served):
    root, url = served
    log = root / "scores.log"
    log.unlink(missing_ok=True)
    config = learn_config(root, url, "resume", "counted")
    have = len(CaptureStore(root / "capture", readonly=True).after(0))
    users(url, [t["prompt"] for t in title_tasks("train")[:max(0, 12 - have)]])  # when run alone
    proc = subprocess.Popen(grooves("learn", str(config), "--runs", str(root / "runs"), "--max-steps", "3"),
                            stderr=subprocess.DEVNULL, env={**ENV, "LEARN_SCORE_LOG": str(log)})
    db = root / "runs" / "resume" / "learn.sqlite"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:  # kill once step 2 is scored, before its gate
        try:
            if db.exists() and ledger(root, "resume", "SELECT COUNT(*) FROM pending WHERE step = 2")[0][0]:
                break
        except sqlite3.OperationalError:  # the ledger's tables are not made yet
            pass
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert ledger(root, "resume", "SELECT step FROM gates") == [(1,)]  # killed before step 2 was trained
    done = learn(root, config, "--max-steps", "3")
    assert done.returncode == 0, done.stderr
    assert "step 2's 4 groups were scored before the stop; training on them (not scoring again)" in done.stderr
    assert [r[0] for r in ledger(root, "resume", "SELECT step FROM gates ORDER BY step")] == [1, 2, 3]
    scored = log.read_text().split()  # one line per sample scored, naming its captured prompt
    assert {int(i) for i in scored} == set(range(1, 13))  # the first 12 captured prompts, in 3 steps
    assert all(scored.count(i) == GROUP for i in set(scored)), scored  # each scored once: its G samples
    with sqlite3.connect(root / "runs" / "resume" / "run.sqlite") as run:
        assert run.execute("SELECT step, COUNT(*) FROM trajectories GROUP BY step").fetchall() == \
            [(1, 4 * GROUP), (2, 4 * GROUP), (3, 4 * GROUP)]
