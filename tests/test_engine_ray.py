"""``[sampler]`` with ``[ray]``: Ray rollout workers sample through two live ``grooves serve`` engines
(several engines, one trainer). A real local Ray cluster (127.0.0.1, 2 CPUs) and two server
subprocesses with the tiny model; the trainer publishes each version to both engines as ``RUN@STEP``."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from grooves.runs.store import RunStore
from grooves.training import load_config, run_config
from helpers import tiny_config
from test_engine_sampler import free_port, start_server, stop_server
from test_ray import cluster  # noqa: F401 - the module's local Ray cluster, the same fixture

ray = pytest.importorskip("ray", reason="the ray extra (make test installs it)")


def test_ray_workers_sample_through_two_engines_and_record_each_version(cluster, tmp_path):
    shared = tmp_path / "shared-adapters"
    folders = [tmp_path / name for name in ("a", "b")]
    for folder in folders:
        folder.mkdir()
    ports = [free_port() for _ in folders]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda fp: start_server(fp[0], fp[1], "--lora-root", str(shared)),
                              zip(folders, ports)))
    urls = [f"http://127.0.0.1:{port}/v1" for port in ports]
    try:
        (tmp_path / "train").mkdir()
        path = tiny_config(tmp_path / "train", steps=2)
        text = path.read_text().replace("seed = 3\n", "seed = 0\n", 1)  # the servers' tiny model is seed 0's
        text = text.replace('preset = "dapo"\nmax_sampling_rounds = 2', 'preset = "grpo"')  # one round a step
        text = text.replace("val_size = 4", "val_size = 1")  # the driver samples held-out tasks too: keep it short
        path.write_text(text + f"\n[sampler]\nurl = {json.dumps(urls)}\nadapters = {json.dumps(str(shared))}\n"
                               "\n[ray]\nworkers = 2\ncpus_per_worker = 0.5\n")
        run = run_config(load_config(path), runs=tmp_path / "runs", progress=False)
        assert run.step == 2 and run.halted_by is None
        assert [m.get("rollout/workers_replaced") for m in run.metrics if m["step"]] == [0.0, 0.0]
        assert all(m["train/is_correction"] == 1.0 and m["rollout/prefix_breaks"] == 0
                   for m in run.metrics if m["step"])
        store = RunStore(run.dir)
        try:
            for step in (1, 2):
                trajectories = [t for _, t in store.read_trajectories(step, "train")]
                assert len(trajectories) == 2 * 4  # 2 tasks x 4 samples a step
                assert {t.metadata["sampler_model"] for t in trajectories} == {f"tiny-run@{step - 1}"}
                assert {t.policy_version for t in trajectories} == {step - 1}
        finally:
            store.close()
        for url in urls:
            names = {m["id"] for m in httpx.get(url + "/models").json()["data"]}
            assert {"tiny-run@0", "tiny-run@1", "tiny-run@2"} <= names
    finally:
        logs = []
        for proc in procs:
            stop_server(proc)
            logs.append(proc.stderr.read())
    for log in logs:  # beyond the trainer's one-token probe of each version, both engines sampled rollouts
        for version in (0, 1):
            sampled = re.findall(rf"POST /v1/completions model=tiny-run@{version} .*completion_tokens=(\d+)", log)
            assert len(sampled) > 1 and sum(map(int, sampled)) > 1, log[-2000:]
