"""The async pipeline's sampler in a child process (train.async_sampler = "process"), tiny model."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
import torch

from grooves.policy.lora_batch import lora_layers
from grooves.rewards.compose import RewardReport
from grooves.tasks.sources import TaskSourceError
from grooves.training import run_config
from grooves.training.build import load_policy, task_sets
from grooves.training.pipeline.local import LocalRollouts, adapter_state
from grooves.training.pipeline.process import ProcessRollouts
from test_async import async_config, rows, versions_in_store


@pytest.fixture
def setup(tmp_path):
    """A config, the trainer's policy with its adapter moved off its start, and the task sets."""
    config = async_config(tmp_path, k=1, async_sampler="process")
    policy = load_policy(config)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return config, policy, task_sets(config)


def sample(rollouts, sets, step=1):
    drawn = [(sets[0], task) for task in sets[0].train[:2]]
    reports = {s.name: RewardReport() for s in sets}
    groups = rollouts.rollout(drawn, step, 0, reports)
    return [[t.completion_ids for t in g.trajectories] for g in groups], groups, reports


def test_the_child_samples_what_this_process_would_from_the_same_weights_and_seed(setup):
    """The weights sent after an update are the ones the child samples from: its completions equal
    this process's from the same adapter with the generator the child seeds for that step."""
    config, policy, sets = setup
    rollouts = ProcessRollouts(config, policy, sets, 4, sampling(config))
    child = rollouts._process
    try:
        rollouts.apply(1, adapter_state(policy))
        theirs, groups, reports = sample(rollouts, sets)
    finally:
        rollouts.close()
    assert child.exitcode == 0  # stopped, not killed, and not aborted on its way out
    generator = torch.Generator().manual_seed(random.Random(f"{config.seed}:1:0").getrandbits(63))
    local = LocalRollouts(policy, sets, 4, sampling(config), generator)
    local.apply(1, None)
    ours, _, _ = sample(local, sets)
    assert theirs == ours and any(any(ids) for g in ours for ids in g)
    assert {t.policy_version for g in groups for t in g.trajectories} == {1}
    assert all(t.reward == t.reward for g in groups for t in g.trajectories)  # scored in the child
    assert reports[sets[0].name].calls  # and its counts came back


def test_a_killed_child_is_started_again_with_the_newest_weights(setup):
    config, policy, sets = setup
    rollouts = ProcessRollouts(config, policy, sets, 4, sampling(config))
    try:
        rollouts.apply(1, adapter_state(policy))
        before, _, _ = sample(rollouts, sets)
        os.kill(rollouts._process.pid, signal.SIGKILL)
        rollouts._process.join()
        after, _, _ = sample(rollouts, sets)
        assert rollouts.replaced == 1
        assert after == before  # same weights, same seed for the step: the same completions
    finally:
        rollouts.close()
    assert rollouts._process is None


def test_an_error_in_the_child_reaches_the_trainer_with_its_traceback(setup):
    config, policy, sets = setup
    rollouts = ProcessRollouts(config, policy, sets, 4, sampling(config))
    try:
        reports = {s.name: RewardReport() for s in sets}
        with pytest.raises(TaskSourceError) as raised:
            rollouts.rollout([(sets[0], {"id": "broken"})], 1, 0, reports)  # no "text" for the template
        assert "in the sampler process" in "".join(raised.value.__notes__)
        ok, _, _ = sample(rollouts, sets)  # the child goes on serving
        assert ok and rollouts.replaced == 0
    finally:
        rollouts.close()


def test_an_async_run_with_a_sampler_process_trains_within_k(tmp_path):
    config = async_config(tmp_path, steps=3, k=1, async_sampler="process")
    run = run_config(config, out=tmp_path / "proc", progress=False)
    by_step = rows(run)
    assert run.step == 3
    assert by_step[1]["rollout/policy_version"] == 0
    for step in (2, 3):
        assert by_step[step]["rollout/staleness/max"] <= 1
        assert by_step[step]["rollout/dropped_stale"] == 0
        assert by_step[step]["rollout/workers_replaced"] == 0
    assert {v for _, v in versions_in_store(tmp_path / "proc")} <= {0, 1, 2}


def sampling(config):
    from grooves.policy.sampler import Sampling

    s = config.sampling
    return Sampling(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_completion_length)


def test_a_sampler_process_with_a_backend_is_a_config_error():
    from grooves.training.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="async_sampler = 'process'"):
        parse_config({"backend": {"url": "http://127.0.0.1:1"},
                      "train": {"max_off_policy_steps": 1, "async_sampler": "process"}})


def test_python_tasks_with_a_sampler_process_are_refused_before_training(tmp_path):
    import grooves as gr

    policy = gr.Policy.load("tiny", lora=gr.LoRA(rank=4), seed=0)
    with pytest.raises(ValueError, match="sampler process.*tasks is a list.*reward cannot be imported"):
        gr.train(policy, tasks=[{"prompt": "say 1"}, {"prompt": "say 2"}], reward=lambda completion: 1.0,
                 steps=1, group_size=2, runs=tmp_path, progress=False,
                 config={"train": {"max_off_policy_steps": 1, "async_sampler": "process"}})
    assert not any(tmp_path.iterdir())  # refused before a run folder was made


def test_the_cli_has_not_loaded_torch_when_a_command_starts():
    """The CLI must not have imported torch before a command runs (OpenMP reads the environment's
    settings when torch loads, and a command's --help stays quick)."""
    import subprocess
    import sys

    code = "import sys, grooves.cli; assert 'torch' not in sys.modules, 'grooves.cli imported torch'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_sampler_process_on_spinning_openmp_threads_is_warned_about(setup, monkeypatch):
    """Under ACTIVE the trainer's idle OpenMP threads spin for ever on the sampler's core; unset (they
    spin briefly, then sleep: the trainer gives way while the child generates) and PASSIVE are fine."""
    import warnings

    config, policy, sets = setup
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the trainer's intra-op threads are what spin
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "active")
        with pytest.warns(UserWarning, match="OMP_WAIT_POLICY=ACTIVE"):
            ProcessRollouts(config, policy, sets, 4, sampling(config), threads=1).close()
        for policy_name in ("passive", None):
            if policy_name is None:
                monkeypatch.delenv("OMP_WAIT_POLICY")
            else:
                monkeypatch.setenv("OMP_WAIT_POLICY", policy_name)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ProcessRollouts(config, policy, sets, 4, sampling(config), threads=1).close()
    finally:
        torch.set_num_threads(threads)


def test_the_trainers_threads_give_way_while_the_child_generates_and_come_back_after(setup):
    """While a batch is sampled in the child, this process's forward runs on the threads the child
    leaves; once the batch is back, on all of them again."""
    config, policy, sets = setup
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    rollouts = ProcessRollouts(config, policy, sets, 4, sampling(config), threads=1)
    seen = []
    hook = policy.model.get_output_embeddings().register_forward_hook(
        lambda *_: seen.append((rollouts.elastic.neighbour.is_set(), torch.get_num_threads())))
    ids = torch.tensor([[1, 2, 3, 4]])
    try:
        rollouts.apply(1, adapter_state(policy))
        done = threading.Event()
        sampler = threading.Thread(target=lambda: (sample(rollouts, sets), done.set()))
        sampler.start()
        while not done.is_set():
            with torch.no_grad():
                policy.model(input_ids=ids)
        sampler.join()
        policy.model(input_ids=ids).logits.sum().backward()
    finally:
        hook.remove()
        rollouts.close()
        threads_after = torch.get_num_threads()
        torch.set_num_threads(before)
    assert {threads for busy, threads in seen if busy} == {1}
    assert seen[-1] == (False, 2)
    assert threads_after == 2
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for _, _, layer in lora_layers(policy.model))


def test_elastic_threads_switch_inside_the_backward_pass(setup):
    """The count follows the neighbour inside a backward too: it runs on the thread that called it."""
    from grooves.training.pipeline.threads import ElasticThreads

    _, policy, _ = setup
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    elastic = ElasticThreads(policy.model, idle=2, busy=1)
    first = next(layer for _, _, layer in lora_layers(policy.model))
    in_backward = []
    first.lora_A.default.weight.register_hook(lambda grad: in_backward.append(torch.get_num_threads()))
    try:
        with elastic.working():
            loss = policy.model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum()
            assert torch.get_num_threads() == 1
        loss.backward()  # the neighbour is done: the backward fits the count back
        assert in_backward == [2]
    finally:
        elastic.close()
        threads_after = torch.get_num_threads()
        torch.set_num_threads(before)
    assert elastic.switches == 2 and threads_after == 2
