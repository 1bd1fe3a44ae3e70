"""Suite validation in the same sandboxes the runner grades in.

A task is valid when the unpatched base fails every FAIL_TO_PASS test and passes every
PASS_TO_PASS test, and the gold patch, applied to a fresh grading copy, passes all of them in
`runs` runs out of `runs`.
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


def reconcile_pass_to_pass(images: TaskImages, task: Task) -> tuple[Task, list[str]]:
    """Drop PASS_TO_PASS tests that fail on the unpatched base in the grading environment.

    The builder finds tests on the host's Python; the grading sandbox has its own interpreter
    and only the task's pinned packages, so a test that needs something only the host has
    (a stdlib module a distribution splits out, say) fails there whatever the agent does.
    Returns the corrected task and the tests dropped; FAIL_TO_PASS is never touched.
    """
    _, base = grade_changes(images, task, {})
    bad = [t for t in task.PASS_TO_PASS if t not in base.passed()]
    if not bad:
        return task, []
    keep = [t for t in task.PASS_TO_PASS if t not in bad]
    if not keep:
        raise ValueError(f"task {task.instance_id!r}: no PASS_TO_PASS test passes in the grading environment")
    return task.model_copy(update={"PASS_TO_PASS": keep}), bad
