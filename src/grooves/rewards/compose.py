"""A reward is a named, weighted list of components that score whole groups.

Every component sees a whole ``Group`` (so a group-relative judge can compare the G
samples) and returns one value per trajectory, with a reason where it has one. Kinds:

- ``Component`` — a verifier: a plain Python function (sync or ``async``) whose parameters
  are looked up by name among ``completion``, ``task``, ``messages``, ``prompt``, ``state``,
  ``trajectory``, ``group`` and the task's own columns (``text``, ``reference``, ...). With a
  ``completions`` parameter it is called once per group and returns a list.
- judges, reward models and guards (``grooves.rewards.judges``, ``.models``, ``.guards``)
  subclass ``RewardComponent``.

Weight 0 makes a component a logged metric only. A guard (``veto = True``) does not add to
the total; when it fails (value 0) the total becomes its ``floor`` whatever the others say,
and the reason is kept in ``trajectory.metadata["vetoes"]``.

Failures are explicit: a component that raises, returns a non-finite value or the wrong
number of values yields NaN for those trajectories and counts as an error; the error is the
trajectory's reason for that component (``failed: ...``), so review and the dashboard show why. A trajectory
whose required component is NaN gets a NaN total and the trainer leaves it out of the
advantage (never a silent 0). A confirmed veto still sets the floor: the guard's answer
is known whatever else failed.

Components run concurrently on one background event loop, so judges keep their HTTP
connections across steps; sync functions run in worker threads. ``max_concurrency``
bounds the calls in flight, across every scoring of the reward at once: judge requests and
async verifier calls count one per trajectory, other components one per group.

``ask_ahead`` starts the requests of the judges that grade one output alone for a trajectory
whose batch is still being sampled (the async pipeline calls it as each row finishes); the
batch's scoring then takes their answers over instead of asking again.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grooves.rewards.client import asking_ahead
from grooves.rewards.runner import Escaped, escaping, in_thread, limited, limit_to, run_coroutine, start_coroutine
from grooves.scoring import task_arguments
from grooves.types import Group, Trajectory


@dataclass
class Score:
    """One component's value for one trajectory, with an optional reason (e.g. a judge's)."""

    value: float
    reason: str | None = None


@dataclass
class Failed:
    """What a component returns for a trajectory it could not score: NaN, counted, with why."""

    error: str


class ComponentError(RuntimeError):
    """A component failed for a whole group (its trajectories get NaN)."""


class RewardComponent:
    """Base of every reward component: a named, weighted scorer of whole groups.

    Subclasses implement ``score_group`` (async); it returns one ``float``/``Score`` per trajectory
    (NaN or ``None`` marks one that could not be scored) or raises for the whole group.
    ``counters()`` may return running totals (a judge's calls, retries, seconds, ...); a
    ``RewardReport`` keeps what each scoring pass added, logged as ``reward/<name>/<key>``.
    """

    veto: bool = False
    floor: float = 0.0
    # False: the reward's concurrency limit covers the whole ``score_group`` call. True: the
    # component takes ``limited()`` around each of its own calls (one per trajectory).
    limits_itself: bool = False
    # True: each output is graded alone, by requests a later scoring of the same output takes
    # over (a judge's client); ``Reward.ask_ahead`` starts them on a group of one.
    asks_alone: bool = False

    def __init__(self, name: str, weight: float = 1.0, required: bool = True):
        if name == "total" or "/" in name or not name:
            raise ValueError(f"reward component name {name!r} is empty, reserved or contains '/'")
        self.name = name
        self.weight = float(weight)
        self.required = required

    async def score_group(self, group: Group) -> list[float | Score | None]:
        raise NotImplementedError

    def counters(self) -> dict[str, float]:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, weight={self.weight})"


class EnvScore(RewardComponent):
    """A score the environment computed at the end of the rollout (``metadata["env_scores"]``),
    e.g. helpdesk's ``action``: the final database is the expected one. A trajectory without
    it (not from that env) fails, it does not score 0."""

    async def score_group(self, group: Group) -> list[Score | Failed]:
        out: list[Score | Failed] = []
        for trajectory in group.trajectories:
            scores = trajectory.metadata.get("env_scores", {})
            out.append(Score(float(scores[self.name])) if self.name in scores
                       else Failed(f"the rollout has no env score {self.name!r} (has: {sorted(scores)})"))
        return out


PROVIDED_ARGUMENTS = frozenset({"task", "prompt", "group", "completions", "completion", "messages",
                                "trajectory", "state"})
"""What ``task_arguments`` provides besides the task's own columns."""


class Component(RewardComponent):
    """A verifier: a plain function scoring one trajectory (or, with ``completions``, a group)."""

    def __init__(self, name: str, fn: Callable[..., Any], weight: float = 1.0, required: bool = True):
        super().__init__(name, weight, required)
        self.fn = fn
        signature = inspect.signature(fn)
        self._params = [p.name for p in signature.parameters.values()
                        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self._takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
        self.per_group = "completions" in self._params
        self._async = inspect.iscoroutinefunction(fn)
        self.limits_itself = self._async and not self.per_group

    def task_columns(self) -> list[str]:
        """The task columns this verifier asks for by name (a run checks them before it starts)."""
        return [] if self._takes_kwargs else [p for p in self._params if p not in PROVIDED_ARGUMENTS]

    def arguments(self, trajectory: Trajectory | None, group: Group) -> dict[str, Any]:
        available = task_arguments(trajectory, group)
        if self._takes_kwargs:
            return available
        missing = [p for p in self._params if p not in available]
        if missing:
            raise TypeError(f"reward {self.name!r} asks for {missing}, which neither the trajectory "
                            f"nor the task provides (task columns: {sorted(group.task)})")
        return {p: available[p] for p in self._params}

    async def score_group(self, group: Group) -> list[float | Score | None]:
        if self.per_group:
            values = await self._call(self.arguments(None, group))
            if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
                raise ComponentError(f"returned {type(values).__name__}, expected a list of {len(group)} values")
            return list(values)
        if self._async:
            return list(await asyncio.gather(*(self._one(t, group) for t in group.trajectories)))
        # One worker thread for the whole group: cheap verifiers stay cheap, slow ones don't block.
        return await in_thread(lambda: [self._one_sync(t, group) for t in group.trajectories])

    async def _call(self, arguments: dict[str, Any]) -> Any:
        if self._async:
            return await escaping(self.fn(**arguments))
        return await in_thread(self.fn, **arguments)

    async def _one(self, trajectory: Trajectory, group: Group) -> float | Score | Failed:
        try:
            async with limited():
                return await escaping(self.fn(**self.arguments(trajectory, group)))
        except Escaped:
            raise
        except Exception as error:
            return Failed(f"{type(error).__name__}: {error}")

    def _one_sync(self, trajectory: Trajectory, group: Group) -> float | Score | Failed:
        try:
            return self.fn(**self.arguments(trajectory, group))
        except Exception as error:  # a broken verifier must not stop the run; it is counted and shown
            return Failed(f"{type(error).__name__}: {error}")


Verifier = Component


@dataclass
class RewardReport:
    """What scoring one batch of groups produced, for metrics."""

    errors: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    first_error: dict[str, str] = field(default_factory=dict)
    vetoes: dict[str, int] = field(default_factory=dict)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)

    def add_counters(self, name: str, before: dict[str, float], after: dict[str, float]) -> None:
        mine = self.counters.setdefault(name, {})
        for key, value in after.items():
            mine[key] = mine.get(key, 0.0) + value - before.get(key, 0.0)

    def add_error(self, name: str, error: str, count: int = 1) -> None:
        self.errors[name] = self.errors.get(name, 0) + count
        self.first_error.setdefault(name, error)


class Reward:
    """Scores groups: fills ``trajectory.components`` and ``trajectory.reward`` (the weighted sum)."""

    def __init__(self, components: Iterable[RewardComponent], max_concurrency: int = 16):
        self.components = list(components)
        names = [c.name for c in self.components]
        if not names:
            raise ValueError("a reward needs at least one component")
        if len(set(names)) != len(names):
            raise ValueError(f"reward component names must be unique: {names}")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        self.max_concurrency = max_concurrency
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # an event loop's semaphore

    def score(self, groups: list[Group], report: RewardReport | None = None) -> RewardReport:
        """Score every group (blocking); safe to call with or without a running event loop."""
        return run_coroutine(self.ascore(groups, report))

    def ask_ahead(self, task: dict, trajectory: Trajectory) -> None:
        """Start, and do not wait for, the requests of the components that grade each output alone
        (``asks_alone``) for one trajectory; a later ``score`` of its group takes their answers over
        and counts their calls. Nothing else is scored ahead; a reward with no such component does nothing."""
        alone = [c for c in self.components if c.asks_alone]
        if alone:
            start_coroutine(self._ask_ahead(alone, Group(task=task, trajectories=[trajectory])))

    async def _ask_ahead(self, components: list[RewardComponent], group: Group) -> None:
        limit, ahead = limit_to(self._limit()), asking_ahead.set(True)
        try:  # the outcomes wait in the judges' clients; what fails here fails again, reported, when scored
            await asyncio.gather(*(c.score_group(group) for c in components), return_exceptions=True)
        finally:
            asking_ahead.reset(ahead)
            limit.var.reset(limit)

    def _limit(self) -> asyncio.Semaphore:
        """This reward's ``max_concurrency`` slots in the running event loop, shared by all its scorings."""
        loop = asyncio.get_running_loop()
        if loop not in self._limits:
            self._limits[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._limits[loop]

    async def ascore(self, groups: list[Group], report: RewardReport | None = None) -> RewardReport:
        report = report or RewardReport()
        token = limit_to(self._limit())
        before = {c.name: c.counters() for c in self.components}

        async def one(component: RewardComponent, group: Group) -> None:
            values = await _score_safely(component, group)
            _apply(component, group, values, report)

        try:
            await asyncio.gather(*(one(c, g) for g in groups for c in self.components))
        finally:
            token.var.reset(token)
        for component in self.components:
            report.add_counters(component.name, before[component.name], component.counters())
        for group in groups:
            for trajectory in group.trajectories:
                trajectory.reward = self.total(trajectory.components, trajectory.metadata)
                for name in trajectory.metadata.get("vetoes", {}):
                    report.vetoes[name] = report.vetoes.get(name, 0) + 1
        return report

    def total(self, components: dict[str, float], metadata: dict[str, Any] | None = None) -> float:
        """Weighted sum; a failed guard sets its floor, a NaN required component makes NaN."""
        vetoes = {}
        for guard in (c for c in self.components if c.veto):
            value = components.get(guard.name, math.nan)
            if not math.isnan(value) and value < 0.5:
                reason = (metadata or {}).get("reasons", {}).get(guard.name) or "check failed"
                vetoes[guard.name] = reason
        if metadata is not None:
            metadata.pop("vetoes", None)
            if vetoes:
                metadata["vetoes"] = vetoes
        if vetoes:
            return min(c.floor for c in self.components if c.name in vetoes)
        total = 0.0
        for component in self.components:
            if component.weight == 0 and not component.veto:
                continue  # a logged metric only: its failure does not cost the trajectory
            value = components.get(component.name, math.nan)
            if math.isnan(value):
                if component.required:
                    return math.nan  # a guard that errored vetoes nothing but leaves the trajectory out
                continue
            if not component.veto:
                total += component.weight * value
        return total


async def _score_safely(component: RewardComponent, group: Group) -> list[Any]:
    try:
        if component.limits_itself:
            values = await escaping(component.score_group(group))
        else:
            async with limited():
                values = await escaping(component.score_group(group))
    except Escaped:
        raise
    except Exception as error:  # the whole group fails for this component: NaN, counted
        return [Failed(f"{type(error).__name__}: {error}")] * len(group)
    if len(values) != len(group):
        return [Failed(f"returned {len(values)} values for a group of {len(group)}")] * len(group)
    return values


def _apply(component: RewardComponent, group: Group, values: list[Any], report: RewardReport) -> None:
    report.calls[component.name] = report.calls.get(component.name, 0) + len(group)
    for trajectory, value in zip(group.trajectories, values):
        reason = None
        if isinstance(value, Score):
            value, reason = value.value, value.reason
        if isinstance(value, Failed):
            report.add_error(component.name, value.error)
            number, reason = math.nan, f"failed: {value.error}"
        else:
            number = _as_number(value)
            if not math.isfinite(number):
                error = f"returned {value!r} ({type(value).__name__}), expected a finite number"
                report.add_error(component.name, error)
                number, reason = math.nan, f"failed: {error}"
        trajectory.components[component.name] = number
        if reason:
            trajectory.metadata.setdefault("reasons", {})[component.name] = reason


def _as_number(value: Any) -> float:
    """A reward value as a float; NaN for None and for what is not a number. A string is not
    one even when it reads as one ("0.5"): that is usually a judge reply parsed too early."""
    if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def as_reward(spec: Reward | Callable | list | dict) -> Reward:
    """Build a Reward from a function, a list of functions/components, or ``{name: fn}``."""
    if isinstance(spec, Reward):
        return spec
    if isinstance(spec, RewardComponent):
        return Reward([spec])
    if callable(spec):
        return Reward([Component(getattr(spec, "__name__", "reward"), spec)])
    if isinstance(spec, dict):
        return Reward([Component(name, fn) for name, fn in spec.items()])
    components = []
    for item in spec:
        components.append(item if isinstance(item, RewardComponent) else Component(item.__name__, item))
    return Reward(components)


def import_object(path: str) -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not attr:
        raise ValueError(f"{path!r} must look like 'module:function' or 'file.py:function'")
    if module_name.endswith(".py"):
        module = _import_file(Path(module_name))
    else:
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name} has no attribute {attr!r}") from None


def _import_file(file: Path) -> Any:
    """A user's Python file as a module; a syntax error or an exception while it runs is a
    ValueError with the file and line, not a traceback through grooves."""
    if not file.exists():
        raise FileNotFoundError(f"file {file} does not exist")
    spec = importlib.util.spec_from_file_location(f"grooves_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[spec.name]
        raise ValueError(f"{file}:{error.lineno}: syntax error: {error.msg}") from None
    except Exception as error:
        del sys.modules[spec.name]
        line = next((frame.lineno for frame in reversed(traceback.extract_tb(error.__traceback__))
                     if Path(frame.filename) == file.resolve() or Path(frame.filename) == file), None)
        where = f"{file}:{line}" if line else str(file)
        raise ValueError(f"{where}: importing it raised {type(error).__name__}: {error}") from None
    return module
