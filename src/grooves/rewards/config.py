"""The ``[reward]`` section: components of every kind, the judges' endpoints, and building them.

Each ``[[reward.components]]`` table has a ``kind`` (default ``"verifier"``): ``verifier``
(a Python function), ``judge`` (pointwise), ``group_judge`` (all G outputs in one call),
``check`` (a yes/no question, logged or weighted), ``reward_model`` (a learned reward
model folder) and ``guard`` (vetoes: ``supported_by_source``, ``lexical_grounding``,
``format``, ``injection``). Judges name an endpoint from ``[reward.endpoints.NAME]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from grooves.config_base import Section


LocalUrl = Callable[[str], str]  # model spec -> base URL of a server over it


class EndpointConfig(Section):
    """An OpenAI-compatible endpoint for judges (OpenAI, vLLM, Ollama, llama.cpp, grooves serve)."""

    base_url: str = Field(description="e.g. 'http://127.0.0.1:8000/v1' (grooves serve), "
                          "'https://api.openai.com/v1', or 'local': grooves serves `model` (a model spec) "
                          "in this process on a free 127.0.0.1 port, a frozen copy apart from the policy.")
    model: str = Field(description="Model name sent with each request.")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="Environment variable holding the API key "
                                    "(none needed for local servers).")
    timeout: float = Field(60.0, gt=0, description="Seconds per request before it is retried.")
    max_retries: int = Field(3, ge=0, description="Retries on timeouts, connection errors, 429 and 5xx.")
    backoff: float = Field(0.5, ge=0, description="First retry delay in seconds; doubles each retry.")
    structured: bool = Field(True, description="Ask for JSON-schema structured output (falls back when refused).")
    temperature: float = Field(0.0, ge=0, description="Judge sampling temperature (0 = deterministic).")
    max_tokens: int = Field(400, ge=16, description="Most tokens per judge reply.")
    seed: int | None = Field(0, description="Seed sent with each request, where the server supports it.")


class _Component(Section):
    name: str | None = Field(None, description="Name in metrics (reward/<name>); default per kind.")
    weight: float = Field(1.0, description="Weight in the total; 0 = logged only.")
    required: bool = Field(True, description="If it fails, leave the trajectory out of the advantage.")


class VerifierConfig(_Component):
    kind: Literal["verifier"] = Field("verifier", description="A plain Python function.")
    function: str = Field(description="'module:function' or 'path/to/file.py:function'.")


class _JudgeBase(_Component):
    endpoint: str = Field(description="Name of a [reward.endpoints.NAME] table.")
    input: str | None = Field(None, description="What the judge sees as the input: a task column, a format "
                              "string over the columns, or (default) the task's user message.")
    max_reason_chars: int = Field(240, ge=8, description="Longest reason the judge may write.")
    conversation: bool = Field(False, description="Show the judge each trajectory's whole conversation (every "
                               "turn after the first user turn, tool calls and tool results included) instead "
                               "of its last reply, cut to max_chars by the rule in docs/rewards.md.")
    max_chars: int | None = Field(None, ge=80, description="With conversation = true: the conversation's budget "
                                  "in characters (default 8000); older turns past it are left out, marked.")

    @model_validator(mode="after")
    def _conversation_only(self) -> _JudgeBase:
        if self.max_chars is not None and not self.conversation:
            raise ValueError("max_chars is only for conversation = true")
        return self


class JudgeConfig(_JudgeBase):
    kind: Literal["judge"] = Field("judge", description="Pointwise LLM judge: reason, then a score.")
    rubric: str = Field(description="Rubric text, or a path to a rubric .toml file.")
    low: float = Field(0.0, description="Lowest score the judge may give.")
    high: float = Field(10.0, description="Highest score the judge may give.")
    normalize: bool = Field(True, description="Map [low, high] to [0, 1].")


class GroupJudgeConfig(_JudgeBase):
    kind: Literal["group_judge"] = Field("group_judge", description="All G outputs scored in one call, in [0, 1].")
    rubric: str = Field(description="Rubric text, or a path to a rubric .toml file.")
    two_orders: bool = Field(False, description="Score a second, reversed order too and average (damps "
                             "position bias; twice the calls).")


class CheckConfig(_JudgeBase):
    kind: Literal["check"] = Field("check", description="A yes/no LLM question: 1.0 for yes, 0.0 for no.")
    question: str = Field(description="The question about each output.")
    passes_on: Literal["yes", "no"] = Field("yes", description="The answer that scores 1.0.")


class RewardModelConfig(_Component):
    kind: Literal["reward_model"] = Field("reward_model", description="A learned reward model (grooves rm train).")
    path: str = Field(description="The reward model folder.")
    input: str = Field("{completion}", description="Format string over the completion and task columns.")
    scale: Literal["z", "sigmoid"] | None = Field(None, description="None: the model's raw score; 'z': "
                                                  "standardised by its scores on its training rows; 'sigmoid': "
                                                  "that z mapped into (0, 1).")


class GuardConfig(_Component):
    kind: Literal["guard"] = Field("guard", description="A veto: when it fails the total becomes `floor`.")
    guard: Literal["supported_by_source", "lexical_grounding", "format", "injection"] = Field(
        description="Which guard.")
    floor: float = Field(0.0, description="The total of a vetoed trajectory.")
    source: str | None = Field(None, description="Task column holding the source text (default: the user message).")
    endpoint: str | None = Field(None, description="supported_by_source: name of a [reward.endpoints.NAME] table.")
    max_reason_chars: int = Field(240, ge=8, description="supported_by_source: longest reason the judge may write.")
    pattern: str | None = Field(None, description="format: a regular expression the whole output must match.")
    json_schema: dict[str, Any] | None = Field(None, description="format: a JSON schema the output must satisfy.")
    allow_empty: bool | None = Field(None, description="lexical_grounding: let an output with no words "
                                     "pass (default: it fails).")
    patterns: list[str] | None = Field(None, description="injection: regular expressions (case-insensitive) "
                                       "that veto an output when found; default: the built-in list.")

    @model_validator(mode="after")
    def _needs(self) -> GuardConfig:
        if self.guard == "supported_by_source" and not self.endpoint:
            raise ValueError("guard 'supported_by_source' needs endpoint = '<name of a [reward.endpoints] table>'")
        if self.guard == "format" and (self.pattern is None) == (self.json_schema is None):
            raise ValueError("guard 'format' needs exactly one of pattern or json_schema")
        own = {"endpoint": "supported_by_source", "pattern": "format", "json_schema": "format",
               "patterns": "injection", "allow_empty": "lexical_grounding"}
        for key, guard in own.items():
            if getattr(self, key) is not None and self.guard != guard:
                raise ValueError(f"{key} is only for guard '{guard}', not '{self.guard}'")
        return self


COMPONENT_KINDS = {"verifier": VerifierConfig, "judge": JudgeConfig, "group_judge": GroupJudgeConfig,
                   "check": CheckConfig, "reward_model": RewardModelConfig, "guard": GuardConfig}


def _kind(value: Any) -> str:
    return value.get("kind", "verifier") if isinstance(value, dict) else getattr(value, "kind", "verifier")


ComponentConfig = Annotated[
    Union[tuple(Annotated[model, Tag(kind)] for kind, model in COMPONENT_KINDS.items())],  # noqa: UP007
    Discriminator(_kind, custom_error_type="unknown_kind",
                  custom_error_message=f"kind must be one of: {', '.join(COMPONENT_KINDS)}"),
]


class RewardConfig(Section):
    builtin: str | None = Field(None, description="Use a built-in task's reward, e.g. 'titles'.")
    components: list[ComponentConfig] = Field(default_factory=list, description="Reward components "
                                              "([[reward.components]] tables).")
    endpoints: dict[str, EndpointConfig] = Field(default_factory=dict, description="Judge endpoints by name "
                                                 "([reward.endpoints.NAME] tables).")
    max_concurrency: int = Field(16, ge=1, description="Judge requests and async verifier calls in flight at once.")
    cache: str | None = Field(None, description="SQLite file caching judge replies across runs (default: "
                              "in memory for the run).")

    @model_validator(mode="after")
    def _complete(self) -> RewardConfig:
        if not self.builtin and not self.components:
            raise ValueError("give a built-in reward (builtin = 'titles') or at least one [[reward.components]]")
        for index, component in enumerate(self.components):
            endpoint = getattr(component, "endpoint", None)
            if endpoint is not None and endpoint not in self.endpoints:
                defined = ", ".join(self.endpoints) or "none"
                raise ValueError(f"components.{index}.endpoint: unknown endpoint {endpoint!r}; "
                                 f"defined [reward.endpoints.NAME] tables: {defined}")
        return self


def build_components(config: RewardConfig, local_url: LocalUrl | None = None) -> list:
    """The components a config describes; raises ``(index, error)`` as ComponentBuildError.

    ``local_url(model)`` gives the URL of a server for endpoints whose ``base_url`` is ``local``.
    """
    from grooves.rewards import Endpoint, JudgeCache

    cache = JudgeCache(config.cache) if config.cache else JudgeCache()  # shared by the run's judges
    used = {getattr(c, "endpoint", None) for c in config.components}
    endpoints = {name: Endpoint(**{**e.model_dump(), "base_url": endpoint_url(e, local_url)})
                 for name, e in config.endpoints.items() if name in used}
    components = []
    for index, item in enumerate(config.components):
        try:
            components.append(_build(item, endpoints, cache, None))
        except (ValueError, ImportError, FileNotFoundError, re.error) as error:
            raise ComponentBuildError(index, item, error) from None
    return components


class ComponentBuildError(ValueError):
    def __init__(self, index: int, item, error: Exception):
        field = "function" if item.kind == "verifier" else ("rubric" if hasattr(item, "rubric") else item.kind)
        if isinstance(error, re.error):
            error = f"not a valid regular expression: {error}"
        super().__init__(f"components.{index}.{field}: {error}")


def _build(c, endpoints: dict, cache, base: Path | None):
    from grooves.rewards import (
        Component, FormatGuard, GroupJudge, InjectionGuard, LexicalGrounding, PointwiseJudge, YesNoCheck,
        import_object, supported_by_source,
    )

    common = {"weight": c.weight, "required": c.required}
    judge = {"input": getattr(c, "input", None), "cache": cache,
             "max_reason_chars": getattr(c, "max_reason_chars", 240), **common}
    if getattr(c, "conversation", False):
        judge.update(conversation=True, max_chars=c.max_chars or 8000)
    if c.kind == "verifier":
        fn = import_object(c.function)
        return Component(c.name or fn.__name__, fn, **common)
    if c.kind == "judge":
        return PointwiseJudge(c.name or "judge", _rubric(c.rubric, base), endpoints[c.endpoint], low=c.low,
                              high=c.high, normalize=c.normalize, **judge)
    if c.kind == "group_judge":
        return GroupJudge(c.name or "group_judge", _rubric(c.rubric, base), endpoints[c.endpoint],
                          two_orders=c.two_orders, **judge)
    if c.kind == "check":
        return YesNoCheck(c.name or "check", c.question, endpoints[c.endpoint], passes_on=c.passes_on, **judge)
    if c.kind == "reward_model":
        from grooves.rewards.models import RewardModelComponent

        return RewardModelComponent(c.name or "reward_model", str(_path(c.path, base)), input=c.input,
                                    scale=c.scale, **common)
    guard = {"floor": c.floor, "required": c.required}
    if c.guard == "supported_by_source":
        return supported_by_source(endpoints[c.endpoint], name=c.name or "supported", source=c.source,
                                   cache=cache, max_reason_chars=c.max_reason_chars, **guard)
    if c.guard == "lexical_grounding":
        return LexicalGrounding(c.name or "grounded_terms", source=c.source, allow_empty=bool(c.allow_empty), **guard)
    if c.guard == "format":
        return FormatGuard(c.name or "format", pattern=c.pattern, json_schema=c.json_schema, **guard)
    if c.patterns is not None:
        guard["patterns"] = tuple(c.patterns)
    return InjectionGuard(c.name or "no_judge_talk", **guard)


def endpoint_url(endpoint: EndpointConfig, local_url: LocalUrl | None = None) -> str:
    """The endpoint's URL; ``local`` asks ``local_url`` for a server over ``model``.

    Starting that server belongs to the serving room (``grooves.serve.local.local_url``), above this
    one: the caller hands it in, so building a reward never imports a server.
    """
    if endpoint.base_url != "local":
        return endpoint.base_url
    if local_url is None:
        raise ValueError(f"base_url 'local' (model {endpoint.model!r}) needs a local server, and none was given")
    return local_url(endpoint.model)


def _path(value: str, base: Path | None) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() or base is None else base / path


def _rubric(value: str, base: Path | None):
    """A rubric file (``*.toml``) is loaded as a Rubric; any other text is the rubric itself."""
    if value.endswith(".toml"):
        path = _path(value, base)
        if not path.is_file():
            raise FileNotFoundError(f"rubric file {path} does not exist")
        from grooves.rewards.rubric import Rubric

        return Rubric.load(path)
    return value
