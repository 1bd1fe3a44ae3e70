"""Running a package's pytest suite somewhere and reading per-test outcomes back.

Where the tests run is behind `codedojo.sandbox.base.Executor`: any sandbox, or `LocalExecutor`
for a folder on the host (the builder's validation runs there). The outcome comes from pytest's
`-rA` short summary, which names every test by node id.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import secrets
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from posixpath import normpath

from codedojo.sandbox.base import ExecResult, Executor

_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S.*?)(?: - (.*))?$")
_BADNESS = ("passed", "xfail", "skipped", "xpass", "failed", "error")  # worse to the right
# a failure's section title: pytest frames a long title with fewer underscores, down to one
_SECTION = re.compile(r"^_+ (?:ERROR at \w+ of |ERROR collecting )?(.+?) _+$")


class LocalExecutor:
    """Commands as host processes in their own process group (killed whole on timeout)."""

    def exec(
        self,
        command: str | Sequence[str],
        *,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        t0 = time.monotonic()
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            command, shell=isinstance(command, str), cwd=cwd, env=full_env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
        data = stdin.encode() if isinstance(stdin, str) else stdin
        try:
            out, err = proc.communicate(data, timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:  # a daemon that left the group may hold the pipes: what was read is kept
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
                proc.wait()
                out, err = b"", b""
            timed_out = True
        return ExecResult(
            exit_code=proc.returncode if not timed_out else 124,
            stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
            timed_out=timed_out, duration_s=time.monotonic() - t0,
        )


# What configures or runs the test session itself. Grading takes these from the task, never
# from the agent: a hook in a conftest.py, an option in a config file, a module that shadows
# pytest or runs at interpreter start (sitecustomize, a .pth file) would pass tests unfixed.
# The config files are pytest's own list (the names it looks for, by precedence: pytest 9.2's)
# and, where this interpreter has a pytest, whatever names its list adds (`_config_files`).
TEST_CONFIG_FILES = ("conftest.py", "pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini",
                     "pyproject.toml", "tox.ini", "setup.cfg")
TEST_RUNNER_MODULES = ("pytest", "_pytest", "pluggy", "py", "iniconfig", "sitecustomize",
                       "usercustomize")


def is_test_machinery(rel: str, python_path: Sequence[str] = (".",)) -> bool:
    """Whether a path (relative to /workspace) configures or runs the test session (see
    `TEST_CONFIG_FILES`): a config file anywhere, a .pth file, a package's metadata (a
    ``*.dist-info`` or ``*.egg-info`` folder: its entry points load pytest plugins), or a
    module named as the test runner's at an import root (``python_path``: the task's folders
    on PYTHONPATH; and /workspace itself, first on the path of ``python -m pytest``)."""
    name = rel.rsplit("/", 1)[-1]
    if name in _config_files() or name.endswith(".pth"):
        return True
    # (importlib.metadata finds a metadata folder by its name in lower case)
    if any(part.lower().endswith((".dist-info", ".egg-info")) for part in rel.split("/")[:-1]):
        return True
    for root in {*map(normpath, python_path), "."}:  # ("./src" is the import root src)
        prefix = "" if root in (".", "") else root.strip("/") + "/"
        if rel.startswith(prefix):
            top = rel[len(prefix):].split("/", 1)[0]
            if top.removesuffix(".py") in TEST_RUNNER_MODULES:
                return True
    return False


@functools.cache
def _config_files() -> frozenset[str]:
    """`TEST_CONFIG_FILES` and the names this interpreter's pytest (if any) reads its
    configuration from: a newer pytest's new name is machinery too. Asked at the first use,
    not at import: importing pytest's config takes a while, and pytest is no dependency."""
    try:
        from _pytest.config.findpaths import CONFIG_LOADERS_BY_NAME
    except ImportError:  # (no pytest here, or one that keeps its list otherwise)
        return frozenset(TEST_CONFIG_FILES)
    return frozenset({*TEST_CONFIG_FILES, *CONFIG_LOADERS_BY_NAME})


@dataclass
class TestReport:
    outcomes: dict[str, str] = field(default_factory=dict)
    """node id -> passed | failed | error | skipped | xfail | xpass"""
    messages: dict[str, str] = field(default_factory=dict)
    """node id -> the failure's `E` lines (or the summary message), for failed/error tests"""
    exit_code: int = 0
    timed_out: bool = False
    duration_s: float = 0.0
    output_tail: str = ""
    reported: int = 0  # outcomes pytest itself reported (the rest were filled in as errors)
    forged: bool = False  # the canary did not fail: no outcome is the tests' (`Canary`)

    def passed(self, strict: bool = False) -> set[str]:
        """Tests that passed, or failed as expected (xfail) unless ``strict``. A run that
        timed out passed none: code that hangs the test process (at its exit, say, after
        every test reported a pass) is broken code."""
        ok = ("passed",) if strict else ("passed", "xfail")
        return set() if self.timed_out else {t for t, o in self.outcomes.items() if o in ok}

    def failed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o in ("failed", "error", "xpass")}

    @property
    def infra_error(self) -> str | None:
        """Why this run says nothing about the tests (timeout, collection or usage error)."""
        if self.timed_out:
            return "test run timed out"
        if self.exit_code in (2, 3, 4) and not self.reported:
            return f"pytest exit {self.exit_code}: {self.output_tail[-400:]}"
        if self.exit_code != 5 and not self.reported:  # (1 too: no pytest, a crash at start)
            return f"test command exit {self.exit_code}: {self.output_tail[-400:]}"
        return None


@dataclass(frozen=True)
class PytestCommand:
    """How to call pytest on a tree at `root` (a path as the executor sees it). The tree's
    ``python_path`` folders are PYTHONPATH; with ``inherit_pythonpath`` they come before the
    PYTHONPATH the command would otherwise have (an image that puts its packages, pytest among
    them, on PYTHONPATH), else they replace it (the host's stays out of a package's tests)."""

    root: str
    python: str = sys.executable
    python_path: Sequence[str] = (".",)
    extra_args: Sequence[str] = ()
    inherit_pythonpath: bool = False

    def argv(self, tests: Sequence[str] | None = None) -> list[str]:
        # (--show-capture=no: what tests print is no outcome, and `-rA` would print every
        # passing test's; a run whose output the sandbox cuts believes nothing, `OUTPUT_CUT`)
        pytest = [
            self.python, "-m", "pytest", "-rA", "-q", "--tb=short", "--show-capture=no",
            "-p", "no:cacheprovider",
            "-o", "addopts=", "-o", "console_output_style=classic", "--color=no",
            f"--rootdir={self.root}", *self.extra_args, *(tests or ()),
        ]
        if not self.inherit_pythonpath:
            return pytest
        return ["sh", "-c", 'PYTHONPATH="$0${PYTHONPATH:+:$PYTHONPATH}" exec "$@"',
                self._paths(), *pytest]

    def env(self) -> dict[str, str]:
        env = {
            "PYTHONDONTWRITEBYTECODE": "1",  # keeps the tree (and Sandbox.changes()) clean
            "PYTHONHASHSEED": "0",
            "NO_COLOR": "1",
            # a wide terminal: pytest cuts a summary line (and its " - message") to the width
            "COLUMNS": "500",
        }
        return env if self.inherit_pythonpath else {"PYTHONPATH": self._paths(), **env}

    def _paths(self) -> str:
        return os.pathsep.join(self.root if p in (".", "") else f"{self.root}/{p}"
                               for p in self.python_path)


def run_pytest(
    ex: Executor, cmd: PytestCommand, tests: Sequence[str] | None = None, timeout: float = 120.0,
    known: Sequence[str] = (),
) -> TestReport:
    """Run ``tests`` (all without them), with a canary (`Canary`) beside them; ``known``: more
    node ids the output is read by (one with " - " in it is found whole, see
    `parse_pytest_output`)."""
    beside = secrets.choice(tests) if tests else ""
    canary = Canary.plant(ex, cmd.root, beside) if tests else None
    try:
        run = tests
        if canary:  # (at a drawn place after the tests of the file it sits beside)
            run = [*tests]
            after = _after_file(run, beside)
            run.insert(after + secrets.randbelow(len(run) - after + 1), canary.node_id)
        res = ex.exec(cmd.argv(run), cwd=cmd.root, env=cmd.env(), timeout=timeout)
    finally:
        if canary:
            canary.remove(ex)
    report = parse_pytest_output(res.stdout + "\n" + res.stderr,
                                 [*(run or ()), *known])
    report.exit_code = res.exit_code
    report.timed_out = res.timed_out
    report.duration_s = res.duration_s
    report.output_tail = (res.stdout + res.stderr)[-4000:]
    if res.truncated:  # (the cut middle may hold what a line at the end denies)
        if canary:
            canary.take(report)
        _fail_all(report, tests or (), OUTPUT_CUT)
    elif canary:
        canary.judge(report, tests or ())
    report.reported = len(report.outcomes)
    if tests:
        # A requested test that pytest never reported (renamed, deleted, not collected) failed.
        for t in tests:
            if t not in report.outcomes:
                report.outcomes[t] = "error"
                report.messages.setdefault(t, "test was not collected")
    return report


def _after_file(tests: Sequence[str], beside: str) -> int:
    """The place after the last of ``tests`` in the file of node id ``beside``: pytest imports
    test modules in the order it is given them, and a canary imported first would import what
    that file imports before the file's own code ran (an environment variable it sets, a path
    it adds), so the file's tests would run against modules loaded otherwise."""
    file = beside.split("::", 1)[0]
    return 1 + max(i for i, t in enumerate(tests) if t.split("::", 1)[0] == file)


OUTPUT_CUT = ("the test run's output passed the sandbox's limit and was cut: no outcome of the run "
              "is believed (a summary printed after the cut could deny the failures cut out)")


def _fail_all(report: TestReport, tests: Sequence[str], message: str) -> None:
    """Every test of ``tests`` and of ``report`` an error, for ``message``'s reason."""
    for t in {*tests, *report.outcomes}:
        report.outcomes[t] = "error"
        report.messages[t] = message


XFAIL_HIDES = ("failed as expected where it passes on the task as it came (an xfail in the "
               "code under test hides no break)")


def unmask_xfails(report: TestReport, tests: Sequence[str],
                  baseline: Callable[[], TestReport]) -> None:
    """Pass-to-pass ``tests`` that fail as expected in ``report`` but not on the task as it
    came (``baseline``'s run, asked for only if one does) failed: code under test that calls
    ``pytest.xfail()`` cannot pass a test it broke."""
    xfailed = [t for t in tests if report.outcomes.get(t) == "xfail"]
    if not xfailed:
        return
    before = baseline().outcomes
    for t in xfailed:
        if before.get(t) != "xfail":
            report.outcomes[t] = "failed"
            report.messages[t] = XFAIL_HIDES


class Baselines:
    """Each task's tests run on the task as it came, kept once run: one run a task, however
    many episodes of it ask at once (a bench run's samples, an RL step's rollouts). A run that
    says nothing of the tests (`TestReport.infra_error`) is returned, not kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, TestReport] = {}
        self._locks: dict[str, threading.Lock] = {}

    def get(self, key: str, run: Callable[[], TestReport]) -> TestReport:
        """The kept run of the task ``key`` names, or ``run()`` now (and kept)."""
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key in self._runs:
                return self._runs[key]
            report = run()
            if not report.infra_error:
                self._runs[key] = report
            return report


def _word() -> str:
    """Lower-case letters, 6 to 12 of them, drawn."""
    return "".join(secrets.choice(string.ascii_lowercase) for _ in range(6 + secrets.randbelow(7)))


FORGED = ("the run's outcomes are not the tests': a test that must fail did not (the code under "
          "test changed how the tests run or report)")


@dataclass(frozen=True)
class Canary:
    """A test that must fail, run beside the tests a grade reads, under a name drawn anew each
    run: code under test that makes every test pass (patching pytest as it is imported,
    printing a summary of its own and leaving) makes it pass too, or leaves it unreported,
    and then no outcome of the run is believed. It looks like the tests it sits beside: its
    file is a ``test_<word>.py`` in the folder of one of the tests (drawn; the tree's root,
    with no imports, where that folder cannot be written) with that test file's module-level
    imports (each in a ``try``: the canary runs where one fails), its test a function
    ``test_<word>`` (run as the tests it forges are) that names what those imports bound,
    then compares two drawn numbers; each word letters of a drawn length, at a drawn place
    among the tests pytest is given after those of that file (`_after_file`). That raises
    the bar for code that would spare it while forging tests by what they are (name, place,
    the task's objects their modules hold); code that reads the tests' bodies can still tell
    it apart, and its node id is on pytest's command line. A task whose config collects
    functions of other names (``python_functions``) does not collect it, and its runs are
    infra failures."""

    path: str  # its file, as the executor sees it
    node_id: str

    @classmethod
    def plant(cls, ex: Executor, root: str, beside: str) -> Canary:
        """Write the canary into the folder of the test ``beside`` names (a node id; the
        tree's ``root`` where that folder is not there), never over a file that is."""
        module, test = f"test_{_word()}", f"test_{_word()}"
        file = beside.split("::", 1)[0]
        folder = file.rpartition("/")[0] or "."
        # the test file's source, where the canary can go beside it (else exit 3)
        r = ex.exec(["sh", "-c", '[ -d "$1/$2" ] && [ -w "$1/$2" ] || exit 3; '
                     'cat -- "$1/$3" 2>/dev/null; exit 0', "sh", root, folder, file], timeout=60)
        folder = folder if r.exit_code == 0 else "."
        head, names = _imports(r.stdout) if r.exit_code == 0 and not r.truncated else ([], [])
        a = secrets.randbelow(10**6)
        body = "".join(f"{line}\n" for line in head) + f"\n\ndef {test}():\n"
        if names:
            body += f"    used = ({', '.join(names)},)\n"
        body += f"    assert {a} == {a + 1 + secrets.randbelow(9)}\n"
        rel = f"{module}.py" if folder == "." else f"{folder}/{module}.py"
        # (set -C: a file of that name is not overwritten)
        r = ex.exec(["sh", "-c", 'set -C; cat > "$1/$2"', "sh", root, rel], stdin=body,
                    timeout=60)
        if r.exit_code != 0:
            raise RuntimeError(f"cannot write the canary test: {r.stderr.strip()[-300:]}")
        return cls(path=f"{root}/{rel}", node_id=f"{rel}::{test}")

    def remove(self, ex: Executor) -> None:
        ex.exec(["rm", "-f", self.path], timeout=60)

    def take(self, report: TestReport) -> str | None:
        """The canary's outcome, taken out of ``report`` (None: pytest did not report it)."""
        # (found by its name alone: pytest names it from its rootdir, which may not be the tree's)
        name = self.node_id.rsplit("/", 1)[-1]
        key = next((k for k in report.outcomes if k == name or k.endswith("/" + name)), None)
        report.messages.pop(key or "", None)
        return report.outcomes.pop(key, None) if key else None

    def judge(self, report: TestReport, tests: Sequence[str]) -> None:
        """Take the canary's outcome out of ``report``; if it did not fail, while the run
        reported other tests, every test of the run is an error: for the files pytest could
        not collect (it then runs no test), else as forged (`FORGED`)."""
        outcome = self.take(report)
        if outcome == "failed" or not report.outcomes:
            return
        # (a collection error names a file, not a test)
        uncollected = {k: report.messages.get(k, "") for k, o in report.outcomes.items()
                       if o == "error" and "::" not in k}
        if outcome is None and uncollected:
            _fail_all(report, tests, "pytest ran no test: it could not collect "
                      + "; ".join(f"{k}: {m}" if m else k for k, m in uncollected.items()))
            return
        report.forged = True
        _fail_all(report, tests, FORGED)


def _imports(source: str) -> tuple[list[str], list[str]]:
    """A Python module's top-level imports as lines (a ``__future__`` one as it is, each
    other in a ``try`` that goes on past any failure), and the names they bind; none where
    the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return [], []
    future, others, names = [], [], []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            future.append(ast.unparse(node))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            others += ["try:", f"    {ast.unparse(node)}", "except BaseException:", "    pass"]
            names += [a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"]
    return [*future, *others], list(dict.fromkeys(names))


def parse_pytest_output(text: str, tests: Sequence[str] = ()) -> TestReport:
    """The outcomes of `pytest -rA`'s summary lines (status, node id, then maybe " - " and a
    reason) and the failures' `E` lines. A node id may hold spaces and " - " itself
    (``test_a[a - b]``): each of ``tests`` is looked for as written (the whole rest of a line,
    or its start before " - "); a PASSED line, which gives no reason, is an id whole; other
    ids end at the first " - "."""
    report = TestReport()
    known = frozenset(tests)
    e_lines: dict[str, list[str]] = {}
    current: str | None = None
    in_summary = False
    for raw in text.splitlines():
        line = raw.rstrip()
        if "short test summary info" in line:
            in_summary = True
            current = None
            continue
        if in_summary:
            m = _SUMMARY.match(line)
            if m:
                kind, nodeid, msg = m.group(1), m.group(2), m.group(3)
                rest = line[len(kind) + 1:]
                if kind == "PASSED":
                    nodeid, msg = rest, None
                elif asked := _known_id(rest, known):
                    nodeid, msg = asked, rest[len(asked) + 3:] or None
                outcome = kind.lower()
                if outcome == "skipped" and nodeid.startswith("["):
                    continue  # "SKIPPED [1] file.py:3: reason" names no test id
                # a test named twice keeps its worse outcome: lines printed after pytest's
                # (by code under test, at exit) cannot turn a failure into a pass
                before = report.outcomes.get(nodeid, outcome)
                outcome = max(before, outcome, key=_BADNESS.index)
                report.outcomes[nodeid] = outcome
                if outcome in ("failed", "error") and msg:
                    report.messages[nodeid] = msg
            continue
        m = _SECTION.match(line)
        if m:
            current = m.group(1)
            e_lines.setdefault(current, [])
            continue
        if current is not None and line.startswith("E "):
            e_lines[current].append(line[1:].strip())
    for nodeid, outcome in report.outcomes.items():
        if outcome not in ("failed", "error"):
            continue
        lines = e_lines.get(_headline(nodeid))
        if lines:
            report.messages[nodeid] = "\n".join(lines[:12])
    return report


def _known_id(rest: str, known: frozenset[str]) -> str | None:
    """The longest of ``known`` that a summary line's rest is, or starts before a " - "."""
    if rest in known:
        return rest
    cuts = [i for i in range(len(rest)) if rest.startswith(" - ", i)]
    return next((rest[:i] for i in reversed(cuts) if rest[:i] in known), None)


def _headline(nodeid: str) -> str:
    """pytest's section title for a node id: `Class.test[param]` without the file."""
    parts = nodeid.split("::")
    return ".".join(parts[1:]) if len(parts) > 1 else parts[0]
