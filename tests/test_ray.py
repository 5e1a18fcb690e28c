"""Rollout workers on a real local Ray cluster (127.0.0.1, 2 CPUs: 2 workers of 1 CPU each),
started once for the module. The tiny random-weight model keeps every run short."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from grooves.policy.sampler import Sampling
from grooves.rewards.compose import RewardReport
from grooves.training import load_config, run_config
from grooves.training.build import load_policy, task_sets
from grooves.training.config import ConfigError
from grooves.training.placement import RayConfig
from grooves.training.pipeline.ray_workers import RayRollouts, import_ray
from grooves.runs.store import RunStore
from helpers import tiny_config

ray = pytest.importorskip("ray", reason="the ray extra (make test installs it)")


@pytest.fixture(scope="module")
def cluster():
    for attempt in range(3):  # on a loaded machine Ray's raylet can miss its 30 s start-up window
        try:
            ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                     logging_level="warning")
            break
        except Exception as error:  # noqa: BLE001 - Ray raises a plain Exception here
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(error):
                raise
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def ray_config(tmp_path, steps: int, k: int = 0):
    path = tiny_config(tmp_path, steps=steps)
    path.write_text(path.read_text().replace('preset = "dapo"\nmax_sampling_rounds = 2', 'preset = "grpo"'))
    config = load_config(path)
    config.train.max_off_policy_steps = k
    config.ray = RayConfig(workers=2, cpus_per_worker=1)
    return config


def adapter(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step:04d}" / "adapter" / "adapter_model.safetensors"))


def train_rows(run_dir):
    store = RunStore(run_dir)
    try:
        found = store.db.execute("SELECT step, task_id, data FROM trajectories WHERE split = 'train' "
                                 "ORDER BY id").fetchall()
    finally:
        store.close()
    return [(step, task, json.loads(data)) for step, task, data in found]


def kill_once_at(step_to_kill: int, monkeypatch):
    """Kill worker 0 with ``ray.kill`` after the tasks of that step were sent to the workers."""
    original = RayRollouts.rollout
    killed = []

    def rollout(self, drawn, step, round_, reports):
        if step == step_to_kill and not killed:
            def kill(pool):
                killed.append(pool.workers[0])
                ray.kill(pool.workers[0])
            self.after_submit = kill
        try:
            return original(self, drawn, step, round_, reports)
        finally:
            self.after_submit = None

    monkeypatch.setattr(RayRollouts, "rollout", rollout)
    return killed


def test_a_ray_run_trains_survives_a_killed_worker_and_resumes(cluster, tmp_path, monkeypatch):
    """Straight 3 steps; then 2 steps with a worker killed mid-step 2, resumed to step 3. Each task's
    seed depends on (step, position), not on the worker, so the killed worker's tasks re-run to
    the same samples: both runs record the same trajectories and end on the same adapter."""
    straight = run_config(ray_config(tmp_path, 3), out=tmp_path / "straight", progress=False)
    assert straight.step == 3
    lora_b = {k: v for k, v in adapter(tmp_path / "straight", 3).items() if "lora_B" in k}
    assert any(v.abs().sum() > 0 for v in lora_b.values())  # B starts at zero: the adapter trained

    killed = kill_once_at(2, monkeypatch)
    first = run_config(ray_config(tmp_path, 2), out=tmp_path / "resumed", progress=False)
    assert first.step == 2 and len(killed) == 1
    monkeypatch.undo()
    assert {row["step"]: row.get("rollout/workers_replaced") for row in first.metrics if row["step"]} == {1: 0, 2: 1}
    resumed = run_config(ray_config(tmp_path, 3), out=tmp_path / "resumed", resume=True, progress=False)
    assert [row["step"] for row in resumed.metrics] == [0, 1, 2, 3]

    a, b = train_rows(tmp_path / "straight"), train_rows(tmp_path / "resumed")
    assert [(s, t) for s, t, _ in a] == [(s, t) for s, t, _ in b]
    assert [s for s, _, _ in b].count(2) == 2 * 4  # 2 tasks x 4 samples: none lost, none twice
    assert [d["completion_ids"] for *_, d in a] == [d["completion_ids"] for *_, d in b]
    assert [d["policy_version"] for *_, d in b] == [s - 1 for s, _, _ in b]
    for name, value in adapter(tmp_path / "straight", 3).items():
        assert torch.allclose(value, adapter(tmp_path / "resumed", 3)[name], atol=1e-5), name


def test_a_killed_worker_is_replaced_and_its_tasks_run_once(cluster, tmp_path):
    config = ray_config(tmp_path, 1)
    policy = load_policy(config)
    sets = task_sets(config)
    sampling = Sampling(max_new_tokens=8)
    pool = RayRollouts(config, policy, sets, 3, sampling, config.ray)
    try:
        pool.apply(0, pool.snapshot())
        drawn = [(sets[0], task) for task in sets[0].train[:5]]
        clean = pool.rollout(drawn, 1, 1, {"": RewardReport()})
        reports = {"": RewardReport()}
        pool.after_submit = lambda p: ray.kill(p.workers[1])  # it had tasks 1 and 3
        again = pool.rollout(drawn, 1, 1, reports)
        assert pool.replaced == 1
        assert [g.task["id"] for g in again] == [t["id"] for _, t in drawn]
        assert [len(g.trajectories) for g in again] == [3] * 5
        assert reports[""].calls == {"vowels": 15, "short": 15}  # scored once each
        assert ([t.completion_ids for g in again for t in g.trajectories]
                == [t.completion_ids for g in clean for t in g.trajectories])
        assert {t.policy_version for g in again for t in g.trajectories} == {0}
    finally:
        pool.close()


def test_async_on_ray_stays_within_k(cluster, tmp_path):
    run = run_config(ray_config(tmp_path, 3, k=1), out=tmp_path / "async", progress=False)
    rows = [row for row in run.metrics if row["step"]]
    assert len(rows) == 3
    assert all(row["rollout/staleness/max"] <= 1 and row["rollout/dropped_stale"] == 0 for row in rows)
    assert rows[0]["rollout/policy_version"] == 0


def test_the_cli_joins_a_running_cluster_by_address(cluster, tmp_path):
    """What `ray start --head` + `grooves train CONFIG --ray HOST:PORT` does: a second driver
    connects to the running cluster (here the module's) by its address."""
    path = tiny_config(tmp_path, steps=1)
    log = tmp_path / "cli.log"
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "grooves.cli", "train", str(path), "--out",
                               str(tmp_path / "cli"), "--ray", cluster], stdout=out, stderr=subprocess.STDOUT,
                              timeout=900).returncode
    assert code == 0, log.read_text()[-3000:]
    assert (tmp_path / "cli" / "checkpoints" / "step-0001").is_dir()
    assert "address" in (tmp_path / "cli" / "config.toml").read_text()


def test_too_few_cpus_is_a_config_error(cluster, tmp_path):
    config = ray_config(tmp_path, 1)
    config.ray = RayConfig(workers=3, cpus_per_worker=1)
    with pytest.raises(ConfigError, match=r"ray.workers: 3 workers x 1 CPUs need 3 CPUs; the Ray cluster has 2"):
        run_config(config, out=tmp_path / "big", progress=False)


def test_without_ray_installed_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'grooves\[ray\]'"):
        import_ray()


@pytest.mark.parametrize("argv, address", [(["--ray"], None), (["--ray", "10.0.0.5:6379"], "10.0.0.5:6379"),
                                           (["--ray", "--quiet"], None)])
def test_the_ray_option_sets_the_ray_table(tmp_path, monkeypatch, argv, address):
    """``--ray`` alone: a local instance; ``--ray ADDRESS``: that cluster (no cluster needed to parse)."""
    from typer.testing import CliRunner

    import grooves.training.api as api
    from grooves.cli import app, optional_ray_address

    seen = {}

    def fake_run_config(config, **kwargs):
        seen["ray"], seen["resume_command"] = config.ray, kwargs["resume_command"]
        raise ConfigError("stop here")

    monkeypatch.setattr(api, "run_config", fake_run_config)
    result = CliRunner().invoke(app, optional_ray_address(["train", str(tiny_config(tmp_path)), *argv]))
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["ray"] == RayConfig(address=address)
    assert seen["resume_command"].endswith("--ray" + (f" {address}" if address else ""))
