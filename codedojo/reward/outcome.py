"""Outcome reward from the task's tests: fail-to-pass must now pass, pass-to-pass must still pass.

`run_tests` runs pytest inside the sandbox (the agent's environment, after the episode) and
reads per-test results from pytest's `-rA` summary, which every pytest version prints the same
way; a test that pytest never reports (not collected, crashed run) counts as failed. `grade`
first puts back what an episode may not change: the tests' own files and the test machinery
(conftest.py files, pytest configuration, modules that shadow pytest: the bench's
`test_machinery`), as the sandbox's image had them, so that no change passes the tests by
changing how they run.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Sequence

from codedojo.bench.testrun import parse_pytest_output
from codedojo.bench.workspace import test_machinery
from codedojo.reward.base import RewardContext, TestReport, reward
from codedojo.sandbox.base import WORKSPACE, Sandbox, SandboxError

PASSING = ("passed", "xfail", "xpass")


def parse_pytest_summary(output: str, tests: Sequence[str] = ()) -> dict[str, bool]:
    """node id -> passed, from `pytest -rA` output (`parse_pytest_output`'s reading; XFAIL and
    XPASS count as passing, as SWE-bench does); ``tests``: the ids asked for, found as written."""
    report = parse_pytest_output(output, tests)
    return {t: o in PASSING for t, o in report.outcomes.items()}


def run_tests(
    sandbox: Sandbox,
    tests: Sequence[str],
    *,
    command: str = "python3 -m pytest",
    cwd: str = "/workspace",
    timeout: float = 300.0,
    strict: Sequence[str] = (),
) -> dict[str, bool]:
    """Run the given pytest node ids in the sandbox; every requested id gets a result. Those
    of ``strict`` pass only by passing (or xpassing), not by failing as expected."""
    if not tests:
        return {}
    line = f"{command} -rA -q -p no:cacheprovider " + " ".join(shlex.quote(t) for t in tests)
    r = sandbox.exec(line, cwd=cwd, timeout=timeout)
    outcomes = parse_pytest_output(r.stdout + "\n" + r.stderr, tests).outcomes
    fixed = set(strict)
    return {t: outcomes.get(t) in (("passed", "xpass") if t in fixed else PASSING)
            for t in tests}


def grade(sandbox: Sandbox, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
          python_path: Sequence[str] = (".",), **kw: object) -> TestReport:
    """Run both test sets in ``sandbox`` once what judges them is as the image had it (see the
    module's docstring). A fail-to-pass test that xfails was not fixed (`pytest.xfail()` in
    the code under test)."""
    tests = [*fail_to_pass, *pass_to_pass]
    restore_test_files(sandbox, {t.split("::", 1)[0] for t in tests}, python_path)
    results = run_tests(sandbox, tests, strict=fail_to_pass, **kw)  # type: ignore[arg-type]
    return TestReport(
        fail_to_pass={t: results[t] for t in fail_to_pass},
        pass_to_pass={t: results[t] for t in pass_to_pass},
    )


def restore_test_files(sandbox: Sandbox, files: set[str], python_path: Sequence[str]) -> None:
    """Put the changed test files and test machinery back as the sandbox's image had them
    (paths relative to /workspace; one the image did not have is removed)."""
    for ch in sandbox.changes():
        rel = ch.path.removeprefix(WORKSPACE + "/")
        if rel not in files and not test_machinery(rel, python_path):
            continue
        try:
            original = sandbox.read_original(ch.path)
        except SandboxError:  # added by the episode
            with contextlib.suppress(SandboxError):
                sandbox.remove(ch.path)
            continue
        sandbox.write_file(ch.path, original)


@reward("outcome")
def outcome(ctx: RewardContext, *, mode: str = "binary") -> float:
    """binary: 1 when every fail-to-pass and pass-to-pass test passes, else 0.
    fraction: the share of fail-to-pass tests passing, 0 if any pass-to-pass test broke."""
    rep = ctx.tests
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
