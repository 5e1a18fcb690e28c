"""The async pipeline's sampler in a process of its own (``train.async_sampler = "process"``).

With ``train.max_off_policy_steps >= 1`` the rollouts of the next step overlap the current
update. A sampler *thread* shares the trainer's interpreter: for a small model, decoding is
mostly Python work between tiny kernels, so the two threads take turns on the GIL and the
overlap buys little on a CPU. A sampler *process* has its own interpreter and its own torch
threads: decoding and the update run side by side.

The child is started with ``spawn`` (a forked torch process can hang in its thread pools). It
loads the policy as the config says and builds the run's task sets and reward components
itself, like a Ray rollout worker; after each update only the adapter's weights cross the pipe,
with the version they carry. Each batch samples from a generator seeded by (run seed, step,
sampling round), so a batch re-run after the child died samples the same completions from the
same weights. A child that dies is started again, given the newest weights, and asked again.

Because the child is spawned, a script that trains this way through the Python API must keep
its top-level code under ``if __name__ == "__main__":`` (the ``grooves`` command does).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import traceback
import warnings
from pathlib import Path

import torch

from grooves.policy.sampler import Sampling
from grooves.rewards.compose import RewardReport
from grooves.training.build import load_policy, share_backbones, task_sets
from grooves.training.config import RunConfig
from grooves.training.pipeline.local import LocalRollouts, adapter_state, merge_report
from grooves.types import Group

RESTARTS = 3  # a call whose child dies more often than this gives up


class SamplerDied(RuntimeError):
    pass


def serve(conn, config: RunConfig, runs: str | None, group_size: int, sampling: Sampling, threads: int) -> None:
    """The child's loop: answer ``(method, args)`` messages until the pipe closes or ``stop`` arrives."""
    torch.set_num_threads(threads)
    try:
        sets = task_sets(config)
        policy = load_policy(config, runs)
        share_backbones(sets, policy)
        generator = torch.Generator(device=policy.device)
        rollouts = LocalRollouts(policy, sets, group_size, sampling, generator)
    except BaseException as error:  # noqa: BLE001 - the parent raises it
        conn.send(("error", _portable(error)))
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "stop":
            return
        try:
            if method == "apply":
                version, packed = args
                result = rollouts.apply(version, torch.load(io.BytesIO(packed), weights_only=True))
            else:  # rollout
                units, seed, step, round_ = args
                generator.manual_seed(seed)
                reports = {s.name: RewardReport() for s in sets}
                groups = rollouts.rollout([(sets[i], task) for i, task in units], step, round_, reports)
                result = (groups, reports)
        except BaseException as error:  # noqa: BLE001 - the parent raises it; the child goes on
            conn.send(("error", _portable(error)))
        else:
            conn.send(("ok", result))


def _portable(error: BaseException) -> BaseException:
    """The child's exception as the parent can unpickle it, with the child's traceback in the message."""
    detail = "".join(traceback.format_exception(error)).rstrip()
    try:
        import pickle

        pickle.loads(pickle.dumps(error))
        error.add_note(f"in the sampler process:\n{detail}")
        return error
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes as text
        return RuntimeError(f"the sampler process failed:\n{detail}")


class ProcessRollouts:
    """The rollouts backend of an async run whose sampler is a child process (see the module doc)."""

    def __init__(self, config: RunConfig, policy, sets: list, group_size: int, sampling: Sampling,
                 runs: str | Path | None = None, threads: int | None = None):
        self.trainer_policy = policy
        self.policy = policy  # this process's tokenizer measures prompt lengths
        self.sets = sets
        self.seed = config.seed
        threads = threads or max(1, torch.get_num_threads() // 2)
        if (policy.device.type == "cpu" and torch.get_num_threads() > 1
                and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"):
            warnings.warn("the sampler process shares the CPU with this trainer, whose idle OpenMP threads "
                          "spin on the cores it needs: set OMP_WAIT_POLICY=PASSIVE in the environment before "
                          "torch is imported (grooves train does; docs/scale.md)", stacklevel=2)
        self._args = (config, None if runs is None else str(runs), group_size, sampling, threads)
        self.version = 0
        self._state: bytes | None = None  # the newest adapter weights, as torch.save wrote them
        self.replaced = 0  # children started again after dying (rollout/workers_replaced)
        self._process = None
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=serve, args=(child, *self._args), name="grooves-sampler",
                                        daemon=True)
        self._process.start()
        child.close()
        self._receive()  # the child has loaded the policy and the task sets, or says why not
        if self._state is not None:
            self._request("apply", (self.version, self._state))

    def _receive(self):
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionError):
            self._process.join(5)
            raise SamplerDied(f"the sampler process ended (exit code {self._process.exitcode})") from None
        if status == "error":
            raise value
        return value

    def _request(self, method: str, args: tuple):
        self._conn.send((method, args))
        return self._receive()

    def _call(self, method: str, args: tuple):
        """``method`` in the child; a child that died is started again and asked again."""
        for attempt in range(RESTARTS + 1):
            try:
                return self._request(method, args)
            except (SamplerDied, BrokenPipeError) as error:
                if attempt == RESTARTS:
                    raise RuntimeError(f"the sampler process keeps dying ({error}); giving up") from None
                self._process.join(1)
                self._start()
                self.replaced += 1

    def snapshot(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.trainer_policy)

    def apply(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Send the adapter's weights to the child (as bytes: any dtype, no shared file handles)."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.version, self._state = version, buffer.getvalue()
        self._call("apply", (version, self._state))

    def rollout(self, drawn: list[tuple], step: int, round_: int, reports: dict[str, RewardReport]) -> list[Group]:
        """Groups for ``drawn`` (task set, task) pairs, sampled and scored in the child."""
        index = {id(s): i for i, s in enumerate(self.sets)}
        units = [(index[id(s)], task) for s, task in drawn]
        seed = random.Random(f"{self.seed}:{step}:{round_}").getrandbits(63)
        groups, theirs = self._call("rollout", (units, seed, step, round_))
        for name, report in theirs.items():
            merge_report(reports[name], report)
        return groups

    def close(self) -> None:
        if self._process is None:
            return
        try:
            self._conn.send(("stop", ()))
        except (BrokenPipeError, OSError):
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._process = None
