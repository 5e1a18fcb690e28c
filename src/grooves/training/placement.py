"""Where a run samples and trains, when not all in this process: ``[ray]`` rollout workers,
``[backend]`` a Tinker-compatible training service, ``[sampler]`` an inference engine."""

from __future__ import annotations

from pydantic import Field, field_validator

from grooves.config_base import Section


class RayConfig(Section):
    """Rollouts on Ray workers (``grooves train CONFIG --ray [ADDRESS]``); see docs/scale.md."""

    address: str | None = Field(None, description="A running cluster ('HOST:PORT' of `ray start --head`, or "
                                "'auto'); None = start a local Ray instance on this machine.")
    workers: int = Field(2, ge=1, description="Rollout workers (Ray actors), each with a sampler copy of the "
                         "policy, the task sets and the reward components.")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs Ray reserves for each worker (its torch threads).")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs Ray reserves for each worker (0 = sample on CPU).")


class BackendConfig(Section):
    """Sample and train through a Tinker-compatible service (``grooves.backend.client``)."""

    url: str = Field(description="The service's base URL, e.g. 'http://127.0.0.1:8100' for `grooves backend "
                     "serve`. The API key is read from $TINKER_API_KEY, never from the config.")
    model: str | None = Field(None, description="Base model name on the service (default: model.spec).")
    rank: int | None = Field(None, ge=1, description="LoRA rank of the remote adapter (default: lora.rank).")


class EngineConfig(Section):
    """Sample rollouts through an inference engine's OpenAI server (vLLM's API; `grooves serve` too)."""

    url: str | list[str] = Field(description="The server's base URL, e.g. 'http://127.0.0.1:8000/v1', or a list "
                                 "of several engines that take requests in turn (each version is loaded into "
                                 "each). It must answer /v1/completions with token-id prompts and vLLM's "
                                 "return_token_ids, and /v1/load_lora_adapter (vLLM: "
                                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, --enable-lora, --logprobs-mode "
                                 "processed_logprobs).")
    api_key_env: str | None = Field(None, description="Environment variable holding the server's API key "
                                    "(none: no key).")
    max_concurrency: int = Field(8, ge=1, description="Requests in flight at once.")
    timeout: float = Field(300.0, gt=0, description="Seconds one request may take.")
    max_wait: float = Field(300.0, ge=0, description="Seconds a step retries a server that is down before the "
                            "run stops with an error (nothing is trained twice: a step trains only once "
                            "all its samples are in).")
    adapters: str | None = Field(None, description="Folder where each version's adapter (a PEFT folder) is "
                                 "written for the server to load, as `RUN@STEP`; the server must read it at the "
                                 "same path (default: RUN/engine-adapters).")
    keep: int = Field(3, ge=1, description="Adapter versions kept loaded on the server (older ones are unloaded).")

    @property
    def urls(self) -> list[str]:
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @field_validator("url")
    @classmethod
    def _some_url(cls, value):
        if isinstance(value, list) and (not value or len(set(value)) != len(value)):
            raise ValueError("give one URL or a list of distinct URLs")
        return value
