import math

import pytest

from codedojo.harness.trajectory import ToolCallRecord, Trajectory, Turn
from codedojo.reward.base import RewardContext
from codedojo.reward.length import (
    DEFAULT_WEIGHTS,
    concave_penalty,
    episode_cost,
    length_features,
    length_penalty,
)


@pytest.mark.parametrize("q", [0.0, 0.5, 1.0, 1.5, 3.0])
def test_zero_at_zero(q):
    assert concave_penalty(0.0, k=0.01, q=q) == 0.0


@pytest.mark.parametrize("q", [0.3, 1.0, 2.0])
def test_increasing_and_concave(q):
    xs = [i * 50.0 for i in range(60)]
    ys = [concave_penalty(x, k=0.01, q=q) for x in xs]
    diffs = [b - a for a, b in zip(ys, ys[1:], strict=False)]
    assert all(d > 0 for d in diffs)
    # Concave: equal steps in x give shrinking increments.
    assert all(d2 < d1 for d1, d2 in zip(diffs, diffs[1:], strict=False))


def test_q_zero_is_linear_and_matches_formula():
    assert concave_penalty(123.0, k=0.01, q=0.0) == pytest.approx(123.0)
    k, q, x = 0.02, 0.4, 77.0
    assert concave_penalty(x, k, q) == pytest.approx(((1 + k * x) ** (1 - q) - 1) / (k * (1 - q)))


def test_q_to_one_limit_is_log():
    k, x = 0.005, 4000.0
    log_form = math.log1p(k * x) / k
    assert concave_penalty(x, k, 1.0) == pytest.approx(log_form, rel=1e-12)
    for eps in (1e-3, 1e-6, 1e-9, 1e-12):
        for q in (1 - eps, 1 + eps):
            assert concave_penalty(x, k, q) == pytest.approx(log_form, rel=10 * eps + 1e-12)


def test_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="k must be"):
        concave_penalty(1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="q must be"):
        concave_penalty(1.0, 0.1, -1.0)
    # NaN passes every comparison and came out NaN; inf made 0·inf
    for args, name in (((math.nan, 1e-3, 1.0), "x"), ((1.0, math.nan, 1.0), "k"),
                       ((1.0, 1e-3, math.nan), "q"), ((0.0, math.inf, 1.0), "k"),
                       ((math.inf, 1e-3, 0.5), "x")):
        with pytest.raises(ValueError, match=f"{name} must be a finite number, got (nan|inf)"):
            concave_penalty(*args)


@pytest.mark.parametrize("weights, field", [
    ({"thinking": 1.0}, "weights.thinking"),  # a feature it does not know
    ({"turns": -100.0}, "weights.turns"),  # a weight that pays for length
    ({"turns": float("nan")}, "weights.turns"),
    ({"turns": 1e308}, "weights.turns"),  # x would overflow: every episode's cost would fail
])
def test_feature_weights_are_checked_as_the_config_loads(weights, field):
    from codedojo.reward.base import check_params
    from codedojo.reward.length import length_penalty as fn

    with pytest.raises(ValueError, match=f"rewards.length_penalty.params.{field}"):
        check_params("length_penalty", fn, {"weights": weights})
    check_params("length_penalty", fn, {"weights": {"turns": 0.0, "final_tokens": 2}})


def _traj() -> Trajectory:
    t = Trajectory(task="t", messages=[{"role": "user", "content": "x"}])
    t.turns = [
        Turn(index=0, segment=0, kind="action", message={}, completion_tokens=100, reasoning_tokens=60,
             tool_calls=[ToolCallRecord("a", "grep", "1", False, False, 0.0, 10)] * 2, tool_output_tokens=500),
        Turn(index=1, segment=0, kind="summary", message={}, completion_tokens=30),
        Turn(index=2, segment=1, kind="action", message={}, completion_tokens=20, reasoning_tokens=5),
    ]
    return t


def test_features_and_weighted_cost():
    f = length_features(_traj())
    assert f == {"thinking_tokens": 95, "tool_call_tokens": 40, "tool_output_tokens": 500,
                 "final_tokens": 15, "tool_calls": 2, "turns": 3}
    assert episode_cost(_traj(), {"tool_calls": 10.0, "final_tokens": 2.0}) == 50.0
    with pytest.raises(ValueError, match="weights.bogus"):
        episode_cost(_traj(), {"bogus": 1.0})


def test_tool_output_is_counted_in_the_models_tokens_where_the_next_prompt_says():
    """The loop's estimate (four characters a token) is off by 0.3x to 4x by the kind of
    output; the next call's prompt count says how many tokens the output really took."""
    t = Trajectory(task="t")
    calls = [ToolCallRecord("a", "ls", "1", False, False, 0.0, 10)]
    t.turns = [
        Turn(index=0, segment=0, kind="action", message={}, prompt_tokens=1000,
             completion_tokens=30, tool_calls=calls, tool_output_tokens=800),
        Turn(index=1, segment=0, kind="action", message={}, prompt_tokens=3300,
             completion_tokens=20, tool_calls=calls, tool_output_tokens=50),
        Turn(index=2, segment=0, kind="summary", message={}, prompt_tokens=3400,
             completion_tokens=10),
    ]
    # 3300 - 1000 - 30 for the first; the second's next call is a summary's: estimated
    assert length_features(t)["tool_output_tokens"] == 2270 + 50


def test_tool_output_counts_only_the_completion_the_next_prompt_carries():
    """A template that drops a turn's reasoning (ours: `reasoning_content` is not rendered)
    carries only its visible completion into the next prompt."""
    calls = [ToolCallRecord("a", "read_file", "1", False, False, 0.0, 3600)]
    t = Trajectory(task="t")
    t.turns = [
        Turn(index=0, segment=0, kind="action", message={}, prompt_tokens=1000,
             completion_tokens=800, reasoning_tokens=700, tool_calls=calls,
             tool_output_tokens=900),
        Turn(index=1, segment=0, kind="action", message={}, prompt_tokens=1000 + 100 + 900,
             completion_tokens=50),
    ]
    assert length_features(t)["tool_output_tokens"] == 900
    # a template that keeps it: the next prompt holds the whole completion
    t.turns[1].prompt_tokens = 1000 + 800 + 900
    assert length_features(t, reasoning_in_prompt=True)["tool_output_tokens"] == 900
    ctx = RewardContext(t)
    assert length_penalty(ctx, reasoning_in_prompt=True) < length_penalty(ctx)


def test_length_penalty_reward_grows_with_the_episode():
    short = _traj()
    long = _traj()
    long.turns.append(Turn(index=3, segment=1, kind="action", message={}, completion_tokens=2000))
    a = length_penalty(RewardContext(short))
    b = length_penalty(RewardContext(long))
    assert 0 < a < b


def test_a_partial_weights_table_changes_those_weights_and_keeps_the_others():
    ctx = RewardContext(_traj())
    default = length_penalty(ctx, k=1e-3)
    assert length_penalty(ctx, k=1e-3, weights={"tool_calls": 20.0}) == default
    f = length_features(_traj())
    more = length_penalty(ctx, k=1e-3, weights={"tool_output_tokens": 1.0})
    x = episode_cost(_traj(), {**DEFAULT_WEIGHTS, "tool_output_tokens": 1.0})
    assert x == episode_cost(_traj(), DEFAULT_WEIGHTS) + 0.75 * f["tool_output_tokens"]
    assert more == pytest.approx(concave_penalty(x, 1e-3, 1.0))
