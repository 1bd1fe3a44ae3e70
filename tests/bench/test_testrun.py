import os

import pytest

from codedojo.bench.testrun import LocalExecutor, PytestCommand, parse_pytest_output, run_pytest

OUT = """\
..F
=================================== FAILURES ===================================
________________________________ TestX.test_two ________________________________
tests/test_a.py:9: in test_two
    assert f(2) == 5
E   assert 4 == 5
E    +  where 4 = f(2)
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::test_p[a b]
FAILED tests/test_a.py::TestX::test_two - assert 4 == 5
ERROR tests/test_b.py::test_setup - RuntimeError: boom
SKIPPED [1] tests/test_c.py:3: no network
1 failed, 2 passed, 1 error, 1 skipped in 0.10s
"""


def test_parse_summary_and_messages():
    rep = parse_pytest_output(OUT)
    assert rep.passed() == {"tests/test_a.py::test_one", "tests/test_a.py::test_p[a b]"}
    assert rep.failed() == {"tests/test_a.py::TestX::test_two", "tests/test_b.py::test_setup"}
    assert rep.messages["tests/test_a.py::TestX::test_two"].startswith("assert 4 == 5")
    assert "where 4 = f(2)" in rep.messages["tests/test_a.py::TestX::test_two"]
    assert rep.messages["tests/test_b.py::test_setup"] == "RuntimeError: boom"


def test_run_pytest_on_a_folder_and_missing_tests_count_as_errors(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_ok():\n    assert True\n\ndef test_bad():\n    assert 1 == 2\n")
    cmd = PytestCommand(root=str(tmp_path))
    rep = run_pytest(LocalExecutor(), cmd, timeout=60)
    assert rep.passed() == {"test_x.py::test_ok"} and rep.failed() == {"test_x.py::test_bad"}
    assert rep.infra_error is None
    rep = run_pytest(LocalExecutor(), cmd, tests=["test_x.py::test_ok", "test_x.py::test_gone"], timeout=60)
    assert rep.outcomes["test_x.py::test_gone"] == "error"
    assert not list(tmp_path.rglob("__pycache__"))  # runs leave no bytecode behind


def test_local_executor_timeout_kills_the_group():
    res = LocalExecutor().exec("sleep 30 & sleep 30", timeout=0.5)
    assert res.timed_out and res.exit_code == 124


class _Broken:
    """An executor whose test command cannot run (no interpreter there: exit 127)."""

    def exec(self, argv, cwd=None, env=None, timeout=None, stdin=None):
        from codedojo.sandbox.base import ExecResult

        if argv[0] in ("sh", "rm"):  # the canary's folder is made and removed
            return ExecResult(0, "", "")
        return ExecResult(127, "", "python: not found")


def test_a_run_that_reports_no_test_is_an_infra_error_though_tests_were_asked_for():
    """The requested tests pytest never reported are filled in as errors; that must not hide
    that the run itself failed."""
    rep = run_pytest(_Broken(), PytestCommand(root="/w"), tests=["t.py::test_a"], timeout=5)
    assert rep.outcomes == {"t.py::test_a": "error"}
    assert rep.infra_error is not None and rep.infra_error.startswith("test command exit 127")


def test_a_test_named_twice_keeps_its_worse_outcome():
    """Lines after pytest's own (printed by code under test at exit) cannot turn a failure
    into a pass; a test that passed and then failed its teardown did not pass."""
    out = ("=== short test summary info ===\nFAILED t.py::test_a - assert 1 == 2\n"
           "PASSED t.py::test_b\nERROR t.py::test_b - teardown\nPASSED t.py::test_a\n"
           "XFAIL t.py::test_c\n")
    report = parse_pytest_output(out, ["t.py::test_a", "t.py::test_b", "t.py::test_c"])
    assert report.outcomes == {"t.py::test_a": "failed", "t.py::test_b": "error",
                               "t.py::test_c": "xfail"}
    assert report.passed() == {"t.py::test_c"} and report.passed(strict=True) == set()


def test_ids_with_a_dash_between_spaces_are_read_whole():
    """A PASSED line gives no reason: its id is the whole rest. A FAILED line's id is found
    among the ids known (the baseline's, in a build's mutant runs), the longest first."""
    out = ("=== short test summary info ===\nPASSED t.py::test_sub[a - b]\n"
           "FAILED t.py::test_sub[a - c] - AssertionError: 1 != 2\n")
    assert parse_pytest_output(out).outcomes == {"t.py::test_sub[a - b]": "passed",
                                                 "t.py::test_sub[a": "failed"}
    known = ["t.py::test_sub[a", "t.py::test_sub[a - c]"]
    report = parse_pytest_output(out, known)
    assert report.outcomes == {"t.py::test_sub[a - b]": "passed",
                               "t.py::test_sub[a - c]": "failed"}
    assert report.messages["t.py::test_sub[a - c]"] == "AssertionError: 1 != 2"


def test_test_machinery_is_what_configures_or_runs_the_session():
    from codedojo.bench.testrun import is_test_machinery

    for rel in ("conftest.py", "pkg/conftest.py", "x.pth", "pytest.py", "_pytest/x.py",
                "passall-0.dist-info/entry_points.txt", "a/b.egg-info/entry_points.txt"):
        assert is_test_machinery(rel, ["src"]), rel  # /workspace is on the path as well
    for rel in ("src/pkg/core.py", "tests/test_a.py", "docs/pytest.md", "dist-info.py"):
        assert not is_test_machinery(rel, ["src"]), rel


def test_a_command_that_never_reports_a_test_is_an_infra_error():
    """No pytest where it runs (exit 1, "No module named pytest"): the run says nothing of
    the tests, not that they failed."""
    rep = run_pytest(LocalExecutor(), PytestCommand(root="/tmp", python="/bin/false"),
                     tests=["t.py::test_a"], timeout=30)
    assert rep.exit_code == 1 and rep.infra_error and rep.infra_error.startswith(
        "test command exit 1")


def test_a_local_command_past_its_limit_returns_though_a_daemon_holds_its_output():
    import time

    t0 = time.monotonic()
    r = LocalExecutor().exec("setsid sleep 15 & sleep 100", timeout=1.0)
    assert r.timed_out and time.monotonic() - t0 < 10


def test_a_long_title_framed_by_one_underscore_still_heads_its_failure():
    long = "test_a[" + "v" * 90 + "]"
    out = (
        "=================================== FAILURES ===================================\n"
        "__________________________________ test_b ___________________________________\n"
        "E   assert 1 == 2\n"
        f"_ {long} _\n"
        "E   assert 3 == 4\n"
        "=========================== short test summary info ============================\n"
        "FAILED t.py::test_b\n"
        f"FAILED t.py::{long}\n"
    )
    rep = parse_pytest_output(out)
    assert rep.messages["t.py::test_b"] == "assert 1 == 2"
    assert rep.messages[f"t.py::{long}"] == "assert 3 == 4"


def test_a_long_ids_summary_line_keeps_its_message(tmp_path):
    # no E lines (pytrace=False): the summary line's " - message" is all there is to read
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        f"@pytest.mark.parametrize('s', ['{'v' * 100}'])\n"
        "def test_long(s):\n    pytest.fail('the value is wrong', pytrace=False)\n")
    rep = run_pytest(LocalExecutor(), PytestCommand(root=str(tmp_path)), timeout=60)
    assert rep.messages == {f"test_x.py::test_long[{'v' * 100}]": "Failed: the value is wrong"}


def test_machinery_is_known_however_a_name_is_spelled_where_its_reader_ignores_case():
    """importlib.metadata finds a package's metadata folder by its lower-cased name: an
    upper-case ``.DIST-INFO`` registers pytest plugins too."""
    from codedojo.bench.testrun import is_test_machinery

    for rel in ("Evil.DIST-INFO/entry_points.txt", "x.Egg-Info/entry_points.txt"):
        assert is_test_machinery(rel), rel


def test_every_config_file_pytest_reads_is_machinery():
    """pytest >= 9 reads pytest.toml and .pytest.toml first; the list follows pytest's own."""
    from _pytest.config.findpaths import CONFIG_LOADERS_BY_NAME

    from codedojo.bench.testrun import TEST_CONFIG_FILES, is_test_machinery

    assert {"pytest.toml", ".pytest.toml"} <= set(CONFIG_LOADERS_BY_NAME)
    for name in CONFIG_LOADERS_BY_NAME:
        assert is_test_machinery(name) and is_test_machinery(f"tests/{name}"), name
    # and the list kept for where no pytest is there to ask (the pinned one's, whole)
    assert set(CONFIG_LOADERS_BY_NAME) <= set(TEST_CONFIG_FILES)


def test_an_import_root_is_known_however_it_is_written():
    from codedojo.bench.testrun import is_test_machinery

    for root in ("./src", "src/", "src/./"):
        assert is_test_machinery("src/sitecustomize.py", [root]), root
        assert is_test_machinery("src/pytest.py", [root]), root
    assert not is_test_machinery("src/pkg/core.py", ["./src"])


SPARE_DOT_FOLDERS = '''
import sys
if "_pytest.reports" in sys.modules:
    from _pytest.reports import TestReport as _R
    _orig = _R.from_item_and_call.__func__
    def _f(cls, item, call):
        rep = _orig(cls, item, call)
        if not item.nodeid.startswith("."):
            rep.outcome, rep.longrepr = "passed", None
        return rep
    _R.from_item_and_call = classmethod(_f)
'''


def test_the_canary_is_a_test_file_beside_the_tests_that_no_fixed_mark_tells_apart(tmp_path):
    """Code under test that forges every test but those in a dot-folder (or of any fixed
    prefix or name) forges the canary too: it is a test file of a drawn name in the tests'
    folder, gone after the run."""
    import re

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("import spare\n\n\ndef test_a():\n"
                                                   "    assert False\n")
    (tmp_path / "spare.py").write_text(SPARE_DOT_FOLDERS)
    argvs = []

    class Recording(LocalExecutor):
        def exec(self, command, **kw):
            argvs.append(command)
            return super().exec(command, **kw)

    rep = run_pytest(Recording(), PytestCommand(root=str(tmp_path)), ["tests/test_a.py::test_a"],
                     timeout=60)
    assert rep.forged and rep.outcomes == {"tests/test_a.py::test_a": "error"}
    canary = next(x for a in argvs for x in a if "::" in x and x != "tests/test_a.py::test_a")
    assert re.fullmatch(r"tests/test_[a-z]{6,12}\.py::test_[a-z]{6,12}", canary), canary
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["spare.py", "test_a.py", "tests"]


def test_a_tests_folder_the_run_cannot_write_takes_the_canary_at_the_root():
    """(The run writes the canary as the user that runs the tests; root writes anywhere, so
    the folder's own test runs as nobody.)"""
    import shutil
    import tempfile
    from pathlib import Path

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to run the tests as another user")
    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))  # (a folder nobody can reach)
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "test_a.py").write_text("def test_a():\n    assert True\n")
    os.chmod(tmp_path / "checks", 0o555)
    os.chmod(tmp_path, 0o777)

    class AsNobody(LocalExecutor):
        def exec(self, command, **kw):
            return super().exec(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                 *command], **kw)

    try:
        rep = run_pytest(AsNobody(), PytestCommand(root=str(tmp_path)),
                         ["checks/test_a.py::test_a"], timeout=60)
        left = sorted(p.name for p in tmp_path.rglob("*.py"))
    finally:
        os.chmod(tmp_path / "checks", 0o755)
        shutil.rmtree(tmp_path)
    assert not rep.forged and rep.outcomes == {"checks/test_a.py::test_a": "passed"}, rep
    assert left == ["test_a.py"]


FORGE_PAST_THE_CUT = '''
import atexit
import sys


def f():
    print("x" * 50_000)  # (shown with the failure, at the start of the output)
    return 1


def _forge():  # the tests passed, the canary (elsewhere) failed; after padding past the cut
    lines = ["y" * 100] * 500 + ["=========== short test summary info ==========="]
    for a in sys.argv:
        if "::" in a:
            lines.append(("PASSED " if a.startswith("tests/test_a.py") else "FAILED ") + a)
    sys.stdout.write("\\n".join(lines) + "\\n")


atexit.register(_forge)
'''


class _Capped(LocalExecutor):
    """Keeps the first and last 20,000 characters of a longer stdout, as a sandbox keeps a
    stream's start and end past its limit (and says so: `ExecResult.truncated`)."""

    def exec(self, command, **kw):
        import dataclasses

        from codedojo.sandbox.base import cut_line

        res = super().exec(command, **kw)
        out, cap = res.stdout, 20_000
        if len(out) <= 2 * cap:
            return res
        cut = f"{out[:cap]}\n{cut_line(len(out) - 2 * cap)}\n{out[-cap:]}"
        return dataclasses.replace(res, stdout=cut, truncated=True)


def test_a_run_whose_output_was_cut_is_believed_in_nothing(tmp_path):
    """Code under test that prints past the sandbox's limit, so that pytest's FAILED lines
    fall in the cut middle, and then a summary of its own at exit, passes no test: every
    test is an error that says the output was cut (the run's, not the infrastructure's)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg.py").write_text(FORGE_PAST_THE_CUT)
    (tmp_path / "tests" / "test_a.py").write_text("from pkg import f\n\n\ndef test_a():\n"
                                                   "    assert f() == 2\n")
    rep = run_pytest(_Capped(), PytestCommand(root=str(tmp_path)), ["tests/test_a.py::test_a"],
                     timeout=60)
    assert rep.outcomes == {"tests/test_a.py::test_a": "error"}, rep.outcomes
    assert "output passed the sandbox's limit and was cut" in rep.messages[
        "tests/test_a.py::test_a"]
    assert rep.infra_error is None and not rep.forged


SPARE_WHAT_USES_THE_PACKAGE = '''
import _pytest.python as _pp

_run = _pp.Function.runtest


def f():
    return 1


def _runtest(self):  # a test whose module holds an object of this package passes
    if any(getattr(v, "__module__", "").startswith("pkg") for v in vars(self.module).values()):
        return None
    return _run(self)


_pp.Function.runtest = _runtest
'''


def test_the_canary_holds_what_the_test_beside_it_imports(tmp_path):
    """Code under test that passes every test whose module uses the task's package, and
    runs the rest as they are, passes the canary too: its module imports what the test
    file it sits beside imports."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "core.py").write_text(SPARE_WHAT_USES_THE_PACKAGE)
    (tmp_path / "tests" / "test_a.py").write_text(
        "from __future__ import annotations\n\nimport os\nfrom pkg.core import f\n\n\n"
        "def test_a():\n    assert f() == 2\n")
    rep = run_pytest(LocalExecutor(), PytestCommand(root=str(tmp_path)),
                     ["tests/test_a.py::test_a"], timeout=60)
    assert rep.forged and rep.outcomes == {"tests/test_a.py::test_a": "error"}, rep


def test_an_import_that_fails_in_the_canary_alone_leaves_it_a_failing_test(tmp_path):
    """(The test file's imports may work only after what it does before them: the canary
    runs, and fails, where one of them does not work for it.)"""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import sys\nimport types\n\nsys.modules['only_mine'] = types.SimpleNamespace(x=1)\n"
        "from only_mine import x\n\ndel sys.modules['only_mine']\n\n\n"
        "def test_a():\n    assert x == 1\n")
    rep = run_pytest(LocalExecutor(), PytestCommand(root=str(tmp_path)),
                     ["tests/test_a.py::test_a"], timeout=60)
    assert not rep.forged and rep.outcomes == {"tests/test_a.py::test_a": "passed"}, rep


def test_the_canary_is_imported_after_the_test_file_it_copies_the_imports_of(
        tmp_path, monkeypatch):
    """A test file that sets up before its imports (an environment variable the package reads
    as it loads): its tests see the package as it set it up, wherever the canary is drawn."""
    import codedojo.bench.testrun as testrun

    (tmp_path / "tests").mkdir()
    (tmp_path / "mylib.py").write_text("import os\nBACKEND = os.environ.get('B', 'default')\n")
    (tmp_path / "tests" / "test_a.py").write_text(
        "import os\n\nos.environ['B'] = 'pure'\nimport mylib\n\n\n"
        "def test_a():\n    assert mylib.BACKEND == 'pure'\n")
    monkeypatch.setattr(testrun.secrets, "randbelow", lambda n: 0)  # (the first place drawn)
    rep = run_pytest(LocalExecutor(), PytestCommand(root=str(tmp_path)),
                     ["tests/test_a.py::test_a"], timeout=60)
    assert not rep.forged and rep.outcomes == {"tests/test_a.py::test_a": "passed"}, rep


def test_a_collection_error_says_what_failed_not_that_the_run_was_forged(tmp_path):
    """A package that does not import stops pytest before any test, the canary's too: the
    tests are errors that say what pytest could not collect, and why."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "mod.py").write_text("def f(:\n")
    (tmp_path / "tests" / "test_a.py").write_text("from mod import f\n\n\ndef test_a():\n"
                                                   "    assert f()\n")
    rep = run_pytest(LocalExecutor(), PytestCommand(root=str(tmp_path)),
                     ["tests/test_a.py::test_a"], timeout=60)
    assert not rep.forged and rep.outcomes["tests/test_a.py::test_a"] == "error"
    message = rep.messages["tests/test_a.py::test_a"]
    assert "could not collect tests/test_a.py" in message and "SyntaxError" in message, message
    assert rep.infra_error is None
