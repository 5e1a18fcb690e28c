"""Rollouts sampled by an inference engine (``[sampler] url``): vLLM, or ``grooves serve`` in the tests.

The trainer stays in this process. Each time it publishes a version (the start, then every update)
the adapter is written as a PEFT folder and loaded into the engine under a versioned name,
``RUN@STEP``, with vLLM's ``POST /v1/load_lora_adapter``; the rollouts of a version sample that
name, so each trajectory records exactly which weights made it (``policy_version`` and
``metadata["sampler_model"]``). The newest ``keep`` versions stay loaded; older ones are unloaded
and their folders removed.

The trainer treats the engine as another numerics (``remote_sampler``): the truncated importance
correction is on and ``train/sampler_kl`` feeds the ``sampler`` detector, which fires when the
engine samples other weights than the ones it was given.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from grooves.policy.engine import EngineError, EnginePolicy, EngineSampler
from grooves.policy.policy import Policy
from grooves.policy.sampler import Sampling
from grooves.training.placement import EngineConfig
from grooves.training.pipeline.local import LocalRollouts
from grooves.types import Group


class EngineRollouts(LocalRollouts):
    """``LocalRollouts`` whose policy view samples through the engine; ``snapshot`` publishes a version."""

    def __init__(self, config: EngineConfig, policy: Policy, sets: list, group_size: int, sampling: Sampling,
                 generator: torch.Generator, run_dir: Path, version: Callable[[], int]):
        """``version()``: the trainer's step, the version a ``snapshot`` publishes."""
        self.config = config
        self.current_version = version
        self.run_name = run_dir.name
        self.folder = Path(config.adapters) if config.adapters else run_dir / "engine-adapters"
        self.engines = Engines(config)
        self.clients = self.engines.clients
        self.loaded: dict[str, Path] = {}  # served name -> its adapter folder, oldest first
        self.sampler = EngineSampler(policy, self.clients, "", max_concurrency=config.max_concurrency,
                                     max_wait=config.max_wait, on_missing=self.reload)
        super().__init__(EnginePolicy(policy, self.sampler), sets, group_size, sampling, generator)
        self.trainer_policy = policy

    def snapshot(self) -> str:
        """Write the current version's adapter and load it into the engine; its served name."""
        version = self.current_version()
        name = f"{self.run_name}@{version}"
        folder = self.folder / f"step-{version:06d}"
        if folder.exists():
            shutil.rmtree(folder)  # a resumed run writes this version again
        self.trainer_policy.save_adapter(folder)
        for engine in range(len(self.clients)):
            self.engines.load(engine, name, folder)
        self.loaded.pop(name, None)
        self.loaded[name] = folder
        self.gap = max(self._probe(name, engine) for engine in range(len(self.clients)))
        while len(self.loaded) > self.config.keep:
            old, old_folder = next(iter(self.loaded.items()))
            for engine in range(len(self.clients)):
                self.engines.post(engine, "/unload_lora_adapter", {"lora_name": old})  # a 404 (already gone) is fine
            shutil.rmtree(old_folder, ignore_errors=True)
            del self.loaded[old]
        return name

    def _probe(self, name: str, engine: int) -> float:
        """The mean absolute difference between an engine's and the trainer's log-probs of a fixed
        probe under ``name`` (vLLM's ``prompt_logprobs``): near 0 when the engine serves these weights."""
        policy = self.trainer_policy
        ids = policy.chat_ids([{"role": "user", "content": "Probe: list three colours and a number."}])
        reply = self.sampler._call(dict(model=name, prompt=ids, max_tokens=1, temperature=0,
                                        extra_body={"prompt_logprobs": 0}), engine)
        served = reply.choices[0].model_extra.get("prompt_logprobs") or reply.model_extra.get("prompt_logprobs")
        if not served:
            raise EngineError("sampler.url: the server does not answer vLLM's prompt_logprobs")
        theirs = torch.tensor([served[i][str(token)]["logprob"] for i, token in enumerate(ids) if i > 0])
        was_training = policy.model.training
        policy.model.eval()
        try:
            with torch.no_grad():
                logits = policy.causal_lm(input_ids=torch.tensor([ids], device=policy.device)).logits[0, :-1]
        finally:
            policy.model.train(was_training)
        ours = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:], device=logits.device)[:, None])
        return (ours[:, 0].cpu() - theirs).abs().mean().item()

    def apply(self, version: int, state: str) -> None:
        self.sampler.model = state
        self.version = version

    def rollout(self, drawn: list[tuple], step: int, round_: int, reports) -> list[Group]:
        groups = super().rollout(drawn, step, round_, reports)
        for trajectory in (t for g in groups for t in g.trajectories):
            trajectory.metadata["sampler_model"] = self.sampler.model
        return groups

    def latest(self) -> EnginePolicy:
        """The newest published version as a policy view (held-out validation samples it)."""
        sampler = EngineSampler(self.trainer_policy, self.clients, next(reversed(self.loaded)),
                                max_concurrency=self.config.max_concurrency, max_wait=self.config.max_wait,
                                on_missing=self.reload)
        return EnginePolicy(self.trainer_policy, sampler)

    def reload(self, name: str, engine: int) -> None:
        """A restarted engine lost its runtime adapters: load ``name`` into it again from its folder."""
        if name not in self.loaded:
            raise EngineError(f"sampler.url: the server has no model {name!r}, and it is not a version this run "
                              f"published")
        self.engines.load(engine, name, self.loaded[name])

    def close(self) -> None:
        self.engines.close()


class Engines:
    """The engines of ``[sampler]``: an openai client (completions) and an HTTP client (vLLM's adapter
    routes) for each URL. The API key is read from ``api_key_env`` in this process."""

    def __init__(self, config: EngineConfig):
        import openai

        key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self.config = config
        self.clients = [openai.OpenAI(base_url=url, api_key=key or "none", timeout=config.timeout, max_retries=0)
                        for url in config.urls]
        self.http = [httpx.Client(base_url=url.rstrip("/"), timeout=config.timeout,
                                  headers={"Authorization": f"Bearer {key}"} if key else {}) for url in config.urls]

    def load(self, engine: int, name: str, folder: Path) -> None:
        """``load_lora_adapter`` of ``folder`` as ``name`` (in place when the name is loaded already)."""
        body = {"lora_name": name, "lora_path": str(Path(folder).resolve())}
        response = self.post(engine, "/load_lora_adapter", body)
        if response.status_code == 400 and "already been loaded" in response.text:
            response = self.post(engine, "/load_lora_adapter", {**body, "load_inplace": True})
        if response.status_code != 200:
            raise EngineError(f"sampler.url: {self.config.urls[engine]} did not load adapter {name!r} from {folder} "
                              f"({response.status_code}): {response.text[:500]}")

    def post(self, engine: int, path: str, body: dict) -> httpx.Response:
        """POST to an engine's adapter route, retried while it is down or restarting (up to ``max_wait``)."""
        deadline, delay = time.monotonic() + self.config.max_wait, 0.5
        while True:
            try:
                response = self.http[engine].post(path, json=body)
            except httpx.TransportError as error:
                if time.monotonic() + delay > deadline:
                    raise EngineError(f"sampler.url: the server did not answer {path} for "
                                      f"{self.config.max_wait:.0f} s ({type(error).__name__}: {error})") from None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if response.status_code in (502, 503, 504) and time.monotonic() + delay <= deadline:
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            return response

    def close(self) -> None:
        for http, client in zip(self.http, self.clients):
            http.close()
            client.close()
