import pytest

from codedojo.harness.trajectory import ToolCallRecord, Trajectory, Turn
from codedojo.reward import REWARDS, RewardConfig, RewardContext, TestReport, compute_reward, reward
from codedojo.reward.outcome import outcome, parse_pytest_summary


def _ctx(f2p: dict, p2p: dict) -> RewardContext:
    t = Trajectory(task="t", messages=[{"role": "user", "content": "u"}])
    t.turns = [Turn(index=0, segment=0, kind="action", message={}, completion_tokens=200)]
    return RewardContext(t, tests=TestReport(f2p, p2p))


def test_outcome_modes():
    assert outcome(_ctx({"a": True, "b": True}, {"c": True})) == 1.0
    assert outcome(_ctx({"a": True, "b": False}, {"c": True})) == 0.0
    assert outcome(_ctx({"a": True, "b": True}, {"c": False})) == 0.0
    assert outcome(_ctx({"a": True, "b": False}, {"c": True}), mode="fraction") == 0.5
    assert outcome(_ctx({"a": True}, {"c": False}), mode="fraction") == 0.0
    assert outcome(RewardContext(Trajectory(task="t"))) == 0.0


def test_parse_pytest_summary():
    out = (
        "....F\n=========== short test summary info ===========\n"
        "PASSED tests/test_a.py::test_one\n"
        "PASSED tests/test_a.py::test_p[1-2]\n"
        "FAILED tests/test_a.py::test_two - AssertionError: boom\n"
        "ERROR tests/test_b.py::test_three\n"
        "XFAIL tests/test_b.py::test_x\n"
    )
    assert parse_pytest_summary(out) == {
        "tests/test_a.py::test_one": True,
        "tests/test_a.py::test_p[1-2]": True,
        "tests/test_a.py::test_two": False,
        "tests/test_b.py::test_three": False,
        "tests/test_b.py::test_x": True,
    }
    # a parametrised id with spaces: found as asked for, with or without a reason after it
    spaced = ("=========== short test summary info ===========\n"
              "PASSED t.py::test_a[hello world]\n"
              "FAILED t.py::test_b[a - b] - assert 1 == 2\n"
              "PASSED t.py::test_b[a b c]\n")
    assert parse_pytest_summary(spaced, ["t.py::test_a[hello world]", "t.py::test_b[a - b]"]) == {
        "t.py::test_a[hello world]": True, "t.py::test_b[a - b]": False,
        "t.py::test_b[a b c]": True}


def test_composition_logs_each_component(tmp_path):
    cfg_path = tmp_path / "reward.toml"
    cfg_path.write_text(
        "[rewards.outcome]\nweight = 1.0\n\n"
        "[rewards.length_penalty]\nweight = -0.01\nparams = { k = 0.01, q = 1.0, weights = { final_tokens = 1.0 } }\n\n"
        "[rewards.tool_collapse]\nweight = -0.5\n"
    )
    cfg = RewardConfig.from_toml(cfg_path)
    b = compute_reward(_ctx({"a": True}, {}), cfg)
    assert set(b.components) == {"outcome", "length_penalty", "tool_collapse"}
    assert b.components["outcome"] == 1.0
    # x: 200 final tokens at weight 1, and one turn at the default weight of 20
    assert b.components["length_penalty"] == pytest.approx(__import__("math").log1p(2.2) / 0.01)
    assert b.total == pytest.approx(1.0 - 0.01 * b.components["length_penalty"])
    assert b.log_dict()["reward/outcome"] == 1.0


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="rewards.nope"):
        RewardConfig.model_validate({"rewards": {"nope": {"weight": 1.0}}})
    with pytest.raises(ValueError, match=r"rewards.tool_collapse.params.bogus"):
        RewardConfig.model_validate({"rewards": {"tool_collapse": {"weight": 1.0, "params": {"bogus": 1}}}})
    for reward_name, params, where in (
            ("length_penalty", {"k": 0},
             "k: Input should be greater than or equal to 0.000000000001"),
            # k·x would overflow: every episode's reward would fail
            ("length_penalty", {"k": 1e306}, "k: Input should be less than or equal to 1"),
            ("length_penalty", {"q": "a lot"}, "q: Input should be a valid number"),
            ("outcome", {"mode": "partial"}, "mode: Input should be 'binary' or 'fraction'"),
            ("tool_collapse", {"threshold": 1.5}, "threshold: Input should be less than 1")):
        with pytest.raises(ValueError, match=f"rewards.{reward_name}.params.{where}"):
            RewardConfig.model_validate({"rewards": {reward_name: {"weight": 1.0,
                                                                   "params": params}}})
    # checked as the reward gets them: a string is no number (it failed at the first episode)
    # and no bool ("false" was true)
    for reward_name, params, where in (
            ("length_penalty", {"k": "1e-3"}, "k: Input should be a valid number"),
            ("lint_delta", {"normalize": "false"}, "normalize: Input should be a valid boolean"),
            ("comment_reasoning", {"max_lines": "4"}, "max_lines: Input should be a valid int")):
        with pytest.raises(ValueError, match=f"rewards.{reward_name}.params.{where}"):
            RewardConfig.model_validate({"rewards": {reward_name: {"weight": 1.0,
                                                                   "params": params}}})
    for weight in (float("nan"), float("inf"), 1e308, -1e308):  # a NaN total trains on nothing
        with pytest.raises(ValueError, match="weight"):
            RewardConfig.model_validate({"rewards": {"outcome": {"weight": weight}}})


def test_a_new_reward_is_a_registered_function():
    @reward("test_constant")
    def constant(ctx: RewardContext, *, value: float = 1.0) -> float:
        return value

    try:
        cfg = RewardConfig.model_validate({"rewards": {"test_constant": {"weight": 2.0, "params": {"value": 3.0}}}})
        assert compute_reward(_ctx({}, {}), cfg).total == 6.0
    finally:
        REWARDS.pop("test_constant")


def test_default_config_runs():
    b = compute_reward(_ctx({"a": True}, {"b": True}))
    assert b.components["outcome"] == 1.0
    assert b.total < 1.0  # the length penalty costs something


def _episode(turns: int, solved: bool, tokens: int = 150, output: int = 500) -> RewardContext:
    """An episode of ``turns`` tool-calling turns and a final answer, its tests passed or not."""
    t = Trajectory(task="t", messages=[{"role": "user", "content": "u"}])
    t.turns = [Turn(index=i, segment=0, kind="action", message={}, completion_tokens=tokens,
                    tool_calls=[ToolCallRecord(str(i), "grep", "1", False, False, 0.1, 4 * output)],
                    tool_output_tokens=output) for i in range(turns)]
    t.turns.append(Turn(index=turns, segment=0, kind="action", message={}, completion_tokens=60))
    return RewardContext(t, tests=TestReport({"a": solved}, {}))


def test_by_default_solving_outweighs_length_and_shorter_solutions_win():
    """The length penalty shapes among episodes of one outcome; it must never make a short
    failure worth more than a long success (λ·C is in units of tokens)."""
    cfg = RewardConfig()
    total = {(n, ok): compute_reward(_episode(n, ok), cfg).total
             for n in (1, 10, 40) for ok in (True, False)}
    assert min(total[n, True] for n in (1, 10, 40)) > max(total[n, False] for n in (1, 10, 40))
    assert total[1, True] > total[10, True] > total[40, True] > 0.5
    assert total[1, False] > total[10, False] > total[40, False]


def test_a_total_that_is_not_finite_is_an_error_naming_the_components():
    @reward("test_huge")
    def huge(ctx: RewardContext) -> float:
        return 1e308

    try:
        cfg = RewardConfig.model_validate({"rewards": {"test_huge": {"weight": 10.0},
                                                       "outcome": {"weight": 1.0}}})
        with pytest.raises(ValueError, match=r"weighted total is inf.*test_huge inf, outcome 1"):
            compute_reward(_ctx({"a": True}, {}), cfg)
    finally:
        REWARDS.pop("test_huge")


def test_an_episode_the_environment_ended_is_no_reward_of_the_policys():
    """Status "error": the model endpoint or the tool service failed. Its tests' failure says
    nothing of the policy: the trainer drops or reruns it, as one whose tests could not run."""
    from codedojo.reward import GradingError

    ctx = _ctx({"a": False}, {"b": True})
    ctx.trajectory.status, ctx.trajectory.error = "error", "ConnectionError: tool service failed"
    with pytest.raises(GradingError, match="ConnectionError: tool service failed"):
        compute_reward(ctx)
    ctx.trajectory.status = "max_turns"  # the policy's own end: rewarded
    assert compute_reward(ctx).components["outcome"] == 0.0
