"""What the rewards read of a finished episode (`codedojo.reward.changes`), from a real
sandbox: every change against the image, however it was made, and the image's lint rules."""

from __future__ import annotations

import dataclasses

import pytest

from codedojo.harness.trajectory import Trajectory
from codedojo.reward.auxiliary import lint_delta
from codedojo.reward.base import FileChange
from codedojo.reward.changes import MAX_BYTES, collect_changes, reward_context
from codedojo.sandbox.base import SandboxSpec
from tests.harness.conftest import LIMITS

PYPROJECT = '[tool.ruff]\nline-length = 40\n\n[tool.ruff.lint]\nselect = ["E501"]\n'


@pytest.fixture
def fresh(provider, repo_image):
    """New sandboxes of the repository's image, as grading takes them (it destroys them)."""
    from tests.harness.conftest import SANDBOX_ENV

    return lambda: provider.create(SandboxSpec(image=repo_image, limits=LIMITS, env=SANDBOX_ENV))


@pytest.fixture
def linted(provider, tmp_path):
    """A sandbox of a repository whose ruff rules are its own: long lines only, at 40."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "m.py").write_text("X = 1\n")
    (tmp_path / "data.bin").write_bytes(b"\x00" * 64)
    (tmp_path / "old.py").write_text("OLD = True\n")
    image = provider.images.from_directory(str(tmp_path), name="linted")
    sb = provider.create(SandboxSpec(image=image.id, limits=LIMITS))
    yield sb
    sb.destroy()


def test_every_change_is_against_the_image_however_it_was_made(linted):
    linted.exec("printf 'Y = 2\\n' >> m.py")  # the shell first; no file tool saw m.py before
    linted.write_file("m.py", linted.read_file("m.py").replace(b"X = 1", b"X = 3"))
    linted.write_file("data.bin", b"\x00" * 65)  # binary: no text change
    linted.write_file("big.py", b"#" * (MAX_BYTES + 1))  # too large: no text change
    linted.exec("mkdir -p pkg/sub && rm old.py")
    linted.write_file("new.py", "N = 0\n")
    assert sorted(collect_changes(linted), key=lambda c: c.path) == [
        FileChange("/workspace/m.py", "X = 1\n", "X = 3\nY = 2\n"),
        FileChange("/workspace/new.py", None, "N = 0\n"),
        FileChange("/workspace/old.py", "OLD = True\n", None),
    ]


def test_lint_delta_lints_by_the_repositorys_rules_as_the_image_had_them(linted):
    long = "VALUE = 'a line longer than forty characters'\n"
    linted.write_file("m.py", "import os\nimport re\nX = 1\n" + long)  # F401: not its rule
    ctx = reward_context(Trajectory(task="t"), linted)
    assert ctx.lint_configs == {"pyproject.toml": PYPROJECT}
    assert lint_delta(ctx) == 1.0  # the long line (ruff by default: the two unused imports)
    # an episode that turns the rule off still pays for what it added
    linted.write_file("pyproject.toml", "[tool.ruff.lint]\nselect = []\n")
    assert lint_delta(reward_context(Trajectory(task="t"), linted)) == 1.0


def test_the_outcome_is_graded_on_the_tests_and_machinery_as_the_image_had_them(sandbox):
    """A conftest hook that passes every test, an edited test file and an xfail in the code
    each made the unfixed task's fail-to-pass test pass in the episode's own sandbox."""
    from codedojo.reward.outcome import grade
    from tests.harness.conftest import F2P, P2P

    hook = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
            "def pytest_runtest_makereport(item, call):\n"
            "    rep = (yield).get_result()\n    rep.outcome, rep.longrepr = 'passed', None\n")
    test_file = F2P[0].split("::")[0]
    name = F2P[0].split("::")[-1]
    src = sandbox.read_file("inventory/stock.py").decode()
    cheats = {
        "hook": {"conftest.py": hook},
        "test file": {test_file: f"def {name}():\n    pass\n"},
        "xfail": {"inventory/stock.py": src + "\n\ndef low_stock(items, threshold):\n"
                                              "    import pytest\n    pytest.xfail('later')\n"},
    }
    for cheat, files in cheats.items():
        for rel, text in files.items():
            sandbox.write_file(rel, text)
        report = grade(sandbox, F2P, P2P)
        assert not any(report.fail_to_pass.values()) and all(report.pass_to_pass.values()), cheat
        sandbox.write_file("inventory/stock.py", src)
    # put back as the image had them: the test file, and no conftest.py (the image had none)
    assert sandbox.read_file(test_file) == sandbox.read_original(test_file)
    assert sandbox.exec("test -e conftest.py").exit_code == 1


def test_a_fresh_copy_grades_only_what_the_episode_changed_in_its_tree(fresh, sandbox):
    """Graded on a fresh sandbox of the image, an episode cannot reach the tests through a
    link put where the tests were (to a folder with a conftest hook), as it does in its own
    sandbox, where the files put back went through the link (there the canary, planted beside
    the tests, falls under the hook too, and no outcome is believed); its fix in the code
    counts."""
    from codedojo.reward.outcome import grade
    from tests.harness.conftest import F2P, P2P

    hook = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
            "def pytest_runtest_makereport(item, call):\n"
            "    rep = (yield).get_result()\n    rep.outcome, rep.longrepr = 'passed', None\n")
    sandbox.exec("mkdir -p /tmp/t && cp -r tests/* /tmp/t/ && rm -rf tests && ln -s /tmp/t tests")
    sandbox.write_file("/tmp/t/conftest.py", hook)
    in_place = grade(sandbox, F2P, P2P)  # in its own sandbox: forged, so nothing passes
    assert not any(in_place.fail_to_pass.values()) and not any(in_place.pass_to_pass.values())
    report = grade(sandbox, F2P, P2P, fresh=fresh)
    assert not any(report.fail_to_pass.values()) and all(report.pass_to_pass.values())
    src = sandbox.read_file("inventory/stock.py").replace(b"i.qty < threshold",
                                                          b"i.qty <= threshold")
    sandbox.write_file("inventory/stock.py", src)  # the fix itself
    report = grade(sandbox, F2P, P2P, fresh=fresh)
    assert all(report.fail_to_pass.values()) and all(report.pass_to_pass.values())


def test_changes_are_applied_deletions_first_and_a_file_may_replace_a_directory(sandbox):
    """What `rm -rf inventory && echo hi > inventory` leaves, applied to a fresh copy: the
    directory's files deleted, deepest first, and the file written where it was."""
    from codedojo.bench.workspace import apply_changes

    files = sandbox.exec("cd /workspace && find inventory -type f").stdout.split()
    changes = {**dict.fromkeys(files), "inventory": b"hi\n", "README.md": None}
    apply_changes(sandbox, changes, skip=lambda rel: rel == "README.md")
    assert sandbox.read_file("inventory") == b"hi\n"
    assert sandbox.exec("test -f README.md").exit_code == 0  # skipped


def test_the_tasks_folders_are_import_roots_before_the_images_own_path(sandbox):
    """A src layout: the tests import the package from the task's folder, while pytest comes
    from the image's own PYTHONPATH."""
    from codedojo.reward.outcome import default_command, grade
    from tests.harness.conftest import F2P, P2P

    sandbox.exec("mkdir src && mv inventory src/")
    report = grade(sandbox, F2P, P2P, command=default_command(("src",)))
    assert report.infra_error is None
    assert not any(report.fail_to_pass.values()) and all(report.pass_to_pass.values())


def test_a_change_that_hangs_the_tests_fails_them_and_a_broken_environment_is_no_grade(
        fresh, sandbox):
    """Graded on a fresh copy, a run that times out with the episode's change and not without
    it is the episode's failure; a run that cannot start either way is reported, and the
    outcome reward refuses it rather than give it 0."""
    from codedojo.reward import GradingError, RewardContext, compute_reward
    from codedojo.reward.outcome import default_command, grade
    from tests.harness.conftest import F2P, P2P

    src = sandbox.read_file("inventory/stock.py").decode()
    sandbox.write_file("inventory/stock.py", src.replace(
        "def total_value(items):\n", "def total_value(items):\n    while True:\n        pass\n"))
    report = grade(sandbox, F2P, P2P, fresh=fresh, timeout=8)
    assert report.infra_error is None
    assert report.pass_to_pass["tests/test_stock.py::test_total_value"] is False

    broken = dataclasses.replace(default_command(), python="/no/python3")
    report = grade(sandbox, F2P, P2P, fresh=fresh, command=broken)
    assert report.infra_error and "exit 127" in report.infra_error
    with pytest.raises(GradingError, match="says nothing of the episode"):
        compute_reward(RewardContext(Trajectory(task="t"), tests=report))


def test_a_pass_to_pass_test_broken_and_xfailed_fails_on_a_fresh_copy(fresh, sandbox):
    """The fix, and a function other tests pass on replaced by one that xfails them: on the
    task as it came those tests pass, so the episode broke them. The task as it came is run
    where nothing of the episode's ran (its code leaves a process that writes itself back)."""
    from codedojo.reward.outcome import grade
    from tests.harness.conftest import F2P, P2P

    src = sandbox.read_file("inventory/stock.py").decode()
    keeper = ("\nimport os, shutil, subprocess\nshutil.copy(__file__, '/tmp/keep.py')\n"
              "subprocess.Popen(['sh', '-c', 'while :; do cp /tmp/keep.py ' + __file__ + "
              "'; sleep 0.05; done'], start_new_session=True)\n")
    sandbox.write_file("inventory/stock.py", src.replace("i.qty < threshold", "i.qty <= threshold")
                       + "\n\ndef total_value(items):\n    import pytest\n    pytest.xfail('x')\n"
                       + keeper)
    report = grade(sandbox, F2P, P2P, fresh=fresh)
    assert all(report.fail_to_pass.values())
    assert report.pass_to_pass == {"tests/test_stock.py::test_total_value": False,
                                   "tests/test_stock.py::test_restock": True}


def test_a_change_that_hangs_the_test_process_at_exit_passes_nothing(fresh, sandbox):
    """Every test reported a pass, then the process hung at its exit: a run that timed out
    passes no test, whatever it reported."""
    from codedojo.reward.outcome import grade
    from tests.harness.conftest import F2P, P2P

    src = sandbox.read_file("inventory/stock.py").decode()
    sandbox.write_file("inventory/stock.py", src.replace("i.qty < threshold", "i.qty <= threshold")
                       + "\nimport atexit, time\natexit.register(time.sleep, 100)\n")
    report = grade(sandbox, F2P, P2P, fresh=fresh, timeout=8)
    assert report.infra_error is None
    assert not any(report.fail_to_pass.values()) and not any(report.pass_to_pass.values())


def test_rollouts_of_one_task_share_its_run_as_it_came(fresh, sandbox):
    """The xfail check needs the task as it came: with a `Baselines` the caller keeps, the
    rollouts of one task run it once between them, and an episode graded in its own sandbox
    is checked against it too."""
    from codedojo.bench.testrun import Baselines
    from codedojo.reward.outcome import grade, run_fresh
    from tests.harness.conftest import F2P, P2P

    made = []

    def counted():
        made.append(1)
        return fresh()

    baselines = Baselines()

    def as_it_came():
        return baselines.get("the-task", lambda: run_fresh(counted, F2P + P2P))

    src = sandbox.read_file("inventory/stock.py").decode()
    sandbox.write_file("inventory/stock.py", src.replace("i.qty < threshold", "i.qty <= threshold")
                       + "\n\ndef total_value(items):\n    import pytest\n    pytest.xfail('x')\n")

    broken = {"tests/test_stock.py::test_total_value": False,
              "tests/test_stock.py::test_restock": True}
    for _ in range(2):
        report = grade(sandbox, F2P, P2P, fresh=counted, as_it_came=as_it_came)
        assert all(report.fail_to_pass.values()) and report.pass_to_pass == broken
    assert len(made) == 3  # two episodes' runs, one run as it came
    assert grade(sandbox, F2P, P2P, as_it_came=as_it_came).pass_to_pass == broken
    assert len(made) == 3


def test_changes_past_what_the_host_reads_are_left_out_not_read(sandbox):
    """A sparse file costs the sandbox nothing and would cost the host its size: grading
    reads the changes up to a budget, the rewards' texts up to MAX_BYTES each, and a file
    grown past that is no text, not a deleted file."""
    from codedojo.bench.workspace import collect_changes as changed_files

    sandbox.exec("for f in a b c; do head -c 100 /dev/zero | tr '\\0' x > $f.txt; done; "
                 "truncate -s 1G sparse.bin")
    reads = []
    real = sandbox.read_file

    def read_file(path, max_bytes=None):
        reads.append(max_bytes)
        return real(path, max_bytes)

    sandbox.read_file = read_file
    try:
        got = changed_files(sandbox, max_bytes=250)
    finally:
        del sandbox.read_file
    assert len(got) == 2 and all(v == b"x" * 100 for v in got.values())
    assert all(m is not None and m <= 250 for m in reads)
    sandbox.write_file("inventory/stock.py", b"# " + b"x" * MAX_BYTES + b"\n")
    texts = {c.path: c for c in collect_changes(sandbox)}
    assert "/workspace/inventory/stock.py" not in texts  # (no text: not listed as deleted)
