"""A hand-driven run: one object owns the model, serves it, and trains it on groups made anywhere.

``TrainingSession`` is grooves' own Python loop for agents that call an OpenAI client::

    session = TrainingSession("my-agent", model="bundled:smollm2-135m-instruct")
    client = session.async_client()            # openai.AsyncOpenAI, answered by RUN@latest
    groups = await gather_groups(one_group(task) for task in tasks)
    session.train(groups)                      # grooves' advantages, loss and update

The model is loaded once: the in-process ``grooves serve`` (``grooves.serve.app``) samples from
the very adapter the ``Trainer`` updates, and both run on the server engine's one worker thread,
so a request never sees half an update. ``RUN@latest`` resolves from the first line (checkpoint 0
is written when the session opens). Given ``server_url``, the session talks to a running
``grooves serve`` instead and writes each checkpoint where that server's runs root reads it.

The run folder is the one ``grooves train`` writes (``config.toml``, ``metrics.jsonl``,
``run.sqlite``, ``checkpoints/``), so ``grooves runs``, ``review``, the dashboard and the
detectors see it. A step skipped because no group had reward variance is printed as such;
``no_signal_alert_after`` such steps in a row raise the ``no_signal`` alert.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from grooves.algorithms import has_signal
from grooves.algorithms.presets import preset
from grooves.monitors import Monitors
from grooves.policy.checkpoints import runs_root
from grooves.runs.lock import RunLock
from grooves.runs.store import RunStore
from grooves.serve.adapters import AdapterRegistry, Resolved
from grooves.serve.capture import AsyncRecorder, Recorder
from grooves.training import checkpoint as ckpt
from grooves.training.alerting import AlertHandling
from grooves.training.build import load_policy
from grooves.training.config import RunConfig, parse_config
from grooves.training.gather import completion_stats
from grooves.training.runfolder import begin, resume_point
from grooves.training.trainer import Trainer
from grooves.types import Group

PLACEHOLDER = "<python: the session's caller>"  # tasks and reward live in the caller's code


class RunHalted(RuntimeError):
    """An alert whose policy is 'pause' or 'stop' fired; the checkpoint of the step is saved."""


class LiveRegistry(AdapterRegistry):
    """The server's adapters, where the newest checkpoint of the session's run is the trainer's own
    adapter in memory (no second copy); older checkpoints load from disk as usual."""

    def __init__(self, policy, runs: Path, run_name: str, live_adapter: str, **kwargs):
        super().__init__(policy, runs, **kwargs)
        self.run_name = run_name
        self.live_adapter = live_adapter
        self.live_step: int | None = None  # the step the live adapter equals on disk; None mid-update

    def acquire(self, resolved: Resolved, in_use: set[str]) -> str:
        checkpoint = resolved.checkpoint
        if (checkpoint is not None and self.live_step is not None and resolved.step == self.live_step
                and checkpoint.parent.parent.resolve() == (self.runs / self.run_name).resolve()):
            return self.live_adapter
        return super().acquire(resolved, in_use)

    def unload_others(self) -> None:
        """Unload the adapters loaded from disk (they load again on demand): a checkpoint saves every
        adapter the model holds, and should hold only the trainer's."""
        for key in list(self._loaded):
            self._unload(self._loaded.pop(key))


class TrainingSession(AlertHandling):
    def __init__(self, name: str, model: str | None = None, *, config: RunConfig | dict | None = None,
                 algorithm: str | None = None, runs: str | Path | None = None, resume: bool = False,
                 server_url: str | None = None, api_key: str | None = None, console: Console | None = None,
                 no_signal_alert_after: int = 3, token_ids_by_default: bool = False):
        """``model``: a model spec (default: the config's ``model.spec``); ``config``: a ``RunConfig``
        or a dict shaped like the TOML file, for everything else (lora, optim, monitors, alerts);
        ``algorithm``: a preset name; ``server_url``/``api_key``: a running ``grooves serve`` to
        sample from instead of the in-process one (it must read the same runs root);
        ``token_ids_by_default``: the in-process server returns token ids to every chat completion
        (``grooves.serve.capture.TokenIdsByDefault``), for clients that cannot ask for them."""
        self.config = _session_config(name, model, config, algorithm)
        self.console = console or Console(stderr=True)
        self.run_dir = runs_root(runs) / self.config.name
        self.resume_command = f"TrainingSession({self.config.name!r}, ..., resume=True)"
        self.no_signal_alert_after = no_signal_alert_after
        self.acknowledged: set[str] = set()
        self.stop_rule, self.evaluations, self._halt = None, {}, None
        self._reported_errors: set[tuple[str, str]] = set()
        self._server = self._http = None
        self.base_url, self.api_key = server_url, api_key or "local"
        self._lock = RunLock(self.run_dir)
        self._lock.__enter__()
        try:
            self._open(resume, runs, api_key, token_ids_by_default)
        except BaseException:
            self._stop_server()
            self._lock.__exit__(None, None, None)
            raise

    def _open(self, resume: bool, runs: str | Path | None, api_key: str | None, token_ids_by_default: bool) -> None:
        """Check the folder, load the model and the trainer (from the newest checkpoint on resume),
        write the config and checkpoint 0 of a new run, and start serving."""
        latest = resume_point(self.run_dir, resume, self.resume_command, self.console)
        self.store = RunStore(self.run_dir)
        self.policy = load_policy(self.config, runs)
        c = self.config
        self.trainer = Trainer(self.policy, c.algorithm, c.optim, temperature=c.sampling.temperature,
                               max_completion_length=c.sampling.max_completion_length, total_steps=c.steps,
                               use_sampler_logprobs=c.train.use_sampler_logprobs, kl_every=c.log.kl_every,
                               max_staleness=c.train.max_staleness, minibatches=c.train.minibatches)
        self.monitors = Monitors(c.monitors)
        self.failed_steps = self.no_signal_steps = 0
        start = self._restore(latest) if latest is not None else 0
        self.sinks = begin(self.store, self.config, start)
        self.store.metrics_path.touch()  # the run folder is whole from the first line
        if self.base_url is None:
            self._serve(api_key, token_ids_by_default)
        if latest is None:
            self._on_model(lambda: self._save(0))

    # --- where the model is sampled --------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def step(self) -> int:
        """Updates made so far: the newest checkpoint is ``NAME@step``."""
        return self.trainer.step

    @property
    def model_name(self) -> str:
        """What to pass as ``model=``: the newest checkpoint, followed after every step."""
        return f"{self.name}@latest"

    def client(self, **kwargs):
        """An ``openai.OpenAI`` client on the server."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def async_client(self, **kwargs):
        """An ``openai.AsyncOpenAI`` client on the server."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def recorder(self) -> Recorder:
        """A ``Recorder`` over a new sync client: its calls become trajectories with the exact ids."""
        return Recorder(self.client())

    def async_recorder(self, client=None) -> AsyncRecorder:
        """An ``AsyncRecorder`` (over ``client`` or a new async client)."""
        return AsyncRecorder(client or self.async_client())

    def add_alias(self, alias: str, checkpoint: str | None = None) -> None:
        """Serve ``checkpoint`` (default: ``NAME@latest``, followed after every step) as ``alias`` too."""
        if self._server is None:
            raise RuntimeError("aliases of a running grooves serve are set with POST /v1/adapters")
        self._server.registry.add_alias(alias, checkpoint or self.model_name)

    def _serve(self, api_key: str | None, token_ids_by_default: bool) -> None:
        from grooves.serve.app import ServerThread, create_app
        from grooves.serve.capture import TokenIdsByDefault
        from grooves.serve.engine import Engine
        from grooves.serve.server import Server

        registry = LiveRegistry(self.policy, self.run_dir.parent, self.name, self.policy.model.active_adapter)
        engine = Engine(self.policy, registry).start()
        self._server = Server(self.policy, registry, engine, api_key=api_key)
        app = create_app(self._server)
        if token_ids_by_default:
            app = TokenIdsByDefault(app, self._server.max_body_bytes)
        self._http = ServerThread(app).__enter__()
        self.base_url = self._http.base_url

    def on_model(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` where the model may be changed: the engine's worker thread, between batches
        (here, when there is no in-process server). The trainer's adapter is the active one."""
        def activated() -> Any:
            if self._server is not None:
                registry = self._server.registry
                registry.live_step = None  # the live adapter may stop equalling the newest checkpoint
                self.policy.model.set_adapter(registry.live_adapter)  # serving may have switched adapters
            return fn()
        return self._on_model(activated)

    def _on_model(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` where the model may be changed: the engine's worker thread, between batches."""
        if self._server is None:
            return fn()
        return self._server.engine.control(fn).result()

    # --- training ----------------------------------------------------------------------

    def train(self, groups: list[Group], *, learning_rate: float | None = None) -> dict[str, float]:
        """One update from scored groups (``trajectory.reward`` set; NaN = failed); returns its metrics.

        The groups, the metrics and the alerts are recorded, then checkpoint ``NAME@STEP`` is written
        and served. ``learning_rate``: this step's and later ones' (default: the config's).
        Raises ``RunHalted`` when an alert's policy pauses or stops the run."""
        if self._halt is not None:
            raise RunHalted(f"the run was halted: {self._halt[1]}")
        groups = [g for g in groups if g.trajectories]
        if not groups:
            raise ValueError("train() needs at least one group with trajectories")
        if learning_rate is not None:
            self.trainer.optim = self.trainer.optim.model_copy(update={"learning_rate": learning_rate})
        step = self.trainer.step + 1
        metrics = step_metrics(groups)
        metrics.update(self.on_model(lambda: self.trainer.train_step(groups)))
        self.store.record_groups(step, groups)
        self._explain_skip(step, groups, metrics)
        if metrics.get("alerts/nan_loss"):
            self._alert(step, "nan_loss", "Loss or gradient was not finite: the step was skipped and the "
                        "adapter left unchanged.", {"reward/total": metrics.get("reward/total")})
        self._check_failed(step, groups, {}, metrics)
        self._watch(step, groups, metrics)
        self.store.log_metrics(step, metrics)
        self.sinks.log(step, metrics)
        self._on_model(lambda: self._save(step))
        self.console.print(f"step {step}: reward {_fmt(metrics.get('reward/total'))}"
                           + (" (skipped)" if metrics.get("train/skipped") else ""), highlight=False)
        if self._halt is not None:
            self._announce_halt(step)
            raise RunHalted(self._halt[1])
        return metrics

    def end_step(self, metrics: dict[str, float]) -> int:
        """Close a step made with ``on_model`` by hand (e.g. SFT batches): count it, log ``metrics``,
        write and serve its checkpoint. Returns the step."""
        step = self.trainer.step = self.trainer.step + 1
        self.store.log_metrics(step, metrics)
        self.sinks.log(step, metrics)
        self._on_model(lambda: self._save(step))
        return step

    def _explain_skip(self, step: int, groups: list[Group], metrics: dict[str, float]) -> None:
        """Say why a step trained nothing; alert after several in a row for want of reward variance."""
        flat = metrics.get("frac_reward_zero_std") == 1.0
        if not (metrics.get("train/skipped") and flat):
            self.no_signal_steps = 0
            return
        self.no_signal_steps += 1
        sizes = ", ".join(str(len(g.trajectories)) for g in groups)
        self.console.print(f"[yellow]step {step} skipped[/]: no group had reward variance ({len(groups)} groups of "
                           f"{escape(sizes)}; every reward equal within each), so there was nothing to learn",
                           highlight=False)
        if self.no_signal_steps == self.no_signal_alert_after:
            metrics["alerts/no_signal"] = 1.0
            self._alert(step, "no_signal", f"{self.no_signal_steps} steps in a row trained nothing: no group had "
                        f"reward variance. Make the tasks harder or easier, the groups larger, or the reward "
                        f"finer-grained.", {"steps_in_a_row": self.no_signal_steps,
                                            "rewards": [g.rewards for g in groups][:4]})

    # --- the run folder ------------------------------------------------------------------

    def _restore(self, latest: Path) -> int:
        generator = torch.Generator(device=self.policy.device)
        trainer_state, state = ckpt.load_checkpoint(latest, self.policy, generator)
        self.trainer.load_state_dict(trainer_state)
        self.monitors.load_state_dict(state.get("monitors", {}))
        self.acknowledged |= set(state.get("acknowledged", []))
        self.failed_steps = state.get("failed_steps", 0)
        self.store.truncate_after(state["step"])
        self.console.print(f"[bold]grooves[/]: resuming {escape(self.name)} after step {state['step']}")
        return state["step"]

    def _save(self, step: int) -> None:
        if self._server is not None:
            self._server.registry.unload_others()
        generator = torch.Generator(device=self.policy.device)
        ckpt.save_checkpoint(self.run_dir, step, self.policy, self.trainer.state_dict(), generator,
                             {"tasks": {"draws": 0, "streams": []}, "run": self.name,
                              "monitors": self.monitors.state_dict(), "acknowledged": sorted(self.acknowledged),
                              "failed_steps": self.failed_steps})
        ckpt.prune(self.run_dir, self.config.log.keep_checkpoints)
        if self._server is not None:
            self._server.registry.live_step = step

    def close(self) -> None:
        """Stop the in-process server and close the run folder (the checkpoints stay)."""
        self._stop_server()
        self.sinks.close()
        self.store.close()
        self._lock.__exit__(None, None, None)

    def _stop_server(self) -> None:
        if self._http is not None:
            self._http.__exit__(None, None, None)
            self._http = None
        if self._server is not None:
            self._server.engine.stop()

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def step_metrics(groups: list[Group]) -> dict[str, float]:
    """What a step's groups say before training: rewards (total and by component), lengths, signal."""
    trajectories = [t for g in groups for t in g.trajectories]
    totals = [t.reward for t in trajectories if not math.isnan(t.reward)]
    metrics = {"reward/total": statistics.fmean(totals) if totals else math.nan,
               "reward/total/std": statistics.pstdev(totals) if len(totals) > 1 else 0.0}
    for name in sorted({n for t in trajectories for n in t.components}):
        values = [v for t in trajectories if not math.isnan(v := t.components.get(name, math.nan))]
        metrics[f"reward/{name}"] = statistics.fmean(values) if values else math.nan
    metrics["completion_len"], metrics["train/truncated_ratio"] = completion_stats(groups)
    rewards = [torch.tensor([r for r in g.rewards if r == r]) for g in groups]
    metrics["frac_reward_zero_std"] = sum(not has_signal(r) for r in rewards) / len(groups)
    metrics["rollout/prefix_breaks"] = float(sum(bool(t.metadata.get("prefix_break")) for t in trajectories))
    return metrics


async def gather_groups(groups: Iterable[Awaitable[Group]], *, max_concurrency: int | None = None,
                        console: Console | None = None, progress: bool = True) -> list[Group]:
    """Await many groups at once (each awaitable makes one ``Group``), with a progress line.

    A group whose coroutine raises is left out and its error printed (the first of each kind),
    so one failed rollout never costs the batch; when every group fails, the first error is raised.
    """
    console = console or Console(stderr=True)
    pending = list(groups)
    limit = asyncio.Semaphore(max_concurrency or len(pending) or 1)
    done: list[Group] = []
    errors: list[BaseException] = []

    async def one(awaitable: Awaitable[Group]) -> None:
        async with limit:
            try:
                done.append(await awaitable)
            except Exception as error:  # noqa: BLE001 - reported below, the batch goes on
                if not any(type(e) is type(error) for e in errors):
                    console.print(f"[yellow]a group failed[/]: {type(error).__name__}: {escape(str(error))}")
                errors.append(error)
        if progress:
            console.print(f"groups {len(done) + len(errors)}/{len(pending)} "
                          f"({len(errors)} failed, {sum(len(g) for g in done)} trajectories)", highlight=False)

    await asyncio.gather(*(one(a) for a in pending))
    if errors and not done:
        raise errors[0]
    return done


def _session_config(name: str, model: str | None, config: RunConfig | dict | None, algorithm: str | None):
    base = config if isinstance(config, RunConfig) else parse_config(
        {"tasks": {"source": PLACEHOLDER}, "reward": {"components": [{"function": PLACEHOLDER, "name": "reward"}]},
         **(config or {})})
    update: dict[str, Any] = {"name": name}
    if model is not None:
        update["model"] = base.model.model_copy(update={"spec": model})
    if algorithm is not None:
        update["algorithm"] = preset(algorithm)
    return RunConfig.model_validate({**base.model_dump(), **update})


def _fmt(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"
