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
