"""Rewards: verifiers (plain functions) composed into a named, weighted reward."""

from grooves.rewards.compose import Component, Reward, RewardReport, as_reward, import_object

__all__ = ["Component", "Reward", "RewardReport", "as_reward", "import_object"]
