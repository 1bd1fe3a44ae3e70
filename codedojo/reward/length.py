"""The concave length penalty C_{k,q}(x) and the episode cost x it is applied to.

    C_{k,q}(x) = ((1 + k·x)^{1−q} − 1) / (k·(1 − q)),    C_{k,1}(x) = log(1 + k·x) / k

Written as expm1((1−q)·log1p(k·x)) / (k·(1−q)), which is exact to rounding for every q and
tends to the log form smoothly as q → 1 (no cancellation in the numerator). For q > 0 it is
increasing and concave: the first tokens of an episode cost the most, so easy tasks are pushed
to be short while hard tasks may still spend what they need.

x = Σ weight_f · f over features of the trajectory:
    thinking_tokens    reasoning tokens (and self-summary turns, which are deliberation too)
    tool_call_tokens   completion tokens of turns that call tools (minus their reasoning)
    tool_output_tokens tokens of tool output the model had to read: counted by the model, as
                       the next prompt's growth past the turn's prompt and completion where the
                       next call in the same context says its prompt's length, else as the loop
                       estimated it (the last turn, a policy that counts no prompt). The
                       turn's reasoning is in the next prompt only where the chat template
                       keeps it (``reasoning_in_prompt``): our renderer (`codedojo.model.chat`)
                       drops a message's ``reasoning_content``; Qwen3's template keeps it
                       within a user turn.
    final_tokens       completion tokens of the final answer
    tool_calls         number of tool calls
    turns              number of model calls
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, get_args

from pydantic import Field

from codedojo.harness.trajectory import Trajectory, Turn
from codedojo.reward.base import RewardContext, reward

Feature = Literal["thinking_tokens", "tool_call_tokens", "tool_output_tokens", "final_tokens",
                  "tool_calls", "turns"]
FEATURES: tuple[str, ...] = get_args(Feature)
# a feature's weight: a cost grows with it (a negative one would pay for length); bounded so
# that x stays finite
Weight = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]


def concave_penalty(x: float, k: float, q: float) -> float:
    """C_{k,q}(x); k, q and x finite (NaN would pass every check below and come out NaN)."""
    for name, value in (("k", k), ("q", q), ("x", x)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
    if k <= 0:
        raise ValueError(f"k must be > 0, got {k}")
    if q < 0:
        raise ValueError(f"q must be >= 0, got {q}")
    if x < 0:
        raise ValueError(f"x must be >= 0, got {x}")
    log_term = math.log1p(k * x)
    a = 1.0 - q
    if a == 0.0:
        return log_term / k
    return math.expm1(a * log_term) / (k * a)


def length_features(traj: Trajectory, reasoning_in_prompt: bool = False) -> dict[str, float]:
    """The features x weighs (see the module's docstring); ``reasoning_in_prompt``: the
    policy's chat template keeps a turn's reasoning in the prompts after it."""
    f = dict.fromkeys(FEATURES, 0.0)
    for i, t in enumerate(traj.turns):
        completion = t.completion_tokens or len(t.completion_ids)
        f["turns"] += 1
        if t.kind == "summary":
            f["thinking_tokens"] += completion
            continue
        f["thinking_tokens"] += t.reasoning_tokens
        visible = max(0, completion - t.reasoning_tokens)
        if t.tool_calls:
            f["tool_call_tokens"] += visible
            f["tool_calls"] += len(t.tool_calls)
            nxt = traj.turns[i + 1] if i + 1 < len(traj.turns) else None
            carried = completion if reasoning_in_prompt else visible
            f["tool_output_tokens"] += _tool_output_tokens(t, nxt, carried)
        else:
            f["final_tokens"] += visible
    return f


def _tool_output_tokens(turn: Turn, nxt: Turn | None, carried: int) -> float:
    """The tokens of ``turn``'s tool output as the model counted them, from the prompt of the
    call ``nxt`` after it (if any): what it holds past the turn's prompt and the ``carried``
    tokens of its completion (those the next prompt holds), the template's few tokens around
    each output with it; the loop's estimate where that cannot be told (no next call, a
    summary's call, whose context may cut long outputs, another context after it, no
    counts)."""
    if nxt is not None and nxt.kind == "action" and nxt.segment == turn.segment and (
            nxt.prompt_tokens and turn.prompt_tokens):
        grown = nxt.prompt_tokens - turn.prompt_tokens - carried
        if grown >= 0:
            return float(grown)
    return float(turn.tool_output_tokens)


def episode_cost(traj: Trajectory, weights: dict[str, float],
                 reasoning_in_prompt: bool = False) -> float:
    for name in weights:
        if name not in FEATURES:
            raise ValueError(f"rewards.length_penalty.params.weights.{name}: unknown feature; known: {list(FEATURES)}")
    f = length_features(traj, reasoning_in_prompt)
    return sum(weights.get(name, 0.0) * f[name] for name in FEATURES)


DEFAULT_WEIGHTS = {
    "thinking_tokens": 1.0,
    "tool_call_tokens": 1.0,
    "tool_output_tokens": 0.25,
    "final_tokens": 1.0,
    "tool_calls": 20.0,
    "turns": 20.0,
}


@reward("length_penalty")
def length_penalty(
    ctx: RewardContext, *, k: Annotated[float, Field(ge=1e-12, le=1, allow_inf_nan=False)] = 1e-3,
    q: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0,
    weights: dict[Feature, Weight] | None = None, reasoning_in_prompt: bool = False,
) -> float:
    """C_{k,q}(x) of the episode (positive; composition gives it a negative weight). C is in
    units of x, about x itself while k·x is small: 1/k, the x where it bends, is from one token
    to 10^12 (past these, k·x overflows or k·(1−q) underflows: every episode's cost would
    fail). ``weights`` change
    the features' weights over `DEFAULT_WEIGHTS` (0 leaves a feature out).
    ``reasoning_in_prompt``: the policy's chat template keeps a turn's reasoning in the prompts
    after it (a server's Qwen3 template, within the task's user turn); off, as our renderer
    does, a turn's tool output is the next prompt's growth past the turn's visible
    completion."""
    weights = {**DEFAULT_WEIGHTS, **(weights or {})}
    return concave_penalty(episode_cost(ctx.trajectory, weights, reasoning_in_prompt), k, q)
