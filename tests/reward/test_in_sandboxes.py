"""Rewards read from an episode's sandbox: what of its changes the tests run with (`grade`), and
what the auxiliary rewards see of them (`reward_context`)."""

from __future__ import annotations

import os

import pytest

from codedojo.harness.trajectory import Trajectory
from codedojo.reward import changes
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
        sb.read_original = (  # type: ignore[method-assign]
            lambda p, **kw: read.append(p) or real(p, **kw))
        ctx = reward_context(Trajectory(task="t"), sb)
        assert ctx.unread == ["/workspace/inventory/stock.py"]
        assert lint_delta(ctx) == comment_reasoning(ctx) == UNREAD_COST
        assert "/workspace/data.bin" not in read  # (no text, nothing charged: not read)
    finally:
        sb.destroy()


OLD_MODULE = ("import os\nimport re\n" + "".join(f"# an old note, line {i}\n" for i in range(6))
              + "X = 1\n")  # two unused imports and a long comment, the image's


@pytest.fixture(scope="module")
def linked_image(provider, repo_image, tmp_path_factory) -> str:  # noqa: F811
    """The repository with a module reached by a link (link.py -> real.py) and a data file
    larger than what the rewards read of one."""
    src = tmp_path_factory.mktemp("linked")
    (src / "real.py").write_text(OLD_MODULE)
    os.symlink("real.py", src / "link.py")
    (src / "weights.bin").write_bytes(b"\x01" * (3 * MAX_BYTES))
    return provider.images.from_directory(str(src), parent=repo_image, name="linked").id


def _reads(sb) -> list[int]:
    """The sizes of what `sb.read_file` and `sb.read_original` give back, from now on."""
    sizes: list[int] = []

    def counted(real):
        def read(path, *args, **kw):
            data = real(path, *args, **kw)
            sizes.append(len(data))
            return data
        return read

    for name in ("read_file", "read_original"):
        setattr(sb, name, counted(getattr(sb, name)))
    return sizes


def test_an_edit_through_a_link_of_the_image_charges_nothing_the_image_had(
        provider, linked_image):  # noqa: F811
    """`sed -i` on a linked module leaves a regular file where the image had a link: the image
    has no text there (`read_original` follows no link), and the file is no new one whose
    old lint and comments are the episode's."""
    sb = provider.create(SandboxSpec(image=linked_image, limits=LIMITS, env=SANDBOX_ENV))
    try:
        r = sb.exec("cd /workspace && sed -i 's/X = 1/X = 2/' link.py && test ! -L link.py")
        assert r.exit_code == 0, r.stderr
        ctx = reward_context(Trajectory(task="t"), sb)
        assert [c.path for c in ctx.changes] == [] and ctx.unread == []
        assert lint_delta(ctx) == comment_reasoning(ctx) == 0.0
    finally:
        sb.destroy()


def test_a_source_file_left_there_unreadable_is_charged_not_taken_as_deleted(
        provider, linked_image):  # noqa: F811
    """A file the host cannot read (holes past the sandbox's disk, mode 000) is still there:
    what the episode wrote in it is charged, as for one grown past `MAX_BYTES`."""
    sb = provider.create(SandboxSpec(image=linked_image, limits=LIMITS, env=SANDBOX_ENV))
    try:
        musing = "".join(f"# wait, actually ({i})\n" for i in range(6))
        sb.write_file("/workspace/real.py", OLD_MODULE + "import sys\n" + musing)
        ctx = reward_context(Trajectory(task="t"), sb)
        assert (lint_delta(ctx), comment_reasoning(ctx), ctx.unread) == (1.0, 1.0, [])
        for how in (f"truncate -s {2 * LIMITS.disk_mb}M real.py", "chmod 000 real.py"):
            r = sb.exec(f"cd /workspace && {how}")
            assert r.exit_code == 0, r.stderr
            ctx = reward_context(Trajectory(task="t"), sb)
            assert ctx.changes == [] and ctx.unread == ["/workspace/real.py"], how
            assert lint_delta(ctx) == comment_reasoning(ctx) == UNREAD_COST
    finally:
        sb.destroy()


def test_a_large_file_of_the_image_is_not_read_to_be_left_out(
        provider, linked_image):  # noqa: F811
    """Deleting or overwriting an image's file past `MAX_BYTES`: its original is refused
    before it is read (a 500 MB one was read whole into the host)."""
    sb = provider.create(SandboxSpec(image=linked_image, limits=LIMITS, env=SANDBOX_ENV))
    try:
        sizes = _reads(sb)
        for how in ("echo x > weights.bin", "rm weights.bin"):
            sb.exec(f"cd /workspace && {how}")
            assert reward_context(Trajectory(task="t"), sb).changes == []
        assert sizes and max(sizes) <= MAX_BYTES
    finally:
        sb.destroy()


def test_what_is_read_of_an_episode_s_changes_is_bounded_in_all(
        provider, linked_image, monkeypatch):  # noqa: F811
    """Sparse files cost a sandbox little disk and the host, read, all of their size: past
    `MAX_TOTAL_BYTES` in all nothing more is read, the source files the rewards read first
    (a build's or a download's output comes after them), and a source file left unread is
    charged."""
    monkeypatch.setattr(changes, "MAX_TOTAL_BYTES", 5 * MAX_BYTES)
    sb = provider.create(SandboxSpec(image=linked_image, limits=LIMITS, env=SANDBOX_ENV))
    try:
        r = sb.exec(f"cd /workspace && for i in 1 2 3 4 5 6; do yes x | head -c 8192 > a$i.txt "
                    f"&& truncate -s {MAX_BYTES - 1} a$i.txt; done && echo 'X = 2' >> real.py")
        assert r.exit_code == 0, r.stderr
        sizes = _reads(sb)
        ctx = reward_context(Trajectory(task="t"), sb)
        assert sum(sizes) <= 5 * MAX_BYTES
        assert [c.path for c in ctx.changes] == [*(f"/workspace/a{i}.txt" for i in (1, 2, 3)),
                                                 "/workspace/real.py"]
        assert ctx.unread == []
        sb.exec("cd /workspace && for i in 1 2 3 4 5; do cp a1.txt b$i.py; done")
        ctx = reward_context(Trajectory(task="t"), sb)
        assert [c.path for c in ctx.changes] == [f"/workspace/b{i}.py" for i in (1, 2, 3, 4)]
        assert ctx.unread == ["/workspace/b5.py", "/workspace/real.py"]
    finally:
        sb.destroy()
