"""Rewards: verifiers, LLM judges, learned reward models and guards, composed into a named,
weighted reward that scores whole groups."""

from grooves.rewards.client import Endpoint, JudgeCache, JudgeClient, JudgeError, ReplyError
from grooves.rewards.compose import (
    Component, EnvScore, Failed, Reward, RewardComponent, RewardReport, Score, Verifier, as_reward, import_object,
)
from grooves.rewards.guards import (
    FormatGuard, Guard, InjectionGuard, JudgeGuard, LexicalGrounding, supported_by_source,
)
from grooves.rewards.judges import GroupJudge, PointwiseJudge, YesNoCheck
from grooves.rewards.rubric import Criterion, Example, Rubric, RubricError

__all__ = [
    "Component", "Criterion", "Endpoint", "EnvScore", "Example", "Failed", "FormatGuard", "GroupJudge", "Guard",
    "InjectionGuard", "JudgeCache", "JudgeClient", "JudgeError", "JudgeGuard", "LexicalGrounding",
    "PointwiseJudge", "ReplyError", "Reward", "RewardComponent", "RewardReport", "Rubric", "RubricError",
    "Score", "Verifier", "YesNoCheck", "as_reward", "import_object", "supported_by_source",
]

_MODELS = ("RewardModel", "RewardModelComponent", "train_reward_model")
__all__ += list(_MODELS)


def __getattr__(name: str):
    # Reward models pull in numpy and safetensors; load them on first use only.
    if name in _MODELS:
        from grooves.rewards import models

        return getattr(models, name)
    raise AttributeError(f"module 'grooves.rewards' has no attribute {name!r}")
