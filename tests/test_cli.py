"""The grooves command: config errors exit 2 with the field's path; train, sample and runs work."""

import sqlite3

import pytest
from typer.testing import CliRunner

from grooves.cli import app
from helpers import tiny_config

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_help_explains_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("train", "sample", "runs", "demo"):
        assert command in result.output


def test_missing_config_file_exits_2_with_its_path(tmp_path):
    result = invoke("train", tmp_path / "nope.toml")
    assert result.exit_code == 2 and "nope.toml" in result.output and "does not exist" in result.output


@pytest.mark.parametrize("edit, expected", [
    (("[optim]", "[optim]\nlerning_rate = 1"), "optim.lerning_rate: Extra inputs are not permitted"),
    (("learning_rate = 0.01", "learning_rate = -1"), "optim.learning_rate: Input should be greater than 0"),
    (('preset = "dapo"', 'preset = "dappo"'), "unknown preset 'dappo'; allowed: grpo, dr_grpo, dapo"),
    (("group_size = 4", "group_size = 1"), "train.group_size: Input should be greater than or equal to 2"),
    (("rank = 4", "rank = 0"), "lora.rank: Input should be greater than or equal to 1"),
    (("steps = 4", "steps = 4\ncolour = 'red'"), "colour: Extra inputs are not permitted"),
    (('name = "tiny-run"', 'name = "../escape"'), "name: Value error, must be a plain folder name"),
    (('preset = "dapo"', 'preset = "dapo"\nreference = "adapter"'), "algorithm.reference = 'adapter' keeps RL near"),
    (("group_size = 4", 'group_size = 4\nbalance_by = "kind"'), "train.balance_by: 18 of 18 training tasks have no column 'kind' to balance by"),
])
def test_invalid_config_exits_2_with_path_and_allowed(tmp_path, edit, expected):
    path = tiny_config(tmp_path)
    path.write_text(path.read_text().replace(*edit, 1))
    result = invoke("train", path)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())


def test_bad_toml_and_bad_steps_exit_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("name = [unclosed")
    result = invoke("train", path)
    assert result.exit_code == 2 and "not valid TOML" in result.output
    result = invoke("train", tiny_config(tmp_path), "--steps", "0")
    assert result.exit_code == 2 and "--steps" in result.output


def test_bad_model_and_reward_exit_2(tmp_path):
    path = tiny_config(tmp_path)
    path.write_text(path.read_text().replace('spec = "tiny"', 'spec = "./no/model"'))
    result = invoke("train", path)
    assert result.exit_code == 2 and "does not exist" in result.output
    path = tiny_config(tmp_path)
    path.write_text(path.read_text().replace(":vowels", ":nothing_here", 1))
    result = invoke("train", path)
    assert result.exit_code == 2
    assert "reward.components.0.function:" in result.output and "has no attribute 'nothing_here'" in result.output


def test_train_runs_and_sample_resume_list(tmp_path):
    runs = tmp_path / "runs"
    path = tiny_config(tmp_path, steps=2)
    result = invoke("train", path, "--runs", runs, "--quiet")
    assert result.exit_code == 0, result.output
    run_dir = runs / "tiny-run"
    for name in ("config.toml", "metrics.jsonl", "run.sqlite", "checkpoints/step-0002/adapter/adapter_config.json",
                 "checkpoints/step-0002/trainer.pt", "checkpoints/step-0002/rng.pt", "checkpoints/step-0002/state.json"):
        assert (run_dir / name).exists(), name
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        counts = dict(db.execute("SELECT split, COUNT(*) FROM trajectories GROUP BY split").fetchall())
        components = db.execute("SELECT components FROM trajectories LIMIT 1").fetchone()[0]
    assert counts["train"] >= 2 * 2 * 4 and counts["val"] == 4 * 2  # val at steps 0 and 2
    assert '"vowels"' in components and '"short"' in components

    again = invoke("train", path, "--runs", runs, "--quiet")
    assert again.exit_code == 2 and "--resume" in again.output  # nothing is overwritten
    more = invoke("train", path, "--runs", runs, "--resume", "--steps", "3", "--quiet")
    assert more.exit_code == 0, more.output

    listing = invoke("runs", "--runs", runs)
    assert "tiny-run" in listing.output and "tiny-run@3" in listing.output
    sampled = invoke("sample", "tiny-run@latest", "hello", "--runs", runs, "--max-tokens", "5", "-n", "2")
    assert sampled.exit_code == 0 and sampled.output.count("tokens)") == 2
    missing = invoke("sample", "tiny-run@99", "hello", "--runs", runs)
    assert missing.exit_code == 2 and "has no checkpoint at step 99; it has: 2, 3" in missing.output
    unknown = invoke("sample", "ghost@latest", "hello", "--runs", runs)
    assert unknown.exit_code == 2 and "no run 'ghost'" in unknown.output


def test_sample_base_model(tmp_path):
    result = invoke("sample", "tiny", "hi", "--temperature", "0", "--max-tokens", "4")
    assert result.exit_code == 0


def test_long_prompts_are_skipped_and_counted(tmp_path):
    from grooves.training import load_config, run_config

    from grooves.policy import Policy
    from grooves.tasks import load_tasks, render_prompt

    config = load_config(tiny_config(tmp_path, steps=2))
    policy = Policy.load("tiny")
    lengths = sorted(len(policy.chat_ids(render_prompt(t, config.tasks.prompt_template)))
                     for t in load_tasks(config.tasks.source))
    config.sampling.max_prompt_length = lengths[len(lengths) // 2]  # about half of the prompts fit
    config.log.tensorboard = True
    run = run_config(config, out=tmp_path / "run", progress=False)
    assert run.metrics[-1]["train/prompts_skipped"] > 0
    groups_trained = [m for m in run.metrics[1:] if m.get("train/skipped") != 1.0]
    assert groups_trained  # training went on with the tasks that fit
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))

    config.sampling.max_prompt_length = 3  # nothing fits: a clear error, not an endless loop
    with pytest.raises(Exception, match="every task's prompt is longer than sampling.max_prompt_length=3"):
        run_config(config, out=tmp_path / "run2", progress=False)


def test_a_failing_reward_is_reported_once_and_never_zeroed(tmp_path):
    import json
    import math

    from grooves.training import load_config, run_config

    path = tiny_config(tmp_path, steps=2)
    (tmp_path / "my_reward.py").write_text((tmp_path / "my_reward.py").read_text() + '''
def picky(completion):
    if len(completion) % 2:
        raise RuntimeError("judge unavailable")
    return 1.0
''')
    path.write_text(path.read_text().replace(":short", ":picky"))
    run = run_config(load_config(path), out=tmp_path / "run", progress=False)
    step = run.metrics[1]
    assert 0 < step["reward/picky/error_rate"] < 1 and step["reward/picky"] == 1.0  # failures are not zeros
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        alerts = db.execute("SELECT detector, evidence FROM alerts").fetchall()
        rewards = [r for (r,) in db.execute("SELECT reward FROM trajectories WHERE split = 'train'")]
    assert [a[0] for a in alerts] == ["reward_error"]  # once, not once per step
    assert json.loads(alerts[0][1])["first_error"] == "RuntimeError: judge unavailable"
    assert None in rewards and all(r is None or math.isfinite(r) for r in rewards)


def test_config_reference_doc_is_current():
    from pathlib import Path

    from grooves.training.config import config_reference

    doc = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    assert doc.read_text() == config_reference() + "\n", "run: python scripts/gen_config_docs.py"


def test_wandb_logging_offline(tmp_path, monkeypatch):
    """With log.wandb_project set, metrics also reach W&B (offline mode: a local run folder, no network)."""
    pytest.importorskip("wandb")
    from grooves.training import load_config, run_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = load_config(tiny_config(tmp_path, steps=1))
    config.log.wandb_project = "grooves-test"
    run_config(config, out=tmp_path / "run", progress=False)
    records = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1
    data = records[0].read_bytes()  # protobuf records: metric names are stored as plain strings
    assert b"reward/total" in data and b"val/reward/total" in data and b"train/grad_norm" in data
