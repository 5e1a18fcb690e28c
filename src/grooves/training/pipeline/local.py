"""Where a step's rollouts come from, and the asynchronous pipeline of ``train.max_off_policy_steps``.

A *rollouts backend* samples and scores drawn tasks with some copy of the policy and reports
the adapter version that copy holds:

- ``LocalRollouts`` in this process: the trainer's own policy (the synchronous loop) or a
  sampler copy of it whose adapter weights are replaced between batches (the async loop: the
  sampler never reads parameters while the optimizer writes them);
- ``grooves.training.pipeline.process.ProcessRollouts``: a child process with a sampler copy
  (``train.async_sampler = "process"``);
- ``grooves.training.pipeline.ray_workers.RayRollouts``: Ray actors, each with a sampler copy.

A *pipeline* hands the loop the batch of each step. ``SyncPipeline`` collects it when asked
(k = 0, today's loop). ``AsyncPipeline`` collects in a producer thread: the batch of step b
starts once version b-1-k is published (the adapter after b-1-k updates), so with k = 1 the
rollouts of step s+1 run while step s updates; torch releases the GIL in its kernels and a
judge's HTTP wait releases it too. A backend that can score later (``defer_scoring``) hands
each batch back sampled but not scored, and a scorer thread scores it while the producer samples
the next: the generation of step s+1 does not wait for the judge's answers on step s. Such a
batch's judges that grade one output alone are asked as each row finishes (``Reward.ask_ahead``),
so by the time it is scored most answers are in. A batch
reaches the loop only once scored, in order. Each batch carries the task-draw position, the
sampling RNG state and the skipped-prompt count right after it was drawn, so a checkpoint after step s
records the position after batch s. A resumed async run draws the same tasks for the next
steps but samples them from the checkpoint's adapter (the uninterrupted run sampled them from
older ones): it continues the run, it does not repeat it bit for bit.
"""

from __future__ import annotations

import copy
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grooves.policy.openmp import release_pool
from grooves.policy.policy import Policy
from grooves.policy.sampler import Sampling
from grooves.rewards.compose import RewardReport
from grooves.training.gather import rollout_groups
from grooves.types import Group, Task


@dataclass
class Batch:
    """One step's rollouts, scored, and where the task draws stood after them."""

    step: int
    kept: list[Group]
    sampled: list[Group]
    reports: dict[str, RewardReport]
    rounds: int
    sample_time: float
    position: dict = field(default_factory=dict)  # tasks, prompts_skipped, generator (RNG state)
    generate_time: float | None = None  # the sampling alone, where its scoring ran apart (async)


def adapter_state(policy: Policy) -> dict[str, torch.Tensor]:
    """The adapter's weights only (the trainable parameters), detached copies on the CPU."""
    return {name: p.detach().to("cpu", copy=True) for name, p in policy.model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_adapter_state(policy: Policy, state: dict[str, torch.Tensor]) -> None:
    params = dict(policy.model.named_parameters())
    missing = sorted(set(state) - set(params))
    if missing:
        raise ValueError(f"adapter weights {missing[:3]} have no parameter in this policy (another LoRA setting?)")
    for name, value in state.items():
        params[name].copy_(value)


def sampler_copy(policy: Policy) -> Policy:
    """An independent copy of the policy (weights and tokenizer) to sample from; no gradients."""
    model = copy.deepcopy(policy.model)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return Policy(model, copy.deepcopy(policy.tokenizer), policy.base_spec, policy.device)


def merge_report(into: RewardReport, other: RewardReport) -> None:
    """Add one scoring's counts to another's (a step scored in several pieces)."""
    for name in ("errors", "calls", "vetoes"):
        mine = getattr(into, name)
        for key, value in getattr(other, name).items():
            mine[key] = mine.get(key, 0) + value
    for key, error in other.first_error.items():
        into.first_error.setdefault(key, error)
    for key, counters in other.counters.items():
        into.add_counters(key, {}, counters)


def scores_with(sets: list, policy: Policy) -> bool:
    """Whether a reward model scores with the policy's own weights (``share_backbones``): it switches
    the adapter off while it scores, so it must not score while the sampler generates."""
    return any(getattr(getattr(c, "model", None), "base", None) is not None and c.model.base[0] is policy.model
               for s in sets for c in s.reward.components)


class LocalRollouts:
    """Sample and score in this process, with the trainer's policy or (``copy=True``) a sampler copy.

    ``defer=True``: in an async pipeline, ``rollout`` returns its groups sampled but not scored and
    the pipeline scores them later (``unscored``), beside the next batch's sampling. Only for runs
    whose draw does not read the rewards (no dynamic sampling) and whose reward models do not share
    the sampling model's weights (``share_backbones``)."""

    def __init__(self, policy: Policy, sets: list, group_size: int, sampling: Sampling,
                 generator: torch.Generator, *, copy: bool = False, defer: bool = False):
        self.trainer_policy = policy
        self.sets = sets
        self.policy = sampler_copy(policy) if copy else policy
        self.group_size = group_size
        self.sampling = sampling
        self.generator = generator
        self.version = 0
        self.on_phase: Callable[[str], None] = lambda phase: None  # the synchronous loop shows its phases
        self.defer = defer
        self._deferring = False
        self._unscored: list[Callable[[], None]] = []

    def snapshot(self) -> dict[str, torch.Tensor] | None:
        """What ``apply`` needs to catch up with the trainer (nothing when sampling with its policy)."""
        return None if self.policy is self.trainer_policy else adapter_state(self.trainer_policy)

    def apply(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        if state is not None:
            load_adapter_state(self.policy, state)
        self.version = version

    def defer_scoring(self) -> bool:
        """From now on ``rollout`` leaves the scoring to ``unscored`` (where allowed); whether it will."""
        self._deferring = self.defer
        return self._deferring

    def unscored(self) -> list[Callable[[], None]]:
        """The scorings left by ``rollout`` since the last call: each scores its groups in place and
        counts into the report that ``rollout`` was given."""
        jobs, self._unscored = self._unscored, []
        return jobs

    def rollout(self, drawn: list[tuple], step: int, round_: int, reports: dict[str, RewardReport]) -> list[Group]:
        """Groups for ``drawn`` (task set, task) pairs, scored; an env's tasks roll out with its tools."""
        if self._deferring:
            groups = self.sample(drawn, step, round_)
            self._unscored.append(lambda: self.score(groups, reports))
            return groups
        groups: list[Group] = []
        for task_set, own in self._by_set(drawn):
            made = self._sample_set(task_set, own)
            self.on_phase("rewarding")
            task_set.reward.score(made, reports[task_set.name])
            groups += made
        return groups

    def sample(self, drawn: list[tuple], step: int, round_: int) -> list[Group]:
        """Groups for ``drawn``, sampled and not scored (``metadata["task_set"]`` says whose reward scores
        them). The judges that grade each output alone are asked as its row finishes (``Reward.ask_ahead``):
        the later scoring takes their answers over, so the judge's wait overlaps the sampling."""
        return [g for task_set, own in self._by_set(drawn) for g in self._sample_set(task_set, own, ahead=True)]

    def score(self, groups: list[Group], reports: dict[str, RewardReport]) -> None:
        """Score sampled groups in place, each with its task set's reward."""
        for task_set in self.sets:
            own = [g for g in groups if g.metadata.get("task_set") == task_set.name]
            if own:
                task_set.reward.score(own, reports[task_set.name])

    def _by_set(self, drawn: list[tuple]) -> list[tuple]:
        by_set = [(s, [t for d, t in drawn if d is s]) for s in self.sets]
        return [(s, own) for s, own in by_set if own]

    def _sample_set(self, task_set, own: list[Task], ahead: bool = False) -> list[Group]:
        self.on_phase("sampling")
        made = rollout_groups(self.policy, own, [task_set.render(t) for t in own], self.group_size,
                              self.sampling, self.generator, self.version, task_set.env,
                              on_trajectory=task_set.reward.ask_ahead if ahead else None)
        for group in made:
            group.metadata["task_set"] = task_set.name
        return made

    def close(self) -> None:
        pass


def fill_in(groups: list[Group], scored: list[Group]) -> None:
    """Copy what scoring wrote (rewards, components, metadata) from ``scored`` into the same groups."""
    for mine, theirs in zip(groups, scored, strict=True):
        mine.metadata.update(theirs.metadata)
        for trajectory, other in zip(mine.trajectories, theirs.trajectories, strict=True):
            trajectory.reward, trajectory.components = other.reward, other.components
            trajectory.metrics, trajectory.metadata = other.metrics, other.metadata


def staleness_metrics(groups: list[Group], trainer_step: int) -> dict[str, float]:
    """The versions that sampled a step's trajectories, and how many updates behind the trainer they are."""
    versions = [t.policy_version for g in groups for t in g.trajectories if t.policy_version is not None]
    if not versions:
        return {}
    lags = [trainer_step - v for v in versions]
    return {"rollout/policy_version": float(min(versions)), "rollout/staleness/mean": statistics.fmean(lags),
            "rollout/staleness/max": float(max(lags))}


def drop_after(train) -> int | None:
    """Trajectories more than this many updates old leave the batch: k of the async pipeline,
    or ``train.max_staleness`` (for groups made elsewhere) when that is set and smaller."""
    limits = [v for v in (train.max_staleness, train.max_off_policy_steps or None) if v is not None]
    return min(limits) if limits else None


Produce = Callable[[int], Batch]


class SyncPipeline:
    """k = 0: each step's batch is collected when the loop asks for it, from the newest adapter."""

    def __init__(self, rollouts, produce: Produce, version: int):
        self.rollouts = rollouts
        self.produce = produce
        self._published: tuple[int, object] = (version, rollouts.snapshot())
        self._applied: int | None = None

    def publish(self, version: int) -> None:
        self._published = (version, self.rollouts.snapshot())

    def take(self, step: int) -> Batch:
        version, state = self._published
        if version != self._applied:
            self.rollouts.apply(version, state)
            self._applied = version
        return self.produce(step)

    def close(self) -> None:
        self.rollouts.close()


class AsyncPipeline:
    """k >= 1: a producer thread collects batches up to k updates ahead of the trainer; where the
    backend can score later, a scorer thread scores each batch while the next is sampled.

    Batch b is sampled once version b-1-k is published, and version v needs batch v trained, so at
    most k batches are being scored while the next one is sampled; the scorer takes them in order."""

    def __init__(self, rollouts, produce: Produce, version: int, *, k: int, first: int, last: int,
                 lock: threading.Lock | None = None, score_lock: threading.Lock | None = None):
        self.rollouts = rollouts
        self.produce = produce
        self.k = k
        self.lock = lock or threading.Lock()  # held while a batch is collected (the loop validates under it)
        self.score_lock = score_lock or threading.Lock()  # held while a batch is scored apart (the same)
        self._cond = threading.Condition()
        self._published: tuple[int, object] = (version, rollouts.snapshot())
        self._batches: dict[int, Batch] = {}
        self._error: BaseException | None = None
        self._stop = False
        defer = getattr(rollouts, "defer_scoring", None)  # Ray workers score where they sample
        self._scoring: queue.Queue | None = queue.Queue() if defer is not None and defer() else None
        self._threads = [threading.Thread(target=self._run, args=(first, last), name="grooves-sampler", daemon=True)]
        if self._scoring is not None:
            self._threads.append(threading.Thread(target=self._score, name="grooves-scorer", daemon=True))
        for thread in self._threads:
            thread.start()

    def publish(self, version: int) -> None:
        """The trainer finished ``version`` updates: later batches may sample from its adapter."""
        state = self.rollouts.snapshot()  # copied now, before the next update changes the weights
        with self._cond:
            self._published = (version, state)
            self._cond.notify_all()

    def take(self, step: int) -> Batch:
        with self._cond:
            if step not in self._batches:
                release_pool()  # the trainer waits: a sampler thread gets the threads
            self._cond.wait_for(lambda: step in self._batches or self._error is not None)
            if step not in self._batches:
                raise self._error
            return self._batches.pop(step)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self.rollouts.close()

    def _run(self, first: int, last: int) -> None:
        applied = None
        try:
            for step in range(first, last + 1):
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._published[0] >= step - 1 - self.k)
                    if self._stop:
                        return
                    version, state = self._published
                with self.lock:
                    if version != applied:
                        self.rollouts.apply(version, state)
                        applied = version
                    start = time.perf_counter()
                    batch = self.produce(step)
                if self._scoring is None:
                    self._ready(batch)
                else:
                    self._scoring.put((batch, self.rollouts.unscored(), start))
                release_pool()  # this thread waits now: the trainer's update gets the threads
        except BaseException as error:  # noqa: BLE001 - handed to the loop, which raises it
            self._fail(error)
        finally:
            if self._scoring is not None:
                self._scoring.put(None)

    def _score(self) -> None:
        """Score the batches in the order they were sampled; each reaches the loop once scored."""
        while (item := self._scoring.get()) is not None:
            batch, scorings, start = item
            if self._stop:
                continue
            try:
                with self.score_lock:
                    for scoring in scorings:
                        scoring()
            except BaseException as error:  # noqa: BLE001 - handed to the loop, which raises it
                self._fail(error)
                return
            batch.generate_time = batch.sample_time  # the batch's own time until now: sampling only
            batch.sample_time = time.perf_counter() - start  # sampled and scored
            self._ready(batch)

    def _ready(self, batch: Batch) -> None:
        with self._cond:
            self._batches[batch.step] = batch
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = self._error or error
            self._cond.notify_all()
