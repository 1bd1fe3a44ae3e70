"""Suite validation in the same sandboxes the runner grades in.

A task is valid when the unpatched base fails every FAIL_TO_PASS test and passes every
PASS_TO_PASS test, and the gold patch, applied to a fresh grading copy, passes all of them in
`runs` runs out of `runs`. A newly built suite is held to the same checks (`reconcile_task`)
before it is saved: its tests were chosen on the host's Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from codedojo.bench.patching import apply_patch
from codedojo.bench.task import Task
from codedojo.bench.workspace import TaskImages, grade_changes, task_trees


@dataclass
class Validation:
    instance_id: str
    category: str
    f2p: int
    p2p: int
    base_f2p_failed: int = 0
    base_p2p_passed: int = 0
    gold_runs_passed: int = 0
    runs: int = 3
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.base_f2p_failed == self.f2p
            and self.base_p2p_passed == self.p2p
            and self.gold_runs_passed == self.runs
        )


def gold_changes(task: Task) -> dict[str, bytes | None]:
    """The gold patch as file contents over the grading tree (what the oracle would write)."""
    _, grade = task_trees(task)

    def read(rel: str) -> str | None:
        p = grade / rel
        return p.read_text(encoding="utf-8") if p.is_file() else None

    return {rel: None if c is None else c.encode() for rel, c in apply_patch(task.patch, read).items()}


def validate_task(images: TaskImages, task: Task, runs: int = 3) -> Validation:
    v = Validation(task.instance_id, task.category, len(task.FAIL_TO_PASS), len(task.PASS_TO_PASS), runs=runs)
    try:
        images.warm(task)
    except Exception as e:  # (an sdist that cannot be had, or differs from the pinned one)
        v.error = f"task image: {type(e).__name__}: {e}"[:500]
        return v
    try:
        _, base = grade_changes(images, task, {})
        failed, passed = base.failed(), base.passed()
        v.base_f2p_failed = sum(t in failed for t in task.FAIL_TO_PASS)
        v.base_p2p_passed = sum(t in passed for t in task.PASS_TO_PASS)
        gold = gold_changes(task)
        for _ in range(runs):
            # A fresh grading copy per run: a run must not inherit files an earlier one wrote.
            ok, _ = grade_changes(images, task, gold)
            v.gold_runs_passed += ok
    except Exception as e:
        v.error = f"{type(e).__name__}: {e}"[:500]
    return v


def validate_suite(
    images: TaskImages,
    tasks: Sequence[Task],
    runs: int = 3,
    parallel: int = 1,
    progress: Callable[[Validation], None] | None = None,
) -> list[Validation]:
    out: list[Validation] = []
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for v in pool.map(lambda t: validate_task(images, t, runs), tasks):
            out.append(v)
            if progress:
                progress(v)
    return out


def reconcile_task(images: TaskImages, task: Task) -> tuple[Task | None, str]:
    """The task as it grades in the sandbox, checked there as `validate_task` checks it.

    The builder finds tests on the host's Python; the grading sandbox has its own interpreter
    and only the task's pinned packages, so a test that needs something only the host has
    (a stdlib module a distribution splits out, say) fails there whatever the agent does, and
    code gated on the interpreter's version may hold the bug on one and not the other.
    PASS_TO_PASS tests that fail on the unpatched base are dropped; the task itself is dropped
    when a FAIL_TO_PASS test does not fail on the base, no PASS_TO_PASS test passes there, or
    the gold patch does not resolve it. Returns (the corrected task, what was dropped from it,
    "" for nothing) or (None, why the task was dropped).
    """
    try:
        _, base = grade_changes(images, task, {})
        if base.infra_error:
            return None, f"the base's tests did not run in the grading sandbox: {base.infra_error}"
        if missed := [t for t in task.FAIL_TO_PASS if t not in base.failed()]:
            return None, (f"{len(missed)} FAIL_TO_PASS test(s) do not fail on the unpatched base "
                          f"in the grading sandbox (the bug does not show there): {missed[0]}")
        bad = [t for t in task.PASS_TO_PASS if t not in base.passed()]
        if len(bad) == len(task.PASS_TO_PASS):
            return None, "no PASS_TO_PASS test passes on the unpatched base in the grading sandbox"
        if bad:
            keep = [t for t in task.PASS_TO_PASS if t not in bad]
            task = task.model_copy(update={"PASS_TO_PASS": keep})
        ok, gold = grade_changes(images, task, gold_changes(task))
    except Exception as e:  # (a task image that cannot be built: the task cannot be graded)
        return None, f"error in the grading sandbox: {type(e).__name__}: {e}"[:500]
    if not ok:
        unfixed = [t for t in task.FAIL_TO_PASS if t not in gold.passed(strict=True)]
        unfixed += [t for t in task.PASS_TO_PASS if t not in gold.passed()]
        why = f"{unfixed[0]} fails" if unfixed else gold.infra_error or "no test ran"
        return None, f"the gold patch does not pass in the grading sandbox: {why[:300]}"
    return task, f"{len(bad)} PASS_TO_PASS test(s) fail in the sandbox; dropped" if bad else ""


def reconcile_tasks(images: TaskImages, tasks: Sequence[Task], log: Callable[[str], None]
                    ) -> list[Task]:
    """The tasks that grade in the sandbox, corrected (`reconcile_task`), in order; a task
    dropped or corrected is logged with why. A task the null agent would solve, or no agent
    could, is no task."""
    kept: list[Task] = []
    for t in tasks:
        fixed, note = reconcile_task(images, t)
        if fixed is None:
            log(f"{t.instance_id}: task dropped: {note}")
            continue
        if note:
            log(f"{t.instance_id}: {note}")
        kept.append(fixed)
    return kept
