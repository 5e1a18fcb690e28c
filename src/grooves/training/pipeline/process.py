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

In the async pipeline the child samples a batch and scores it apart (``defer_scoring``): the
scoring requests go over a second pipe to a scorer thread of the child, so the child samples the
next batch while the judge answers on this one; the judges that grade one output alone were
asked already, each as its row finished (``LocalRollouts.sample``), and the scorer takes their
answers over. A child that dies while scoring is asked again:
the groups it was scoring are this process's. Scoring stays beside the sampling when the draw
reads the rewards (dynamic sampling) or a reward model scores with the sampler's own weights.

On a CPU the child decodes on half of torch's threads; this process computes on the other half
while the child generates and on all of them while it waits for the next adapter
(``grooves.training.pipeline.threads``).

Because the child is spawned, a script that trains this way through the Python API must keep
its top-level code under ``if __name__ == "__main__":`` (the ``grooves`` command does).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import threading
import traceback
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

from grooves.policy.sampler import Sampling
from grooves.rewards.compose import RewardReport
from grooves.training.build import load_policy, share_backbones, task_sets
from grooves.training.config import RunConfig
from grooves.training.pipeline.local import LocalRollouts, adapter_state, fill_in, merge_report, scores_with
from grooves.training.pipeline.threads import ElasticThreads
from grooves.types import Group

RESTARTS = 3  # a call whose child dies more often than this gives up


class SamplerDied(RuntimeError):
    def __init__(self, message: str, generation: int):
        super().__init__(message)
        self.generation = generation  # which child died


def serve(conn, scoring, config: RunConfig, runs: str | None, group_size: int, sampling: Sampling,
          threads: int) -> None:
    """The child: answer ``(method, args)`` on ``conn`` (apply, rollout, sample) and, on a thread of
    its own, ``score`` on ``scoring``, until the pipe closes or ``stop`` arrives."""
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
    conn.send(("ok", not scores_with(sets, policy)))

    def sample(method: str, args: tuple):
        if method == "apply":
            version, packed = args
            return rollouts.apply(version, torch.load(io.BytesIO(packed), weights_only=True))
        units, seed, step, round_ = args
        generator.manual_seed(seed)
        drawn = [(sets[i], task) for i, task in units]
        if method == "sample":
            return rollouts.sample(drawn, step, round_)
        reports = {s.name: RewardReport() for s in sets}
        return rollouts.rollout(drawn, step, round_, reports), reports

    def score(method: str, args: tuple):
        (groups,) = args
        reports = {s.name: RewardReport() for s in sets}
        rollouts.score(groups, reports)
        return groups, reports

    scorer = threading.Thread(target=_answer, args=(scoring, score), name="grooves-scorer", daemon=True)
    scorer.start()
    _answer(conn, sample)
    # The parent stops both pipes. Let the scorer free its last request first: a daemon thread that
    # frees a tensor while the interpreter ends is unwound inside torch and aborts the process.
    scorer.join(10)


def _answer(conn, handle) -> None:
    """Answer requests on ``conn`` with ``handle`` until it closes or ``stop`` arrives."""
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        if method == "stop":
            return
        try:
            result = handle(method, args)
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
                and os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "ACTIVE"):
            warnings.warn("the sampler process shares the CPU with this trainer, whose idle OpenMP threads "
                          "spin without end under OMP_WAIT_POLICY=ACTIVE, on the cores the sampler needs: "
                          "leave the variable unset (docs/scale.md)", stacklevel=2)
        self._args = (config, None if runs is None else str(runs), group_size, sampling, threads)
        self.version = 0
        self._state: bytes | None = None  # the newest adapter weights, as torch.save wrote them
        self.replaced = 0  # children started again after dying (rollout/workers_replaced)
        self._dynamic = config.algorithm.dynamic_sampling  # the draw reads the rewards: score at once
        self._deferring = False
        self._unscored: list = []
        # Two threads of this process talk to the child, each over its own pipe: the sampling one
        # (apply, rollout, sample) and the scoring one. A restart holds both pipes' locks until the
        # new child has the newest weights; ``_generation`` counts the children.
        self._lock, self._scoring_lock, self._restart_lock = threading.RLock(), threading.Lock(), threading.Lock()
        self._generation = 0
        self._process = None
        self._start()
        # this process's threads: all of them while the child waits, the rest while it generates
        total = torch.get_num_threads()
        self.elastic = (ElasticThreads(policy.model, idle=total, busy=max(1, total - threads))
                        if policy.device.type == "cpu" and total > 1 else None)

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._scoring, scoring_child = context.Pipe()
        self._process = context.Process(target=serve, args=(child, scoring_child, *self._args),
                                        name="grooves-sampler", daemon=True)
        self._process.start()
        child.close()
        scoring_child.close()
        # the child has loaded the policy and the task sets (and says whether it may score apart), or says why not
        self._apart = self._request("hello", ())
        if self._state is not None:
            self._request("apply", (self.version, self._state))

    def _request(self, method: str, args: tuple, scoring: bool = False):
        """Ask the current child (``hello``: read its greeting); ``SamplerDied`` when it is gone."""
        with self._scoring_lock if scoring else self._lock:
            generation, process, conn = self._generation, self._process, self._scoring if scoring else self._conn
            try:
                if method != "hello":
                    conn.send((method, args))
                status, value = conn.recv()
            except (EOFError, OSError):  # OSError: a broken pipe, a reset connection
                process.join(5)
                raise SamplerDied(f"the sampler process ended (exit code {process.exitcode})", generation) from None
        if status == "error":
            raise value
        return value

    def _call(self, method: str, args: tuple, scoring: bool = False):
        """``method`` in the child; a child that died is started again and asked again."""
        for attempt in range(RESTARTS + 1):
            try:
                return self._request(method, args, scoring)
            except SamplerDied as error:
                if attempt == RESTARTS:
                    raise RuntimeError(f"the sampler process keeps dying ({error}); giving up") from None
                self._restart(error.generation)

    def _restart(self, generation: int) -> None:
        """Start child ``generation + 1``, unless the other thread already has."""
        with self._restart_lock:
            if generation != self._generation:
                return
            with self._lock, self._scoring_lock:
                self._process.join(1)
                if self._process.is_alive():
                    self._process.kill()
                    self._process.join()
                self._start()
                self._generation += 1
                self.replaced += 1

    def snapshot(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.trainer_policy)

    def apply(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Send the adapter's weights to the child (as bytes: any dtype, no shared file handles)."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.version, self._state = version, buffer.getvalue()
        self._call("apply", (version, self._state))

    def defer_scoring(self) -> bool:
        """From now on ``rollout`` returns its groups unscored and ``unscored`` scores them (see the
        module doc); whether it will."""
        self._deferring = not self._dynamic and self._apart
        return self._deferring

    def unscored(self) -> list:
        """The scorings left by ``rollout`` since the last call (see ``LocalRollouts.unscored``)."""
        jobs, self._unscored = self._unscored, []
        return jobs

    def rollout(self, drawn: list[tuple], step: int, round_: int, reports: dict[str, RewardReport]) -> list[Group]:
        """Groups for ``drawn`` (task set, task) pairs, sampled in the child and scored there, now or
        (``defer_scoring``) when ``unscored`` asks."""
        index = {id(s): i for i, s in enumerate(self.sets)}
        units = [(index[id(s)], task) for s, task in drawn]
        seed = random.Random(f"{self.seed}:{step}:{round_}").getrandbits(63)
        with self.elastic.working() if self.elastic else nullcontext():  # the child generates
            if self._deferring:
                groups = self._call("sample", (units, seed, step, round_))
                self._unscored.append(lambda: self._score(groups, reports))
                return groups
            groups, theirs = self._call("rollout", (units, seed, step, round_))
        for name, report in theirs.items():
            merge_report(reports[name], report)
        return groups

    def _score(self, groups: list[Group], reports: dict[str, RewardReport]) -> None:
        scored, theirs = self._call("score", (groups,), scoring=True)
        fill_in(groups, scored)
        for name, report in theirs.items():
            merge_report(reports[name], report)

    def close(self) -> None:
        if self.elastic is not None:
            self.elastic.close()
            self.elastic = None
        if self._process is None:
            return
        for conn in (self._conn, self._scoring):
            try:
                conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._scoring.close()
        self._process = None
