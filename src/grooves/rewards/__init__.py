"""Rewards: verifiers, LLM judges, learned reward models and guards, composed into a named,
weighted reward that scores whole groups."""

from grooves.rewards.client import Endpoint, JudgeCache, JudgeClient, JudgeError, ReplyError
from grooves.rewards.compose import (
    Component, Failed, Reward, RewardComponent, RewardReport, Score, Verifier, as_reward, import_object,
)
from grooves.rewards.guards import (
    FormatGuard, Guard, InjectionGuard, JudgeGuard, LexicalGrounding, supported_by_source,
)
from grooves.rewards.judges import GroupJudge, PointwiseJudge, YesNoCheck

__all__ = [
    "Component", "Endpoint", "Failed", "FormatGuard", "GroupJudge", "Guard", "InjectionGuard", "JudgeCache",
    "JudgeClient", "JudgeError", "JudgeGuard", "LexicalGrounding", "PointwiseJudge", "ReplyError", "Reward",
    "RewardComponent", "RewardReport", "Score", "Verifier", "YesNoCheck", "as_reward", "import_object",
    "supported_by_source",
]
