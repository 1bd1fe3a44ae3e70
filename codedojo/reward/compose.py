"""R = Σ weight_i · reward_i, from config; each component is reported on its own.

With the default config this is R = outcome + Σ auxiliary − λ·C_{k,q}(x): the length penalty
and the auxiliary costs are registered rewards with negative weights. A new signal is a
function registered with `@reward(name)` plus a `[rewards.name]` table in the TOML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Importing the modules registers their rewards.
from codedojo.configfile import read_toml
from codedojo.reward import auxiliary, length, outcome  # noqa: F401
from codedojo.reward.base import GradingError, RewardContext, check_params, get_reward

MAX_WEIGHT = 1e6  # a component's weight, either sign: past it a total would overflow, not rank


class ComponentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: float = Field(ge=-MAX_WEIGHT, le=MAX_WEIGHT, allow_inf_nan=False,
                          description="Multiplier of this reward in the total (costs are "
                          "negative).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword parameters of the reward.")
    enabled: bool = True


def _defaults() -> dict[str, ComponentConfig]:
    # C is in units of x (weighted tokens): λ = 1e-4 with k = 1e-3 costs an episode of x = 300
    # (a short answer) 0.026, of x = 3,000 (ten tool calls) 0.14, of x = 30,000 0.34, so that
    # a solved task beats a failed one up to x = 10^7 (λ·C = 0.92) and, among solved ones, the
    # shorter wins.
    return {
        "outcome": ComponentConfig(weight=1.0),
        "length_penalty": ComponentConfig(weight=-1e-4, params={"k": 1e-3, "q": 1.0}),
        "unfinished_todos": ComponentConfig(weight=-0.1),
        "comment_reasoning": ComponentConfig(weight=-0.05),
        "tool_collapse": ComponentConfig(weight=-0.1),
        "lint_delta": ComponentConfig(weight=-0.02),
    }


class RewardConfig(BaseModel):
    """Which rewards make up R and with which weights (TOML: one `[rewards.NAME]` table each)."""

    model_config = ConfigDict(extra="forbid")

    rewards: dict[str, ComponentConfig] = Field(default_factory=_defaults)

    @model_validator(mode="after")
    def _known(self) -> RewardConfig:
        for name, comp in self.rewards.items():
            try:
                fn = get_reward(name)
            except KeyError as e:
                raise ValueError(f"rewards.{name}: {e.args[0]}") from None
            check_params(name, fn, comp.params)
        return self

    @classmethod
    def from_toml(cls, path: str | Path) -> RewardConfig:
        data = read_toml(path)
        return cls.model_validate(data)


@dataclass
class RewardBreakdown:
    total: float
    components: dict[str, float] = field(default_factory=dict)  # raw value of each reward
    weighted: dict[str, float] = field(default_factory=dict)  # weight * value

    def log_dict(self, prefix: str = "reward/") -> dict[str, float]:
        d = {f"{prefix}total": self.total}
        d.update({f"{prefix}{k}": v for k, v in self.components.items()})
        return d


def compute_reward(ctx: RewardContext, config: RewardConfig | None = None) -> RewardBreakdown:
    """The episode's reward. An episode the environment ended (`Trajectory.status` "error": the
    model endpoint or the tool service failed) raises `GradingError`, as one whose tests could
    not run does: no reward is its, and the trainer leaves it out or runs it again."""
    if ctx.trajectory.status == "error":
        raise GradingError(f"the environment ended the episode: {ctx.trajectory.error}")
    config = config or RewardConfig()
    comps: dict[str, float] = {}
    weighted: dict[str, float] = {}
    for name, comp in config.rewards.items():
        if not comp.enabled:
            continue
        value = float(get_reward(name)(ctx, **comp.params))
        if not math.isfinite(value):
            raise ValueError(f"rewards.{name}: returned a non-finite value {value}")
        comps[name] = value
        weighted[name] = comp.weight * value
    total = sum(weighted.values())
    if not math.isfinite(total):
        raise ValueError(f"rewards: the weighted total is {total}, not finite: "
                         f"{', '.join(f'{k} {v}' for k, v in weighted.items())}")
    return RewardBreakdown(total, comps, weighted)
