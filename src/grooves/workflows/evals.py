"""``grooves eval CONFIG``: candidates side by side on the same held-out tasks, for the decision
whether to fine-tune: quality, latency and cost of each.

A candidate is the base model, a checkpoint ``RUN@STEP``, a merged model folder (any model
spec), or a model behind an OpenAI-compatible endpoint with its price per million tokens.
The tasks, the reward and the sampling settings are a run's (``run = "NAME"``, read from its
``config.toml``) or a run config's (``config = "path.toml"``): the held-out tasks (the first
``limit``, default the config's ``log.val_size``), scored by its reward, sampled with its
held-out settings. So a local candidate's quality is computed exactly as the training loop
validates, and a checkpoint's mean is the ``val/reward/total`` its run logged at that step.

Latency is per task, one request at a time: local candidates answer the first
``latency_tasks`` tasks alone (after the quality pass, which batches them as validation
does); endpoint candidates are timed on every task. ``tokens/s`` is completion tokens over
latency. Tokens per 1,000 tasks are the mean prompt plus completion tokens, times 1,000;
the cost per 1,000 tasks applies the candidate's prices to them (none given: no cost).

Progress (a ``grooves.progress.Reporter``) counts answers over all candidates, with the time
left: each local candidate's answers to every task (a batch per task set) and to the tasks it
answers alone, each endpoint's to every task. ``eval.png`` is drawn by ``eval_chart``.

Before a local candidate answers, its held-out prompts (system, tools, task, as its rollouts
render them) are measured (``check_prompts``): one over the model's context stops the eval
with an ``EvalError``; one over the run's ``sampling.max_prompt_length`` is a warning.

Env (tool) tasks behind an endpoint run turn by turn through its chat API with the env's tools
(``_endpoint_rollout``); their tokens are what the endpoint bills, every turn's prompt included.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grooves.types import Group, Trajectory

if TYPE_CHECKING:
    from grooves.progress import Reporter

BASE = "base"


class EvalError(ValueError):
    """An evaluation that cannot run (no held-out tasks, an endpoint that fails)."""


class Candidate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Shown in the table and the chart.")
    model: str = Field(description="'base' (the run's base model), a model spec or merged folder, a checkpoint "
                       "RUN@STEP, or with endpoint the model name the endpoint serves.")
    endpoint: str | None = Field(None, description="An OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1); "
                                 "without it the model runs in this process.")
    api_key_env: str | None = Field(None, description="Environment variable holding the endpoint's API key.")
    price_in: float | None = Field(None, ge=0, description="Dollars per million prompt tokens.")
    price_out: float | None = Field(None, ge=0, description="Dollars per million completion tokens.")
    tool_choice: Literal["auto", "required", "none"] | None = Field(
        None, description="With endpoint, on env tasks: the requests' tool_choice ('required': a call every turn, "
        "for an env with an answer tool); default: the endpoint's own (auto).")


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("eval", description="Name of the evaluation (the output folder evals/<name>).")
    run: str | None = Field(None, description="Take tasks, reward and sampling from this run under the runs root.")
    config: str | None = Field(None, description="Or from this run config (TOML).")
    limit: int | None = Field(None, ge=1, description="Most held-out tasks per task set (default: log.val_size).")
    latency_tasks: int = Field(8, ge=1, description="Tasks each local candidate answers alone, timed.")
    candidates: list[Candidate] = Field(min_length=1, description="What to compare ([[candidates]] tables).")

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        if (self.run is None) == (self.config is None):
            raise ValueError("give exactly one of run = \"NAME\" or config = \"path.toml\"")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidate names must be unique: {names}")
        return self


@dataclass
class Result:
    """One candidate's numbers."""

    name: str
    model: str
    kind: str  # "local" or "endpoint"
    tasks: int
    reward: float | None
    reward_se: float | None
    components: dict[str, tuple[float | None, float | None]]  # name -> (mean, standard error)
    success: float | None  # env tasks: share of rollouts with every env score in full
    failed: int  # tasks whose total failed (NaN)
    latency_p50: float | None
    latency_p95: float | None
    tokens_per_s: float | None
    prompt_tokens: float
    completion_tokens: float
    cost_per_1k: float | None
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_1k(self) -> float:
        return 1000 * (self.prompt_tokens + self.completion_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_1k": self.tokens_per_1k}


def run_config_of(cfg: EvalConfig, base_dir: Path, runs: str | Path | None):
    """The run config the tasks, reward and sampling come from."""
    from grooves.policy.checkpoints import runs_root
    from grooves.training.config import load_config

    if cfg.run is not None:
        path = runs_root(runs) / cfg.run / "config.toml"
        if not path.is_file():
            raise EvalError(f"run {cfg.run!r} has no config.toml under {runs_root(runs)} (set --runs)")
        return load_config(path)
    path = Path(cfg.config)
    return load_config(path if path.is_absolute() else base_dir / path)


def evaluate_candidates(cfg: EvalConfig, base_dir: Path = Path("."), runs: str | Path | None = None,
                        progress: Reporter | None = None) -> list[Result]:
    """Every candidate on the same held-out tasks. ``progress`` shows each candidate's phases and
    counts its answers, with the time left: a local candidate's answers to every task (one batch
    per task set) and to the ``latency_tasks`` it answers alone, an endpoint's to every task."""
    from grooves.progress import Reporter

    reporter = progress or Reporter(enabled=False)
    run_config = run_config_of(cfg, base_dir, runs)
    heldout = heldout_tasks(run_config, cfg.limit)
    if not heldout:
        raise EvalError("the config has no held-out tasks (set tasks.heldout or tasks.heldout_fraction)")
    tasks = sum(len(t) for _, t in heldout)
    timed = min(cfg.latency_tasks, tasks)
    total = sum(tasks + (0 if c.endpoint else timed) for c in cfg.candidates)
    results = []
    with reporter.counting(total, unit="answer", every=2.0):
        answered = [0]

        def tick(name: str, count: int = 1) -> None:
            answered[0] += count
            reporter.advance(answered[0], {"candidate": name})

        for candidate in cfg.candidates:
            if candidate.endpoint:
                reporter.phase("asking", f"{candidate.name} at {candidate.endpoint}: {tasks} tasks, one at a time")
                results.append(_endpoint(candidate, run_config, heldout, tick))
            else:
                results.append(_local(candidate, run_config, heldout, cfg.latency_tasks, runs, reporter, tick))
    return results


def heldout_tasks(run_config, limit: int | None = None) -> list[tuple[Any, list]]:
    """``(task set, its first ``limit`` held-out tasks)`` for every task set with held-out tasks
    (``limit`` default: the config's ``log.val_size``, as validation uses)."""
    from grooves.training.build import task_sets

    limit = limit or run_config.log.val_size
    return [(s, s.heldout[:limit]) for s in task_sets(run_config) if s.heldout]


def heldout_groups(policy, run_config, heldout: list[tuple[Any, list]] | None = None) -> list[Group]:
    """The held-out tasks answered by ``policy`` and scored, exactly as the training loop
    validates (its tasks, reward, ``val_temperature`` and seed): the mean total is the
    ``val/reward/total`` a run logs for this policy."""
    from grooves.training.gather import evaluate

    sampling = _sampling(run_config)
    groups = []
    for task_set, tasks in heldout_tasks(run_config) if heldout is None else heldout:
        groups += evaluate(policy, tasks, [task_set.render(t) for t in tasks], task_set.reward, sampling, 0,
                           task_set.env).groups
    return groups


def _sampling(run_config):
    from grooves.policy import Sampling

    s = run_config.sampling
    return Sampling(temperature=s.val_temperature, top_p=s.top_p, max_new_tokens=s.max_completion_length,
                    stop=tuple(s.stop), seed=run_config.seed)


def _local(candidate: Candidate, run_config, heldout, latency_tasks: int, runs, reporter: Reporter,
           tick: Callable[[str, int], None]) -> Result:
    from grooves.policy import Policy
    from grooves.training.gather import rollout_groups

    spec = run_config.model.spec if candidate.model == BASE else candidate.model
    reporter.phase("loading", f"{candidate.name}: {spec}")
    # seed: the random-weight "tiny" base is built from it; real models ignore it.
    policy = Policy.load(spec, dtype=run_config.model.dtype, seed=run_config.seed, runs=runs)
    for warning in check_prompts(policy, run_config, heldout, candidate.name):  # before minutes of answering
        reporter.print(f"warning: {warning}")
    sampling = _sampling(run_config)
    groups = []
    for task_set, tasks in heldout:  # a batch per task set, as the run validates, so the numbers match
        reporter.phase("answering", f"{candidate.name}: {len(tasks)} held-out tasks")
        groups += heldout_groups(policy, run_config, [(task_set, tasks)])
        tick(candidate.name, len(tasks))
    latencies, speeds = [], []
    timed = [(ts, t) for ts, tasks in heldout for t in tasks][:latency_tasks]
    reporter.phase("timing", f"{candidate.name}: {len(timed)} tasks, one at a time")
    for task_set, task in timed:
        start = time.perf_counter()
        (group,) = rollout_groups(policy, [task], [task_set.render(task)], 1, sampling, None, 0, task_set.env)
        seconds = time.perf_counter() - start
        latencies.append(seconds)
        speeds.append(sum(group.trajectories[0].completion_mask) / seconds)
        tick(candidate.name, 1)
    tokens = [(len(t.prompt_ids), sum(t.completion_mask)) for g in groups for t in g.trajectories]
    return _result(candidate, "local", groups, latencies, speeds, tokens, any(ts.env for ts, _ in heldout))


def check_prompts(policy, run_config, heldout: list[tuple[Any, list]], name: str) -> list[str]:
    """Raise ``EvalError`` when a held-out prompt (system, tools, task) is over ``policy``'s
    context; return what is over the run's ``sampling.max_prompt_length`` (the limit the run
    trains with: such a task is one it would not train on)."""
    from grooves.policy.context import model_context, over_context, over_limit

    context, limit = model_context(policy), run_config.sampling.max_prompt_length
    lengths = []
    for task_set, tasks in heldout:
        tools = (task_set.env.tool_schemas() or None) if task_set.env is not None else None
        lengths += [(str(t.get("id")), len(policy.chat_ids(task_set.render(t), tools=tools))) for t in tasks]
    over = [(task, n) for task, n in lengths if n > context]
    if over:
        task, n = max(over, key=lambda pair: pair[1])
        raise EvalError(f"candidate {name}: {len(over)} of {len(lengths)} held-out prompts are longer than the "
                        f"model's context; the longest, {over_context(f'task {task}: the prompt', n, context)}")
    said = [over_limit(f"task {task}: the prompt", n, limit, "sampling.max_prompt_length") for task, n in lengths]
    return [f"candidate {name}: {line}" for line in said if line]


def _endpoint(candidate: Candidate, run_config, heldout, tick: Callable[[str, int], None]) -> Result:
    from openai import OpenAI, OpenAIError

    key = os.environ.get(candidate.api_key_env, "") if candidate.api_key_env else ""
    client = OpenAI(base_url=candidate.endpoint, api_key=key or "none", max_retries=1, timeout=600)
    sampling = _sampling(run_config)
    groups, latencies, speeds, tokens = [], [], [], []
    for task_set, tasks in heldout:
        scored = []
        for task in tasks:
            start = time.perf_counter()
            try:
                if task_set.env is None:
                    trajectory, used = _endpoint_answer(client, candidate, task_set.render(task), sampling)
                else:
                    trajectory, used = _endpoint_rollout(client, candidate, task_set.env, task, sampling)
            except OpenAIError as error:
                raise EvalError(f"candidate {candidate.name} at {candidate.endpoint}: {error}") from None
            seconds = time.perf_counter() - start
            latencies.append(seconds)
            speeds.append(used[1] / seconds)
            tokens.append(used)
            scored.append(Group(task=task, trajectories=[trajectory]))
            tick(candidate.name, 1)
        task_set.reward.score(scored)
        groups += scored
    return _result(candidate, "endpoint", groups, latencies, speeds, tokens,
                   any(ts.env is not None for ts, _ in heldout))


def _create(client, candidate: Candidate, messages: list[dict], sampling, max_tokens: int, tools=None):
    extra = {"tools": tools} if tools else {}
    if tools and candidate.tool_choice is not None:
        extra["tool_choice"] = candidate.tool_choice
    reply = client.chat.completions.create(
        model=candidate.model, messages=messages, temperature=sampling.temperature, top_p=sampling.top_p,
        max_tokens=max_tokens, stop=list(sampling.stop) or None, seed=sampling.seed, **extra)
    usage = reply.usage
    return reply.choices[0], (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)


def _endpoint_answer(client, candidate: Candidate, messages: list[dict], sampling) -> tuple[Trajectory, tuple]:
    """A single-turn task: one chat completion, scored like a local completion (no token ids)."""
    choice, used = _create(client, candidate, messages, sampling, sampling.max_new_tokens)
    trajectory = Trajectory([*messages, {"role": "assistant", "content": choice.message.content or ""}], [], [], [],
                            [], finish_reason="length" if choice.finish_reason == "length" else "stop")
    return trajectory, used


def _endpoint_rollout(client, candidate: Candidate, env, task, sampling) -> tuple[Trajectory, tuple]:
    """An env task through the endpoint's chat API with the env's tools: each model turn is one
    chat completion of the conversation so far; its tool calls (the endpoint's ``tool_calls``, or
    calls left in its text) go to the env as the text the env parses, so the env runs, checks and
    counts them exactly as in a local rollout. The same limits apply: ``max_completion_length``
    tokens per turn, ``env.max_turns`` turns and ``env.max_tokens`` generated tokens (the
    endpoint's ``usage``). Tokens are what the endpoint bills: every turn's prompt and completion."""
    from grooves.envs.rollout import trajectory
    from grooves.policy.tools import tool_call_text

    tools = env.tool_schemas() or None
    state = env.reset(task)  # the world a local validation rollout meets (env_groups' seed 0)
    prompt = completion = 0
    try:
        while not env.is_done(state):
            budget = max(1, min(sampling.max_new_tokens, env.max_tokens - completion))
            choice, (p, c) = _create(client, candidate, [_wire(m) for m in state.messages], sampling, budget, tools)
            prompt, completion = prompt + p, completion + c
            calls = "".join(tool_call_text(call.model_dump()) for call in choice.message.tool_calls or [])
            text = "\n".join(part for part in (choice.message.content or "", calls) if part)
            if choice.finish_reason == "length" and completion >= env.max_tokens:  # cut: no answer to read
                state.turns += 1
                state.messages.append({"role": "assistant", "content": text, "raw": text})
                env.finish(state, None, "max_tokens")
                break
            asyncio.run(env.respond(state, text))
            if env.is_done(state):
                break
            if completion >= env.max_tokens:
                env.finish(state, None, "max_tokens")
            elif state.turns >= env.max_turns:
                env.finish(state, None, "max_turns")
        return trajectory(env, state), (prompt, completion)
    finally:
        env.close(state)


def _wire(message: dict) -> dict:
    """A conversation message as OpenAI's API takes it: without grooves' ``raw`` text; an env
    error that answers no call (a malformed one) goes back as a user message, since a ``tool``
    message must answer a call id (and carries nothing else)."""
    if message.get("role") == "tool":
        if not message.get("tool_call_id"):
            return {"role": "user", "content": message.get("content") or ""}
        return {"role": "tool", "tool_call_id": message["tool_call_id"], "content": message.get("content") or ""}
    return {k: v for k, v in message.items() if k != "raw"}


def _result(candidate: Candidate, kind: str, groups: list[Group], latencies: list[float], speeds: list[float],
            tokens: list[tuple[int, int]], env: bool) -> Result:
    trajectories = [t for g in groups for t in g.trajectories]
    totals = [t.reward for t in trajectories]
    names = sorted({name for t in trajectories for name in t.components})
    prompt = statistics.fmean(p for p, _ in tokens) if tokens else 0.0
    completion = statistics.fmean(c for _, c in tokens) if tokens else 0.0
    cost = None
    if candidate.price_in is not None or candidate.price_out is not None:
        cost = 1000 * ((candidate.price_in or 0) * prompt + (candidate.price_out or 0) * completion) / 1e6
    success = None
    if env:
        full = [all(v >= 1 - 1e-9 for v in t.metadata.get("env_scores", {}).values()) for t in trajectories]
        success = sum(full) / len(full) if full else None
    return Result(candidate.name, candidate.model if not candidate.endpoint else f"{candidate.model} @ "
                  f"{candidate.endpoint}", kind, len(trajectories), *mean_se(totals),
                  {name: mean_se([t.components.get(name, math.nan) for t in trajectories]) for name in names},
                  success, sum(math.isnan(v) for v in totals), percentile(latencies, 50), percentile(latencies, 95),
                  statistics.fmean(speeds) if speeds else None, prompt, completion, cost,
                  [_sample(g, t) for g in groups for t in g.trajectories])


def _sample(group: Group, t: Trajectory) -> dict[str, Any]:
    """What eval.json keeps of one answer: the reply, its reward and, for an env task, how it went."""
    sample = {"task_id": str(group.task.get("id")), "completion": t.completion,
              "reward": None if math.isnan(t.reward) else t.reward}
    if "env_scores" in t.metadata:
        state = t.metadata["state"]
        sample.update(env_scores=t.metadata["env_scores"], turns=state["turns"], finish=state["finish"],
                      tool_calls=state["counters"].get("tool_calls", 0))
    return sample


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error (sample standard deviation / √n) of the values that did not fail."""
    scored = [v for v in values if not math.isnan(v)]
    if not scored:
        return None, None
    return statistics.fmean(scored), statistics.stdev(scored) / math.sqrt(len(scored)) if len(scored) > 1 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
