"""Outcome reward from the task's tests: fail-to-pass must now pass, pass-to-pass must still pass.

The tests run as the bench runs them (`codedojo.bench.testrun.run_pytest`: pytest's `-rA`
summary read per test, a canary beside them, a test never reported counted as an error). A
fail-to-pass test must pass (one that xfails, by `pytest.xfail()` in the code under test, was
not fixed); a pass-to-pass test passes or fails as expected.

`grade` judges an episode on a fresh sandbox of the task's image: the episode's changes to
/workspace are applied there, all but the tests' own files, the paths the caller protects (the
task's hidden paths: what the tests read) and the test machinery (conftest.py files, pytest
configuration, modules that shadow pytest: `is_test_machinery`), so nothing the episode did
to how the tests run, nor anything outside /workspace (its home directory, links, processes
still running), counts. Without a fresh sandbox it grades in the
episode's own, after putting those files back as the image had them: for a trusted episode.

A run that says nothing of the tests (it timed out, or pytest did not start) is the
episode's failure where the task as it came runs (its change hung the tests); otherwise the
report carries ``infra_error`` and the outcome reward raises `GradingError`: the episode is
the environment's to retry, not the policy's to be taught by. The task as it came runs in
another fresh sandbox, or is the run the caller keeps for it (``as_it_came``: a
`codedojo.bench.testrun.Baselines` shares one between a task's rollouts); graded in the
episode's own sandbox with none given, the report always carries ``infra_error``.
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
from collections.abc import Callable, Sequence
from typing import Literal

from codedojo.bench.testrun import (
    PytestCommand,
    is_test_machinery,
    parse_pytest_output,
    run_pytest,
    unmask_xfails,
)
from codedojo.bench.testrun import TestReport as RunReport
from codedojo.bench.workspace import apply_changes, collect_changes
from codedojo.reward.base import GradingError, RewardContext, TestReport, reward
from codedojo.sandbox.base import WORKSPACE, Sandbox, SandboxError


def parse_pytest_summary(output: str, tests: Sequence[str] = ()) -> dict[str, bool]:
    """node id -> passed or failed as expected, from `pytest -rA` output; ``tests``: the ids
    asked for, found as written."""
    report = parse_pytest_output(output, tests)
    passed = report.passed()
    return {t: t in passed for t in report.outcomes}


def default_command(python_path: Sequence[str] = (".",)) -> PytestCommand:
    """pytest in /workspace by the image's ``python3``, with the image's own PYTHONPATH after
    the task's folders (``python_path``)."""
    return PytestCommand(root=WORKSPACE, python="python3", python_path=tuple(python_path),
                         inherit_pythonpath=True)


def grade(sandbox: Sandbox, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
          fresh: Callable[[], Sandbox] | None = None, command: PytestCommand | None = None,
          timeout: float = 300.0, as_it_came: Callable[[], RunReport] | None = None,
          protect: Sequence[str] = ()) -> TestReport:
    """Both test sets' results for the episode whose sandbox is ``sandbox``: run in a new
    sandbox of the task's image, ``fresh()``, with the episode's changes, or in ``sandbox``
    itself when there is no ``fresh`` (see the module's docstring). A run that needs the task
    as it came beside it (see `unmask_xfails`, and a run that says nothing of the tests) asks
    ``as_it_came()`` for it, the same tests' run on the task's image (one run a task, kept by
    the caller), or takes another ``fresh()``, where nothing of the episode's ran. The
    sandboxes it makes, it destroys. ``command``: how pytest runs (`default_command`); its
    ``python_path`` folders are import roots the test machinery cannot be changed in.

    ``protect``: paths (relative to /workspace, files or folders: all under one) whose changes
    are not applied either, besides the files the test ids name. A caller passes what the
    tests read besides their own files (helper modules, fixtures, expected data), or the
    episode can rewrite it: an RL trainer must pass the task's hidden paths
    (`codedojo.bench.workspace.hidden_from_agent`), as the bench grades, or for a task
    without them the folders its tests are in (no caller in this package does yet: the
    default protects nothing more)."""
    command = command or default_command()
    tests = [*fail_to_pass, *pass_to_pass]
    if not tests:
        return TestReport()
    files = {t.split("::", 1)[0] for t in tests}
    folders = tuple(posixpath.normpath(p) + "/" for p in protect)
    if bad := [p for p, f in zip(protect, folders, strict=True)
               if p.startswith("/") or f == "./" or f.startswith("../")]:
        raise ValueError(f"protect: paths inside /workspace, relative to it, expected; got {bad}")

    def protected(rel: str) -> bool:
        return (rel in files or f"{rel}/".startswith(folders)
                or is_test_machinery(rel, command.python_path))

    if fresh is None:
        restore(sandbox, protected)
        run, changes = run_pytest(sandbox, command, tests, timeout), {}
    else:
        changes = collect_changes(sandbox)
        run = run_fresh(fresh, tests, command, timeout, changes, protected)
    infra_error = run.infra_error
    if as_it_came is None and fresh is not None:
        as_it_came = functools.partial(run_fresh, fresh, tests, command, timeout)
    if as_it_came is not None and (changes or fresh is None):  # (none: the same run)
        before = functools.cache(as_it_came)
        if infra_error and not before().infra_error:
            infra_error = None  # the change hung the tests or kept pytest from starting
        unmask_xfails(run, pass_to_pass, before)
    passed, fixed = run.passed(), run.passed(strict=True)
    return TestReport(
        fail_to_pass={t: t in fixed for t in fail_to_pass},
        pass_to_pass={t: t in passed for t in pass_to_pass},
        infra_error=infra_error,
    )


def run_fresh(fresh: Callable[[], Sandbox], tests: Sequence[str],
              command: PytestCommand | None = None, timeout: float = 300.0,
              changes: dict[str, bytes | None] | None = None,
              protected: Callable[[str], bool] = lambda rel: False) -> RunReport:
    """``tests`` run in a new sandbox, ``fresh()``, which it destroys: the task as it came
    (`grade`'s ``as_it_came``), or with ``changes`` applied, all but those ``protected``
    names."""
    sb = fresh()
    try:
        apply_changes(sb, changes or {}, protected)
        return run_pytest(sb, command or default_command(), tests, timeout)
    finally:
        sb.destroy()


def restore(sandbox: Sandbox, protected: Callable[[str], bool]) -> None:
    """Put the changed paths ``protected`` names (relative to /workspace) back as the
    sandbox's image had them; one the image did not have is removed."""
    for ch in sandbox.changes():
        if not protected(ch.path.removeprefix(WORKSPACE + "/")):
            continue
        try:
            original = sandbox.read_original(ch.path)
        except SandboxError:  # added by the episode
            with contextlib.suppress(SandboxError):
                sandbox.remove(ch.path)
            continue
        sandbox.write_file(ch.path, original)


@reward("outcome")
def outcome(ctx: RewardContext, *, mode: Literal["binary", "fraction"] = "binary") -> float:
    """binary: 1 when every fail-to-pass and pass-to-pass test passes, else 0.
    fraction: the share of fail-to-pass tests passing, 0 if any pass-to-pass test broke."""
    rep = ctx.tests
    if rep is not None and rep.infra_error:
        raise GradingError(f"the test run says nothing of the episode: {rep.infra_error}")
    if rep is None or not (rep.fail_to_pass or rep.pass_to_pass):
        return 0.0
    if mode not in ("binary", "fraction"):
        raise ValueError(f"rewards.outcome.params.mode: must be 'binary' or 'fraction', got {mode!r}")
    p2p_ok = all(rep.pass_to_pass.values())
    if mode == "binary":
        return float(p2p_ok and all(rep.fail_to_pass.values()))
    if not p2p_ok:
        return 0.0
    if not rep.fail_to_pass:
        return 1.0
    return sum(rep.fail_to_pass.values()) / len(rep.fail_to_pass)
