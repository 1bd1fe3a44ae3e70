"""Rewards read from an episode's sandbox: what of its changes the tests run with (`grade`), and
what the auxiliary rewards see of them (`reward_context`)."""

from __future__ import annotations

import pytest

from codedojo.harness.trajectory import Trajectory
from codedojo.reward.auxiliary import UNREAD_COST, comment_reasoning, lint_delta
from codedojo.reward.changes import MAX_BYTES, reward_context
from codedojo.reward.outcome import grade
from codedojo.sandbox.base import SandboxSpec
from tests.harness.conftest import (  # noqa: F401 (fixtures)
    F2P,
    LIMITS,
    P2P,
    SANDBOX_ENV,
    TESTS,
    provider,
    repo_image,
)


@pytest.fixture(autouse=True)
def _no_leftover_sandboxes(no_leftover_sandboxes):
    """Every test here is checked for sandboxes it left alive (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def helper_image(provider, repo_image, tmp_path_factory) -> str:  # noqa: F811
    """The repository with a test that reads what it expects from a helper module beside it."""
    src = tmp_path_factory.mktemp("helpers")
    (src / "tests").mkdir()
    (src / "tests" / "helpers.py").write_text("EXPECTED_LOW = ['nut', 'gear']\n")
    (src / "tests" / "test_stock.py").write_text(TESTS.replace(
        'assert low_stock(items(), 5) == ["nut", "gear"]',
        "from helpers import EXPECTED_LOW\n    assert low_stock(items(), 5) == EXPECTED_LOW"))
    return provider.images.from_directory(str(src), parent=repo_image, name="helpers").id


def test_what_the_tests_read_besides_their_own_files_is_the_tasks_when_protected(
        provider, helper_image):  # noqa: F811
    def fresh():
        return provider.create(SandboxSpec(image=helper_image, limits=LIMITS, env=SANDBOX_ENV))

    sb = fresh()
    try:
        with pytest.raises(ValueError, match=r"protect: .*\['\.\./x', '\.'\]"):
            grade(sb, F2P, P2P, fresh=fresh, protect=["../x", "."])
        # the bug left as it is, the expected value rewritten: the test still fails
        sb.write_file("/workspace/tests/helpers.py", "EXPECTED_LOW = ['nut']\n")
        report = grade(sb, F2P, P2P, fresh=fresh, protect=["./tests/"])
        assert report.fail_to_pass == {F2P[0]: False} and all(report.pass_to_pass.values())
        # the fix beside it counts: only what is under the protected paths is the task's
        stock = sb.read_file("/workspace/inventory/stock.py").decode()
        sb.write_file("/workspace/inventory/stock.py", stock.replace("i.qty < ", "i.qty <= "))
        assert grade(sb, F2P, P2P, fresh=fresh, protect=["tests"]).fail_to_pass == {F2P[0]: True}
    finally:
        sb.destroy()


def test_a_source_file_grown_past_what_is_read_is_charged_not_skipped(
        provider, repo_image):  # noqa: F811
    """Padding a changed file past `MAX_BYTES` (a docstring: it still imports) must not hide
    the lint and the deliberation comments written in it."""
    sb = provider.create(SandboxSpec(image=repo_image, limits=LIMITS, env=SANDBOX_ENV))
    try:
        stock = sb.read_file("/workspace/inventory/stock.py").decode()
        musing = "".join(f"# wait, actually the threshold is inclusive ({i})\n" for i in range(6))
        sb.write_file("/workspace/inventory/stock.py", "import os\n" + musing + stock)
        ctx = reward_context(Trajectory(task="t"), sb)
        assert lint_delta(ctx) > 0 and comment_reasoning(ctx) == 1.0 and ctx.unread == []
        padding = b'"""' + b"x" * MAX_BYTES + b'"""\n'
        sb.write_file("/workspace/inventory/stock.py",
                      sb.read_file("/workspace/inventory/stock.py") + padding)
        sb.write_file("/workspace/blob.bin", b"\x00" * 10)  # no source file: no cost
        sb.write_file("/workspace/data.bin", b"\x00" * (MAX_BYTES + 1))  # (in the image)
        read = []
        real = sb.read_original
        sb.read_original = lambda p: read.append(p) or real(p)  # type: ignore[method-assign]
        ctx = reward_context(Trajectory(task="t"), sb)
        assert ctx.unread == ["/workspace/inventory/stock.py"]
        assert lint_delta(ctx) == comment_reasoning(ctx) == UNREAD_COST
        assert "/workspace/data.bin" not in read  # (no text, nothing charged: not read)
    finally:
        sb.destroy()
