"""A task's filesystems: the agent's copy and the grading copy, as cached sandbox images.

Layers, bottom up: the host base, one Python environment per distinct `task.environment`
(a venv at /opt/venv, shared by every task that pins the same packages), then the task's tree
at /workspace. The agent's tree is the sdist with the bug applied and `hidden_paths` removed;
the grading tree is the same plus the hidden tests. Both trees are scrubbed of VCS history and
neither holds the gold patch. Images are named by content, so once built, preparing a task's
sandbox is a name lookup plus `provider.create` (the `setup_ms_p50` figure of the benchmark).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from codedojo.bench.patching import apply_patch_to_dir
from codedojo.bench.source import BYTECODE, RUN_CACHES, cache_root, fetch_sdist, scrub, unpack
from codedojo.bench.task import Task
from codedojo.bench.testrun import (
    Baselines,
    PytestCommand,
    TestReport,
    is_test_machinery,
    run_pytest,
    unmask_xfails,
)
from codedojo.paths import staged_dir
from codedojo.sandbox.base import WORKSPACE, FileInfo, Limits, Sandbox, SandboxError, SandboxSpec

VENV = "/opt/venv"


def _cache_debris(rel: str) -> bool:
    """What a run leaves, never the agent's change: bytecode and test caches (by name: a
    `config.pyc.md` or a `.pyc_notes/` is the agent's)."""
    parts = rel.split("/")
    return any(p in RUN_CACHES for p in parts) or parts[-1].endswith(BYTECODE)


def _hidden(rel: str, hidden: list[str]) -> bool:
    return any(rel == h or rel.startswith(h.rstrip("/") + "/") for h in hidden)


def hidden_from_agent(task: Task) -> list[str]:
    """What the agent's copy leaves out and grading takes as pinned: the task's hidden paths,
    and every file its tests are in, whatever it is called (a package's `tests.py`, or files
    its own pytest config collects, are not found by name)."""
    files = {t.split("::", 1)[0] for t in [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]}
    return [*task.hidden_paths, *sorted(f for f in files if not _hidden(f, task.hidden_paths))]


def task_trees(task: Task) -> tuple[Path, Path]:
    """(agent tree, grading tree) on the host, built once per task content and cached."""
    key = task.content_hash()[:16]
    dest = cache_root() / "trees" / f"{task.instance_id}-{key}"
    if (dest / "done").is_file():
        return dest / "agent", dest / "grade"
    sdist = fetch_sdist(task.base, expect_sha256=task.base_sha256)
    src = unpack(sdist)
    with staged_dir(dest, replace=False) as tmp:
        grade = tmp / "grade"
        shutil.copytree(src, grade)
        apply_patch_to_dir(task.bug_patch, grade)
        scrub(grade)
        agent = tmp / "agent"
        shutil.copytree(grade, agent, ignore=_ignore_hidden(grade, hidden_from_agent(task)))
        (tmp / "done").write_text(task.instance_id)
    return dest / "agent", dest / "grade"


def _ignore_hidden(root: Path, hidden: list[str]):
    def ignore(dirpath: str, names: list[str]) -> set[str]:
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel + "/"
        return {n for n in names if _hidden(rel + n, hidden)}

    return ignore


class TaskImages:
    """Builds (once) and names the sandbox images of tasks on a provider with an image store."""

    def __init__(self, provider, python: str = "/usr/bin/python3"):
        if not hasattr(provider, "images"):
            raise SandboxError("provider: needs an image store (`provider.images`) to build task images")
        self.provider = provider
        self.python = python
        self._lock = threading.Lock()
        self._memo: dict[str, str] = {}
        self._baselines = Baselines()

    def _named(self, name: str, build) -> str:
        with self._lock:
            if name in self._memo:
                return self._memo[name]
            try:
                image_id = self.provider.images.resolve(name).id
            except SandboxError:
                image_id = build().id
                self.provider.images.tag(image_id, name)
            self._memo[name] = image_id
            return image_id

    def env_image(self, task: Task) -> str:
        key = hashlib.sha256(json.dumps([self.python, sorted(task.environment)]).encode()).hexdigest()[:16]
        return self._named(
            f"bench-env-{key}",
            lambda: self.provider.images.from_python_env(task.environment, python=self.python),
        )

    def _tree_image(self, task: Task, which: str) -> str:
        agent, grade = task_trees(task)
        env = self.env_image(task)
        tree = agent if which == "agent" else grade
        key = hashlib.sha256(f"{env}:{task.content_hash()}".encode()).hexdigest()[:16]
        return self._named(
            f"bench-{which}-{task.instance_id}-{key}",
            lambda: self.provider.images.from_directory(str(tree), parent=env),
        )

    def agent_image(self, task: Task) -> str:
        return self._tree_image(task, "agent")

    def grade_image(self, task: Task) -> str:
        return self._tree_image(task, "grade")

    def warm(self, task: Task) -> None:
        self.agent_image(task)
        self.grade_image(task)

    def agent_sandbox(self, task: Task, limits: Limits | None = None) -> Sandbox:
        return self.provider.create(SandboxSpec(image=self.agent_image(task), limits=limits or Limits()))

    def grade_sandbox(self, task: Task, limits: Limits | None = None) -> Sandbox:
        return self.provider.create(SandboxSpec(image=self.grade_image(task), limits=limits or Limits()))

    def baseline(self, task: Task) -> TestReport:
        """The hidden tests' run on the task as it came, kept once it ran (a run that says
        nothing of the tests, `TestReport.infra_error`, is not kept)."""
        return self._baselines.get(task.content_hash(), lambda: grade_changes(self, task, {})[1])


def pytest_command(task: Task) -> PytestCommand:
    return PytestCommand(root=WORKSPACE, python=f"{VENV}/bin/python", python_path=tuple(task.image.python_path),
                         extra_args=tuple(task.image.pytest_args))


# What the changes an episode made are read into the host, in all: a sandbox's sparse files
# cost it nothing on its disk, and read back whole, a few of them would take the host's memory.
MAX_CHANGE_BYTES = 256 << 20


class NewFile(bytes):
    """A changed file's new bytes (a `bytes`, equal to them) with its permission bits, which
    `apply_changes` gives the file it writes (an executable script stays one)."""

    mode: int

    def __new__(cls, data: bytes, mode: int = 0o644) -> NewFile:
        out = super().__new__(cls, data)
        out.mode = mode
        return out


def collect_changes(sb: Sandbox, max_bytes: int = MAX_CHANGE_BYTES) -> dict[str, bytes | None]:
    """What the agent changed under /workspace: relative path -> new bytes, a `NewFile` with
    their mode (None = deleted). A link that leads to a file under /workspace is taken as that
    file's bytes and mode (the sandbox API makes no links). A file (or link) of the image that
    stands as no file now (a directory, a link leading outside /workspace or nowhere) is
    deleted; such a path the image had no file at is left out (where the image had a directory
    there, `changes` names what it held as deleted: the directory itself, with what grading
    protects in it, is kept). Files past ``max_bytes`` in all are left out, as unreadable ones
    are (the grading copy has them as the task had them: the episode's loss, never the host's
    memory)."""
    out: dict[str, bytes | None] = {}
    left = max_bytes
    for ch in sb.changes():
        rel = ch.path[len(WORKSPACE) + 1:] if ch.path.startswith(WORKSPACE + "/") else ch.path.lstrip("/")
        if not rel or _cache_debris(rel):
            continue
        if ch.kind == "deleted":
            out[rel] = None
            continue
        try:
            info: FileInfo | None = sb.stat(ch.path)
            if info.kind == "symlink":
                info = _link_target(sb, ch.path)
            if info is None or info.kind != "file":
                if ch.kind == "modified":
                    out[rel] = None
                continue
            data = sb.read_file(info.path, max_bytes=left)
        except SandboxError:  # (FileTooLarge among them)
            continue
        out[rel] = NewFile(data, info.mode & 0o777)
        left -= len(data)
    return out


def _link_target(sb: Sandbox, path: str) -> FileInfo | None:
    """What link ``path`` leads to, every link on the way followed, where that is under
    /workspace; None where it leads outside it or nowhere."""
    try:
        r = sb.exec(["readlink", "-e", "--", path], timeout=30)
        target = r.stdout.removesuffix("\n")
        if r.exit_code != 0 or not target.startswith(WORKSPACE + "/"):
            return None
        return sb.stat(target)
    except SandboxError:
        return None


def grade_changes(
    images: TaskImages, task: Task, changes: Mapping[str, bytes | None], runs: int = 1
) -> tuple[bool, TestReport]:
    """Apply the agent's changes to a FRESH grading copy and run the hidden tests there.

    Changes to hidden test paths and to the test machinery (`is_test_machinery`) are ignored: the
    tests that judge, and how they run, are the task's. Returns (resolved, the last report);
    resolved means every F2P test passed and every P2P test passed (or failed as expected,
    xfail, where it does so on the task as it came: `unmask_xfails`) in every run: an F2P test
    that xfails was not fixed (`pytest.xfail()` in the code).
    """
    sb = images.grade_sandbox(task)
    hidden = hidden_from_agent(task)
    try:
        apply_changes(sb, changes, lambda rel: _hidden(rel, hidden)
                      or is_test_machinery(rel, task.image.python_path))
        tests = task.FAIL_TO_PASS + task.PASS_TO_PASS
        ok = True
        report = TestReport()
        for _ in range(runs):
            report = run_pytest(sb, pytest_command(task), tests=tests, timeout=task.timeouts.test_s)
            if changes:
                unmask_xfails(report, task.PASS_TO_PASS, lambda: images.baseline(task))
            ok = ok and resolves(task, report)
        return ok, report
    finally:
        sb.destroy()


def apply_changes(sb: Sandbox, changes: Mapping[str, bytes | None],
                  skip: Callable[[str], bool]) -> None:
    """Write an episode's changes (path under /workspace -> bytes; None: deleted) into ``sb``,
    all but those ``skip`` names: deletions first, deepest first, and a directory or a link
    where a file now stands removed (a directory with what it held), not written through. A
    file gets the mode of its `NewFile`; given plain bytes, the mode the file had (0o644 for a
    new one)."""
    for rel in sorted((r for r, d in changes.items() if d is None and not skip(r)),
                      key=lambda r: -r.count("/")):
        with contextlib.suppress(SandboxError, FileNotFoundError):
            sb.remove(f"{WORKSPACE}/{rel}")
    for rel, data in sorted(changes.items()):
        if data is None or skip(rel):
            continue
        path = f"{WORKSPACE}/{rel}"
        try:
            was: FileInfo | None = sb.stat(path)
        except (SandboxError, FileNotFoundError):
            was = None
        if was is not None and was.kind in ("dir", "symlink"):
            with contextlib.suppress(SandboxError, FileNotFoundError):
                sb.remove(path)
        mode = getattr(data, "mode", None)
        if mode is None:
            mode = was.mode & 0o777 if was is not None and was.kind == "file" else 0o644
        sb.write_file(path, data, mode=mode)


def resolves(task: Task, report: TestReport) -> bool:
    """Every F2P test passed, and every P2P test passed or failed as expected."""
    return set(task.FAIL_TO_PASS) <= report.passed(strict=True) and \
        set(task.PASS_TO_PASS) <= report.passed()


def default_provider():
    """The local sandbox kind, its store under the bench cache unless CODEDOJO_SANDBOX_ROOT says."""
    from codedojo.sandbox.local import LocalProvider

    return LocalProvider(root=os.environ.get("CODEDOJO_SANDBOX_ROOT") or str(cache_root() / "sandbox"))
