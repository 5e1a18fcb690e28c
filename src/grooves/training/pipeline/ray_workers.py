"""Rollout workers on Ray (``grooves train CONFIG --ray [ADDRESS]``, the ``[ray]`` table).

Each worker is a Ray actor holding a sampler copy of the policy (the base model loaded as the
config says, plus a LoRA adapter), the run's task sets and their reward components (envs,
judges, verifiers). The driver keeps the trainer, the run folder and the task order: it draws a
step's tasks, sends one task per call to the workers round robin, and gathers the scored groups
in the order the tasks were drawn. After each update only the adapter's weights go to the
workers, once through the object store (``ray.put``), with the version they carry; a worker
stamps every trajectory with the version it sampled from.

The trainer stays in the driver rather than in an actor of its own: the run folder, the SQLite
store and the checkpoints are files the driver writes, and a trainer actor would ship the
adapter and optimizer state back for every checkpoint. On a cluster, start the head (and the
driver) on the machine with the GPU.

With ``[sampler]`` as well (``RayEngineRollouts``) the workers hold no model: each samples
through the inference engines (``EngineWorker``: the tokenizer and chat template, the task sets
and their rewards), starting its round of the engines at its own slot, so W workers spread their
requests over the engines. The driver keeps the trainer and publishes each version as
``EngineRollouts`` does (the adapter written once, ``load_lora_adapter`` as ``RUN@STEP`` on every
engine); what reaches the workers is only the version's name (and folder, to load it again into
an engine that lost it), and every trajectory records the name it sampled.

Each task's sampling seed depends only on (run seed, step, sampling round, position), not on
the worker, so a task re-run after its worker died samples the same completions from the same
weights. A worker that dies (``RayActorError``) is replaced by a fresh actor that loads the
newest weights, and only the calls that did not return are sent again: no group is lost or
counted twice.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from grooves.policy.engine import EngineError, EnginePolicy, EngineSampler
from grooves.policy.policy import Policy
from grooves.policy.sampler import Sampling
from grooves.rewards.compose import RewardReport
from grooves.training.build import load_policy, share_backbones, task_sets
from grooves.training.config import ConfigError, RunConfig
from grooves.training.placement import RayConfig
from grooves.training.gather import rollout_groups
from grooves.training.pipeline.engine import EngineRollouts, Engines
from grooves.training.pipeline.local import adapter_state, load_adapter_state, merge_report
from grooves.types import Group


def import_ray():
    """Ray, imported on first use: it is an optional extra."""
    try:
        import ray
    except ImportError:
        raise ConfigError("ray: Ray is not installed; install it with: pip install 'grooves[ray]'") from None
    return ray


class RolloutWorker:
    """One Ray actor's state: a sampler copy of the policy, the task sets and their rewards."""

    def __init__(self, config: RunConfig, runs: str | None, threads: int, slot: int = 0):
        torch.set_num_threads(max(1, threads))
        self.sets = task_sets(config)
        self.policy = load_policy(config, runs)
        share_backbones(self.sets, self.policy)
        self.version: int | None = None

    def load(self, state: dict[str, torch.Tensor], version: int) -> int:
        load_adapter_state(self.policy, state)
        self.version = version
        return version

    def rollout(self, set_index: int, task: dict, n: int, sampling: Sampling, seed: int) -> tuple:
        task_set = self.sets[set_index]
        generator = torch.Generator(device=self.policy.device).manual_seed(seed)
        groups = rollout_groups(self.policy, [task], [task_set.render(task)], n, sampling, generator,
                                self.version, task_set.env)
        for group in groups:
            group.metadata["task_set"] = task_set.name
        report = RewardReport()
        task_set.reward.score(groups, report)
        return groups, report

    def pid(self) -> int:
        import os

        return os.getpid()


class RayRollouts:
    """The rollouts backend of a Ray run (see ``grooves.training.pipeline.local``)."""

    def __init__(self, config: RunConfig, policy, sets: list, group_size: int, sampling: Sampling,
                 ray_config: RayConfig, runs: str | Path | None = None, worker: type | None = None,
                 args: tuple | None = None):
        """``worker``: the actor class (``RolloutWorker``), made with ``(*args, slot=i)``."""
        ray = self.ray = import_ray()
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            try:
                ray.init(address=ray_config.address, include_dashboard=False, logging_level="warning",
                         log_to_driver=False)
            except ConnectionError as error:
                raise ConfigError(f"ray.address: cannot connect to a Ray cluster at "
                                  f"{ray_config.address!r} ({error})") from None
        need = ray_config.workers * ray_config.cpus_per_worker
        have = ray.cluster_resources().get("CPU", 0)
        if need > have:
            self.close()
            raise ConfigError(f"ray.workers: {ray_config.workers} workers x {ray_config.cpus_per_worker:g} CPUs "
                              f"need {need:g} CPUs; the Ray cluster has {have:g}")
        self.trainer_policy = policy
        self.policy = policy  # the driver's tokenizer measures prompt lengths
        self.sets = sets
        self.group_size = group_size
        self.sampling = sampling
        self.seed = config.seed
        self.actor = ray.remote(num_cpus=ray_config.cpus_per_worker,
                                num_gpus=ray_config.gpus_per_worker)(worker or RolloutWorker)
        threads = max(1, int(ray_config.cpus_per_worker))
        self.args = args if args is not None else (config, None if runs is None else str(runs), threads)
        self.version = 0
        self.state_ref = None  # the newest adapter weights in the object store
        self.workers = [self._spawn(slot) for slot in range(ray_config.workers)]
        self.replaced = 0  # workers replaced so far (rollout/workers_replaced)
        self.after_submit: Callable[[RayRollouts], None] | None = None  # tests kill a worker here

    def _spawn(self, slot: int):
        worker = self.actor.remote(*self.args, slot=slot)
        if self.state_ref is not None:
            worker.load.remote(self.state_ref, self.version)
        return worker

    def snapshot(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.trainer_policy)

    def apply(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Send the adapter's weights to every worker (once into the object store) and wait."""
        self.version, self.state_ref = version, self.ray.put(state)

        def submit(i: int):
            return self.workers[i].load.remote(self.state_ref, version), i, self.workers[i]

        self._gather({i: submit(i) for i in range(len(self.workers))}, submit)

    def rollout(self, drawn: list[tuple], step: int, round_: int, reports: dict[str, RewardReport]) -> list[Group]:
        """Groups for ``drawn`` (task set, task) pairs, one Ray call per task, gathered in order."""
        index = {id(s): i for i, s in enumerate(self.sets)}
        units = [(index[id(s)], t, self._seed(step, round_, j)) for j, (s, t) in enumerate(drawn)]

        def submit(j: int):
            set_index, task, seed = units[j]
            slot = j % len(self.workers)
            worker = self.workers[slot]
            return worker.rollout.remote(set_index, task, self.group_size, self.sampling, seed), slot, worker

        calls = {j: submit(j) for j in range(len(units))}
        if self.after_submit is not None:
            self.after_submit(self)
        results = self._gather(calls, submit)
        groups: list[Group] = []
        for j in range(len(units)):
            made, report = results[j]
            merge_report(reports[self.sets[units[j][0]].name], report)
            groups += made
        return groups

    def _gather(self, calls: dict, resubmit: Callable) -> dict:
        """Results of ``calls`` (key -> (ref, slot, worker)) by key. A call whose worker died goes
        again, to a fresh worker in the same slot; calls that returned are never sent again."""
        errors = self.ray.exceptions
        results, failures = {}, 0
        while calls:
            key, (ref, slot, worker) = next(iter(calls.items()))
            try:
                results[key] = self.ray.get(ref)
                del calls[key]
            except errors.RayActorError as error:
                failures += 1
                if failures > 3 * len(self.workers):
                    raise RuntimeError(f"Ray rollout workers keep dying ({error}); giving up") from None
                if self.workers[slot] is worker:  # the first of its calls to fail: replace it once
                    self.workers[slot] = self._spawn(slot)
                    self.replaced += 1
                calls[key] = resubmit(key)
        return results

    def _seed(self, step: int, round_: int, position: int) -> int:
        return random.Random(f"{self.seed}:{step}:{round_}:{position}").getrandbits(63)

    def close(self) -> None:
        for worker in getattr(self, "workers", []):
            self.ray.kill(worker)
        self.workers = []
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()


class EngineWorker:
    """One Ray actor that samples through the engines: no model, the tokenizer and chat template of
    the run's base (``tokenizer``), the task sets and their rewards. ``slot``: the engine its round
    of the engines starts at."""

    def __init__(self, config: RunConfig, tokenizer, threads: int, slot: int = 0):
        torch.set_num_threads(max(1, threads))
        self.sets = task_sets(config)
        self.engines = Engines(config.sampler)
        count = len(self.engines.clients)
        clients = [self.engines.clients[(slot + i) % count] for i in range(count)]
        self.order = [(slot + i) % count for i in range(count)]  # the sampler's engine i is engines[order[i]]
        self.sampler = EngineSampler(Policy(None, tokenizer, config.model.spec), clients, "",
                                     max_concurrency=config.sampler.max_concurrency,
                                     max_wait=config.sampler.max_wait, on_missing=self.reload)
        self.policy = EnginePolicy(self.sampler.policy, self.sampler)
        self.folders: dict[str, str] = {}
        self.version: int | None = None

    def load(self, state: dict[str, str], version: int) -> int:
        """Sample the version ``state["name"]`` from now on (``state["folder"]``: its adapter)."""
        self.folders[state["name"]] = state["folder"]
        self.sampler.model = state["name"]
        self.version = version
        return version

    def reload(self, name: str, engine: int) -> None:
        if name not in self.folders:
            raise EngineError(f"sampler.url: the server has no model {name!r}, and it is not a version this run "
                              f"published")
        self.engines.load(self.order[engine], name, Path(self.folders[name]))

    def rollout(self, set_index: int, task: dict, n: int, sampling: Sampling, seed: int) -> tuple:
        task_set = self.sets[set_index]
        groups = rollout_groups(self.policy, [task], [task_set.render(task)], n, sampling,
                                torch.Generator().manual_seed(seed), self.version, task_set.env)
        for group in groups:
            group.metadata["task_set"] = task_set.name
            for trajectory in group.trajectories:
                trajectory.metadata["sampler_model"] = self.sampler.model
        report = RewardReport()
        task_set.reward.score(groups, report)
        return groups, report


class RayEngineRollouts(EngineRollouts):
    """``[sampler]`` with ``[ray]``: the driver publishes each version to the engines (``EngineRollouts``)
    and samples the held-out tasks; Ray workers (``EngineWorker``) sample and score the training
    rollouts through the engines."""

    def __init__(self, config: RunConfig, policy: Policy, sets: list, group_size: int, sampling: Sampling,
                 generator: torch.Generator, run_dir: Path, version: Callable[[], int]):
        super().__init__(config.sampler, policy, sets, group_size, sampling, generator, run_dir, version)
        threads = max(1, int(config.ray.cpus_per_worker))
        try:
            self.workers = RayRollouts(config, self.policy, sets, group_size, sampling, config.ray,
                                       worker=EngineWorker, args=(config, policy.tokenizer, threads))
        except BaseException:
            super().close()
            raise

    @property
    def replaced(self) -> int:
        return self.workers.replaced

    def defer_scoring(self) -> bool:
        return False  # the workers score where they sample

    def apply(self, version: int, state: str) -> None:
        super().apply(version, state)
        self.workers.apply(version, {"name": state, "folder": str(self.loaded[state])})

    def rollout(self, drawn: list[tuple], step: int, round_: int, reports: dict[str, RewardReport]) -> list[Group]:
        return self.workers.rollout(drawn, step, round_, reports)

    def close(self) -> None:
        try:
            self.workers.close()
        finally:
            super().close()
