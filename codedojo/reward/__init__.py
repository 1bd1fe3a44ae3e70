"""Rewards: outcome from tests, the concave length penalty, auxiliary signals, composition."""

from codedojo.reward.base import (
    REWARDS,
    FileChange,
    GradingError,
    RewardContext,
    RewardFn,
    TestReport,
    reward,
)
from codedojo.reward.compose import ComponentConfig, RewardBreakdown, RewardConfig, compute_reward
from codedojo.reward.length import concave_penalty, length_features

__all__ = [
    "REWARDS",
    "ComponentConfig",
    "FileChange",
    "GradingError",
    "RewardBreakdown",
    "RewardConfig",
    "RewardContext",
    "RewardFn",
    "TestReport",
    "compute_reward",
    "concave_penalty",
    "length_features",
    "reward",
]
