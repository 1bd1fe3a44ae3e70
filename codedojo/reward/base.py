"""The reward contract: a reward is a small function of an episode, registered by name.

    @reward("my_signal")
    def my_signal(ctx: RewardContext, *, threshold: float = 0.5) -> float: ...

`RewardContext` carries what a finished episode left behind: the trajectory, the test report
and the files it changed (before and after). Composition (`compose.py`) looks rewards up by
name, passes their parameters from config, weights them and logs each one on its own.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError, create_model

from codedojo.configfile import field_errors
from codedojo.harness.trajectory import Trajectory


@dataclass(frozen=True)
class FileChange:
    """One file the episode changed; None = the file did not exist on that side."""

    path: str
    before: str | None
    after: str | None


@dataclass(frozen=True)
class TestReport:
    """Per-test outcome (pytest node id -> passed) of the task's two test sets."""

    __test__ = False  # not a pytest class, despite the name

    fail_to_pass: dict[str, bool] = field(default_factory=dict)
    pass_to_pass: dict[str, bool] = field(default_factory=dict)
    infra_error: str | None = None  # why the run says nothing of the tests, if it does not


class GradingError(RuntimeError):
    """The episode's tests could not be run (`TestReport.infra_error`), or the environment
    ended it (`Trajectory.status` "error"): no reward is its."""


@dataclass
class RewardContext:
    trajectory: Trajectory
    tests: TestReport | None = None
    changes: list[FileChange] = field(default_factory=list)
    # ruff configuration files (name -> text) the changed files are linted by (`lint_delta`)
    lint_configs: dict[str, str] = field(default_factory=dict)
    # paths of source files (`auxiliary.UNREAD_CHARGED`) the episode left binary or too large
    # to read (`codedojo.reward.changes`) where the image had text or no file: not in
    # `changes`, each charged a fixed cost instead
    unread: list[str] = field(default_factory=list)


class RewardFn(Protocol):
    def __call__(self, ctx: RewardContext, /, **params: Any) -> float: ...


REWARDS: dict[str, RewardFn] = {}


def reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register a reward under `name` (a later registration replaces an earlier one)."""

    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REWARDS)}")
    return REWARDS[name]


def check_params(name: str, fn: RewardFn, params: dict[str, Any]) -> None:
    """Raise ValueError naming a parameter the reward does not take, or a value its annotation
    refuses (`Annotated[float, Field(gt=0)]`, a `Literal`): a config is checked as it loads,
    not at the first episode's reward. Strictly, as the reward gets the values: no string
    stands for a number or a bool ("false" would be true)."""
    sig = inspect.signature(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    kw = {p.name: p for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    for key in params:
        if key not in kw:
            raise ValueError(f"rewards.{name}.params.{key}: unknown parameter; accepted: {sorted(kw)}")
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except (NameError, TypeError):  # (an annotation not to be resolved here: not checked)
        hints = {}
    fields: dict[str, Any] = {k: (hints.get(k, Any), ... if p.default is p.empty else p.default)
                              for k, p in kw.items()}
    try:
        create_model(f"{name}_params", **fields).model_validate(params, strict=True)
    except ValidationError as e:
        raise ValueError(field_errors(e.errors()[:1], f"rewards.{name}.params.")) from None
