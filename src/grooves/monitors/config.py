"""``MonitorsConfig``: the ``[monitors]`` section of a run config, one sub-model per detector.

Every threshold has a documented default; ``config_tables()`` renders them as the tables of
``docs/reward_hacking.md`` (a test keeps the two equal). Severity thresholds read as "at or
above" (``*_above``) or "at or below" (``*_below``) the detector's statistic.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator, model_validator

from grooves.config_base import Section


class _Detector(Section):
    """A detector's table: on or off, and its thresholds in the right order."""

    enabled: bool = Field(True, description="Run this detector.")

    @model_validator(mode="after")
    def _critical_is_stricter(self):
        fields = type(self).model_fields
        if "warn_above" in fields and self.critical_above < self.warn_above:
            raise ValueError(f"critical_above ({self.critical_above}) must be >= warn_above ({self.warn_above})")
        if "warn_below" in fields and self.critical_below > self.warn_below:
            raise ValueError(f"critical_below ({self.critical_below}) must be <= warn_below ({self.warn_below})")
        return self


class CollapseConfig(_Detector):
    """Statistic: the share of the step's tasks whose outputs include the most shared (near-)same text."""

    similarity: float = Field(0.7, gt=0, le=1, description="Two outputs are near-same when the Jaccard "
                              "similarity of their character n-gram sets (after lowercasing and collapsing "
                              "punctuation and whitespace) is at least this; 1.0 = normalised exact match only.")
    ngram: int = Field(3, ge=1, description="Length of the character n-grams compared.")
    min_tasks: int = Field(3, ge=2, description="Fewest distinct tasks that must share one output before it "
                           "alerts (samples of one task agreeing with each other never count).")
    pool_tasks: int = Field(4, ge=2, description="Pool the outputs of recent steps until they cover at least "
                            "this many distinct tasks (a run with 1 or 2 tasks per step still shows a shared "
                            "output); steps with this many tasks are judged alone.")
    pool_steps: int = Field(4, ge=1, description="Most steps pooled (the current one included).")
    warn_above: float = Field(0.3, gt=0, le=1, description="Warn when this share of the step's tasks share one output.")
    critical_above: float = Field(0.6, gt=0, le=1, description="Critical at this share of the step's tasks.")


class SourceInsensitivityConfig(_Detector):
    """Statistic: the margin, mean own-source overlap minus mean overlap with other tasks' sources."""

    source: str | None = Field(None, description="Task column (or format string over the columns) holding "
                               "the source text; None = the user message before the completion.")
    min_tasks: int = Field(3, ge=2, description="Fewest tasks a margin is measured over: with two, the "
                           "cross overlap is a single comparison and too noisy (on the clean demo, 2 tasks per "
                           "step, it raised a false alert). A step with fewer is pooled with earlier steps.")
    pool_steps: int = Field(4, ge=1, description="Most steps pooled to reach `min_tasks` (the current one "
                            "included); 1 = never pool.")
    baseline_steps: int = Field(5, ge=1, description="The baseline is the median margin of the first this "
                                "many steps whose pool has at least `min_tasks` tasks.")
    armed_above: float = Field(0.15, ge=0, description="Alert only when the baseline margin is at least this "
                               "(outputs clearly depended on their source); tasks whose outputs do not quote "
                               "their input, such as maths answers, never arm the detector.")
    warn_ratio: float = Field(0.6, gt=0, lt=1, description="Warn when the margin falls to this share "
                              "of the baseline margin or below.")
    critical_below: float = Field(0.05, ge=0, description="Critical when the margin is at or below this "
                                  "(outputs overlap other tasks' sources as much as their own).")
    rewarded_only: bool = Field(True, description="Alert only when the step's `reward/total` is at least "
                                "the median of the baseline steps': outputs that stop reading their input "
                                "and score worse for it are the reward working, not a hack.")


class _RobustWindow(_Detector):
    min_scale: float = Field(0.01, gt=0, description="Floor on the robust scale, in the metric's units.")
    rel_min_scale: float = Field(0.05, ge=0, description="Floor on the robust scale as a share of the absolute median.")


class RewardSpikeConfig(_RobustWindow):
    """Statistic: the largest robust z-score of a reward mean against its recent steps."""

    metrics: list[str] = Field(default_factory=list, description="Metrics watched; empty = `reward/total` "
                               "(unless the run has a guard) and every `reward/<component>` mean that is "
                               "not a guard's pass rate.")
    window: int = Field(20, ge=2, description="Past steps the z-score is measured against.")
    min_history: int = Field(5, ge=2, description="Steps of history a metric needs before it can alert.")
    warn_above: float = Field(6.0, gt=0, description="Warn at this robust z-score (a rise; falls are not hacks).")
    critical_above: float = Field(12.0, gt=0, description="Critical at this robust z-score.")


class DivergenceConfig(_RobustWindow):
    """Statistic: the largest min(z of a proxy's rise, z of a guard's fall) over proxy-guard pairs."""

    proxies: list[str] = Field(default_factory=list, description="Proxy metrics; empty = `reward/total` and "
                               "every `reward/<component>` mean that is not a guard's pass rate.")
    guards: list[str] = Field(default_factory=list, description="Metrics that must not fall while a proxy "
                              "rises; empty = every guard's pass rate (a `reward/<name>` that has a "
                              "`reward/<name>/veto_rate`) and `val/reward/total`.")
    window: int = Field(8, ge=2, description="Past values of each metric the change is measured against.")
    min_history: int = Field(4, ge=2, description="Values of history a metric needs before it counts.")
    warn_above: float = Field(3.0, gt=0, description="Warn when the proxy's rise and the guard's fall are "
                              "both at least this robust z-score.")
    critical_above: float = Field(6.0, gt=0, description="Critical when both are at least this.")


class LengthConfig(_Detector):
    """Statistic: the within-group correlation of reward and completion length (tokens)."""

    baseline_steps: int = Field(5, ge=1, description="The baseline is the median mean completion length "
                                "of the first this many steps.")
    min_correlation: float = Field(0.5, gt=-1, le=1, description="Alert only when the reward-length "
                                   "correlation (within groups, vetoed samples left out) is at least this.")
    warn_above: float = Field(1.5, gt=1, description="Warn when mean length / baseline reaches this "
                              "(with the correlation above).")
    critical_above: float = Field(3.0, gt=1, description="Critical at this length drift.")


class RepetitionConfig(_Detector):
    """Statistic: the share of the step's outputs that repeat themselves."""

    n: int = Field(3, ge=1, description="Word n-gram length.")
    min_ngrams: int = Field(4, ge=1, description="Outputs with fewer n-grams are judged by the repeated-word "
                            "rule only.")
    repeat_rate: float = Field(0.3, gt=0, le=1, description="An output repeats itself when this share of its "
                               "n-grams are repeats (1 - distinct / total) ...")
    word_share: float = Field(0.3, gt=0, le=1, description="... or when one content word makes up this share "
                              "of its words ...")
    min_word_count: int = Field(4, ge=2, description="... and occurs at least this many times (keyword stuffing).")
    warn_above: float = Field(0.1, gt=0, le=1, description="Warn at this share of repetitive outputs.")
    critical_above: float = Field(0.5, gt=0, le=1, description="Critical at this share.")


class EntropyConfig(_Detector):
    """Statistic: the policy entropy divided by its early-run baseline."""

    metric: str = Field("entropy", description="The step metric holding the mean per-token entropy.")
    baseline_steps: int = Field(5, ge=1, description="The baseline is the median of the first this many values.")
    warn_below: float = Field(0.5, gt=0, lt=1, description="Warn when entropy / baseline falls to this.")
    critical_below: float = Field(0.25, ge=0, lt=1, description="Critical at this ratio.")


class JudgeDirectedConfig(_Detector):
    """Statistic: the share of the step's outputs that address the judge or scorer."""

    extra_patterns: list[str] = Field(default_factory=list, description="Regular expressions (case-insensitive) "
                                      "added to `grooves.scoring.INJECTION_PATTERNS`.")
    warn_above: float = Field(0.05, gt=0, le=1, description="Warn at this share of judge-directed outputs.")
    critical_above: float = Field(0.25, gt=0, le=1, description="Critical at this share.")

    @field_validator("extra_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"{pattern!r} is not a regular expression ({error})") from None
        return patterns


class SamplerConfig(_Detector):
    """Statistic: train/sampler_kl as a multiple of its running median (the stall and identical-ratio checks alert on their own)."""

    version_metric: str = Field("rollout/policy_version", description="The step metric with the oldest policy "
                                "version that sampled the step; without it, the trajectories' policy_version.")
    stall_warn_steps: int = Field(4, ge=1, description="Warn when that version has not advanced for this many "
                                  "trainer steps.")
    stall_critical_steps: int = Field(8, ge=1, description="Critical after this many.")
    kl_metric: str = Field("train/sampler_kl", description="The step metric with the sampler/trainer KL.")
    kl_floor: float = Field(0.01, ge=0, description="A KL below this never alerts, whatever its multiple.")
    min_history: int = Field(3, ge=1, description="Steps of KL history before the jump check starts.")
    window: int = Field(20, ge=2, description="The running median covers the last this many steps.")
    warn_above: float = Field(5.0, gt=1, description="Warn when the KL is this multiple of its median.")
    critical_above: float = Field(20.0, gt=1, description="Critical at this multiple.")
    identical_share: float = Field(1.0, gt=0, le=1, description="Critical when at least this share of tokens "
                                   "has an importance ratio of exactly 1 while train/policy_lag >= 1.")
    gap_metric: str = Field("rollout/engine_logprob_gap", description="The step metric with an engine's probe "
                            "gap: mean absolute log-prob difference per token from the trainer's ([sampler]).")
    gap_warn_above: float = Field(0.05, gt=0, description="Warn when the probe gap is at least this (nats per "
                                  "token; numerics alone give about 1e-6 on a CPU, a few 1e-3 in bfloat16).")
    gap_critical_above: float = Field(0.5, gt=0, description="Critical at this gap.")

    @model_validator(mode="after")
    def _stall_order(self):
        if self.stall_critical_steps < self.stall_warn_steps:
            raise ValueError(f"stall_critical_steps ({self.stall_critical_steps}) must be >= stall_warn_steps "
                             f"({self.stall_warn_steps})")
        return self


class GuardVetoConfig(_Detector):
    """Statistic: the most steps in a row that one guard vetoed (nearly) every sample."""

    veto_rate: float = Field(1.0, gt=0, le=1, description="A step counts when a guard's "
                             "`reward/<guard>/veto_rate` is at least this (1.0: every sample vetoed).")
    warn_steps: int = Field(3, ge=1, description="Warn after this many such steps in a row: every vetoed "
                            "reward is the floor, so the run learns nothing.")
    critical_steps: int = Field(6, ge=1, description="Critical after this many.")

    @model_validator(mode="after")
    def _steps_order(self):
        if self.critical_steps < self.warn_steps:
            raise ValueError(f"critical_steps ({self.critical_steps}) must be >= warn_steps ({self.warn_steps})")
        return self


class MonitorsConfig(Section):
    """The ``[monitors]`` section: reward-hacking detectors run on every training step."""

    enabled: bool = Field(True, description="Run the detectors at all.")
    cooldown_steps: int = Field(10, ge=1, description="After an alert, a detector stays quiet on the same "
                                "evidence (the same shared text, metric or metric pair) for this many steps "
                                "unless its severity rises; the memory is kept in checkpoints.")
    collapse: CollapseConfig = Field(default_factory=CollapseConfig,
                                     description="Many tasks get the same (or near-same) output.")
    source_insensitivity: SourceInsensitivityConfig = Field(
        default_factory=SourceInsensitivityConfig, description="Outputs stop depending on their own input.")
    reward_spike: RewardSpikeConfig = Field(default_factory=RewardSpikeConfig,
                                            description="A reward mean jumps far outside its recent range.")
    divergence: DivergenceConfig = Field(default_factory=DivergenceConfig,
                                         description="A proxy reward rises while a guard or held-out reward falls.")
    length: LengthConfig = Field(default_factory=LengthConfig,
                                 description="Completions grow and longer ones score higher.")
    repetition: RepetitionConfig = Field(default_factory=RepetitionConfig,
                                         description="Outputs repeat phrases or one keyword.")
    entropy: EntropyConfig = Field(default_factory=EntropyConfig,
                                   description="Policy entropy collapses below its early baseline.")
    judge_directed: JudgeDirectedConfig = Field(default_factory=JudgeDirectedConfig,
                                                description="Outputs address the judge or scorer.")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="The sampler's policy version "
                                   "stops advancing, or its logprobs drift from (or copy) the trainer's.")
    guard_veto: GuardVetoConfig = Field(default_factory=GuardVetoConfig, description="One of the run's own "
                                        "guards vetoes every sample, step after step: nothing is learned.")


def config_tables() -> dict[str, str]:
    """Markdown tables of the settings: ``"monitors"`` (the top level) and one per detector name,
    as they appear in docs/reward_hacking.md."""
    tables = {"monitors": _table("`[monitors]`", MonitorsConfig)}
    for name, field in MonitorsConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            statistic = model.__doc__.split(": ", 1)[1]
            tables[name] = _table(f"`[monitors.{name}]`, statistic `alerts/{name}`: {statistic}", model)
    return tables


def _table(title: str, model: type[BaseModel]) -> str:
    lines = [title, "", "| key | default | meaning |", "|---|---|---|"]
    for key, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue
        lines.append(f"| `{key}` | `{field.get_default(call_default_factory=True)!r}` | {field.description} |")
    return "\n".join(lines)
