"""Outcome reward from the task's tests: fail-to-pass must now pass, pass-to-pass must still pass.

`run_tests` runs pytest in a sandbox and reads per-test results from pytest's `-rA` summary,
which every pytest version prints the same way; a test that pytest never reports (not
collected, crashed run) counts as failed. Results are read as the bench reads them
(`codedojo.bench.testrun.TestReport`): a fail-to-pass test must pass (one that xfails, by
`pytest.xfail()` in the code under test, was not fixed); a pass-to-pass test passes or fails
as expected.

`grade` judges an episode on a fresh sandbox of the task's image: the episode's changes to
/workspace are applied there, all but the tests' own files and the test machinery
(conftest.py files, pytest configuration, modules that shadow pytest: `is_test_machinery`),
so nothing the episode did to how the tests run, nor anything outside /workspace (its home
directory, links, processes still running), counts. Without a fresh sandbox it grades in the
episode's own, after putting those files back as the image had them: for a trusted episode.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Sequence

from codedojo.bench.testrun import Canary, is_test_machinery, parse_pytest_output
from codedojo.bench.workspace import apply_changes, collect_changes
from codedojo.reward.base import RewardContext, TestReport, reward
from codedojo.sandbox.base import WORKSPACE, Sandbox, SandboxError


def parse_pytest_summary(output: str, tests: Sequence[str] = ()) -> dict[str, bool]:
    """node id -> passed or failed as expected, from `pytest -rA` output; ``tests``: the ids
    asked for, found as written."""
    report = parse_pytest_output(output, tests)
    passed = report.passed()
    return {t: t in passed for t in report.outcomes}


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
    of ``strict`` pass only by passing, not by failing as expected."""
    if not tests:
        return {}
    canary = Canary.plant(sandbox, cwd)  # a test that must fail: forged outcomes are seen
    run = [*tests, canary.node_id]
    line = f"{command} -rA -q -p no:cacheprovider " + " ".join(shlex.quote(t) for t in run)
    try:
        r = sandbox.exec(line, cwd=cwd, timeout=timeout)
    finally:
        canary.remove(sandbox)
    report = parse_pytest_output(r.stdout + "\n" + r.stderr, run)
    canary.judge(report, tests)
    passed, fixed = report.passed(), report.passed(strict=True)
    strict_ids = set(strict)
    return {t: t in (fixed if t in strict_ids else passed) for t in tests}


def grade(sandbox: Sandbox, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
          fresh: Sandbox | None = None, python_path: Sequence[str] = (".",),
          **kw: object) -> TestReport:
    """Both test sets' results for the episode whose sandbox is ``sandbox``: run in ``fresh``
    (a new sandbox of the task's image) with the episode's changes, or in ``sandbox`` itself
    when none is given (see the module's docstring)."""
    tests = [*fail_to_pass, *pass_to_pass]
    files = {t.split("::", 1)[0] for t in tests}

    def protected(rel: str) -> bool:
        return rel in files or is_test_machinery(rel, python_path)

    if fresh is not None:
        apply_changes(fresh, collect_changes(sandbox), protected)
    else:
        restore(sandbox, protected)
    results = run_tests(fresh or sandbox, tests, strict=fail_to_pass,
                        **kw)  # type: ignore[arg-type]
    return TestReport(
        fail_to_pass={t: results[t] for t in fail_to_pass},
        pass_to_pass={t: results[t] for t in pass_to_pass},
    )


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
