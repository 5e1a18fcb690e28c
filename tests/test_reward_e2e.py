"""Judges against `grooves serve` with the bundled model (real HTTP, every reply must parse),
and a short training run whose reward mixes a verifier, a judge, a reward model and guards."""

import csv
import json
import math
import sqlite3
from pathlib import Path

import pytest

from grooves.rewards import Endpoint, GroupJudge, PointwiseJudge, Reward, supported_by_source
from grooves.training import load_config, run_config
from grooves.types import Group, Trajectory

BUNDLED = "bundled:smollm2-135m-instruct"
RUBRIC = "A good title is short, says what the text is about, and claims nothing the text does not say."
HN = Path(__file__).resolve().parents[2] / "shared" / "data" / "hn" / "hacker_news.csv"
TEXT = "The city council voted 7 to 2 on Tuesday to extend the Riverside tram line by 4 km."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judge_url():
    """The bundled base model behind grooves serve in this process: the frozen judge (no adapter).

    It is the server a config's ``base_url = "local"`` starts, so the training test below
    reuses it instead of loading a second copy.
    """
    from grooves.rewards.config import EndpointConfig, endpoint_url
    from grooves.serve.local import local_url

    return endpoint_url(EndpointConfig(base_url="local", model=BUNDLED), local_url)


def endpoint(url):
    # Generous timeout: on a 2-core CPU a batch of judge replies takes tens of seconds.
    return Endpoint(url, BUNDLED, api_key_env=None, timeout=600, max_retries=1, max_tokens=96)


def group_of(*completions):
    return Group(task={"id": "t", "text": TEXT}, trajectories=[
        Trajectory(messages=[{"role": "user", "content": f"Write a title for: {TEXT}"},
                             {"role": "assistant", "content": c}],
                   prompt_ids=[1], completion_ids=[2], completion_mask=[1], logprobs=[0.0]) for c in completions])


def test_every_judge_kind_parses_the_bundled_models_replies(judge_url):
    ep = endpoint(judge_url)
    reward = Reward([PointwiseJudge("quality", RUBRIC, ep, max_reason_chars=48),
                     GroupJudge("relative", RUBRIC, ep, max_reason_chars=24),
                     supported_by_source(ep, source="text", max_reason_chars=48)])
    group = group_of("Council extends Riverside tram line", "Google lays off 75%, effective immediately", "tram")
    report = reward.score([group])
    assert report.errors == {}, report.first_error
    for name in ("quality", "relative", "supported"):
        assert report.counters[name]["unparseable"] == 0 and report.counters[name]["failures"] == 0
        for t in group.trajectories:
            value = t.components[name]
            assert 0.0 <= value <= 1.0 and t.metadata["reasons"][name]
    assert report.counters["relative"]["calls"] == 1  # the whole group in one request
    assert {t.components["supported"] for t in group.trajectories} <= {0.0, 1.0}


def test_training_with_a_verifier_a_judge_a_reward_model_and_guards(judge_url, tmp_path):
    from grooves.serve.local import LOCAL_SERVERS

    from grooves.rewards.models import train_reward_model

    with open(HN, newline="") as handle:
        rows = [r for _, r in zip(range(300), csv.DictReader(handle))]
    rm = train_reward_model([r["title"] for r in rows], [float(r["num_points"]) for r in rows],
                            backbone=BUNDLED, transform="log1p", seed=0)
    rm.save(tmp_path / "rm")
    config = tmp_path / "judged.toml"
    config.write_text(f'''
name = "judged"
steps = 2
[model]
spec = "{BUNDLED}"
[lora]
rank = 4
[tasks]
source = "builtin:titles"
[reward]
max_concurrency = 8
[reward.endpoints.frozen]
base_url = "local"
model = "{BUNDLED}"
api_key_env = "GROOVES_TEST_UNSET_KEY"
timeout = 600
max_retries = 1
max_tokens = 96
[[reward.components]]
function = "grooves.tasks.titles:format_ok"
name = "format"
[[reward.components]]
kind = "judge"
name = "quality"
endpoint = "frozen"
rubric = "{RUBRIC}"
max_reason_chars = 48
[[reward.components]]
kind = "reward_model"
name = "upvotes"
path = "{tmp_path / "rm"}"
weight = 0.1
[[reward.components]]
kind = "guard"
guard = "supported_by_source"
endpoint = "frozen"
source = "text"
max_reason_chars = 48
[[reward.components]]
kind = "guard"
guard = "injection"
[sampling]
max_completion_length = 12
[train]
group_size = 4
[log]
val_size = 2
val_every = 2
tensorboard = false
kl_every = 0
''')
    servers = dict(LOCAL_SERVERS)  # other tests of the session may have served other models
    run = run_config(load_config(config), runs=tmp_path / "runs", progress=False)
    assert servers[BUNDLED] == judge_url and LOCAL_SERVERS == servers  # "local" reused the one server
    assert run.step == 2
    for row in run.metrics[1:]:
        for name in ("format", "quality", "upvotes", "supported", "no_judge_talk"):
            assert f"reward/{name}" in row and not math.isnan(row[f"reward/{name}"]), name
            assert row[f"reward/{name}/error_rate"] == 0.0, name
        assert row["reward/quality/calls"] >= 4 and row["reward/quality/unparseable_rate"] == 0.0
        assert 0.0 <= row["reward/supported/veto_rate"] <= 1.0 and "reward/vetoed" in row
    assert "val/reward/quality" in run.metrics[0] and "val/reward/upvotes" in run.metrics[-1]
    with sqlite3.connect(run.dir / "run.sqlite") as db:
        data = [json.loads(d) for (d,) in db.execute("SELECT data FROM trajectories WHERE split = 'train'")]
    assert data and all(set(d["metadata"]["reasons"]) >= {"quality", "supported"} for d in data)
    for d in data:  # a vetoed trajectory's total is the floor, whatever the judge said
        if d["metadata"].get("vetoes"):
            assert d["reward"] == 0.0
