"""The agent's sandbox holds no hidden tests, no gold patch and no git history."""

import json

# Host system folders bound read-only into every sandbox are not task data.
PRUNE = r"\( -path /proc -o -path /sys -o -path /dev -o -path /usr -o -path /lib -o -path /lib64 \) -prune -o"


def gold_block(patch: str) -> str:
    """The new side of the gold patch's first hunk (context + added lines): only the fixed
    file holds this sequence."""
    hunk = patch.split("\n@@", 1)[1].split("\n", 1)[1].split("\n@@", 1)[0]
    return "\n".join(ln[1:] for ln in hunk.splitlines() if ln[:1] in (" ", "+"))

# Runs inside the sandbox: every readable file outside the system folders, searched for needles.
SEARCH = r"""
import json, os, sys
needles = json.loads(sys.argv[1])
hits = []
for top in os.listdir("/"):
    if top in ("proc", "sys", "dev", "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        continue
    for dirpath, dirs, files in os.walk("/" + top):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                if os.path.islink(p) or os.path.getsize(p) > 4_000_000:
                    continue
                data = open(p, "rb").read()
            except OSError:
                continue
            hits += [f"{n!r} in {p}" for n in needles if n.encode() in data]
print("\n".join(hits))
"""


def test_agent_sandbox_has_no_hidden_tests_gold_patch_or_history(images, tiny_suite):
    for task in tiny_suite.tasks:
        sb = images.agent_sandbox(task)
        try:
            found = sb.exec(f"find / {PRUNE} \\( -name test_core.py -o -name tests -o -name .git "
                            f"-o -name '*.orig' -o -name '*.rej' -o -name '*.patch' -o -name '*.diff' \\) -print")
            # The sandbox user cannot read some system folders (/root): neither can the agent.
            denied = [ln for ln in found.stderr.splitlines() if ln and "Permission denied" not in ln]
            assert not denied, found.stderr
            assert found.stdout.strip() == "", found.stdout
            # Content: a hidden test's name, the gold patch's added block, a diff header.
            needles = ["test_parse_pair_keeps_later_equals", gold_block(task.patch), "+++ b/tinycalc/core.py"]
            res = sb.exec(["/opt/venv/bin/python", "-c", SEARCH, json.dumps(needles)], timeout=120)
            assert res.exit_code == 0, res.stderr
            assert res.stdout.strip() == "", f"{task.instance_id}: {res.stdout}"
            assert "PKG-INFO" in sb.exec("ls /workspace").stdout  # the search did look at the tree
        finally:
            sb.destroy()


def test_the_search_would_find_a_leak(images, tiny_suite):
    """The same search, with a planted copy of the gold patch, reports it (the test can fail)."""
    task = tiny_suite.tasks[0]
    sb = images.agent_sandbox(task)
    try:
        from codedojo.bench.validate import gold_changes

        sb.write_file("/tmp/notes.txt", gold_changes(task)["tinycalc/core.py"])
        res = sb.exec(["/opt/venv/bin/python", "-c", SEARCH, json.dumps([gold_block(task.patch)])], timeout=120)
        assert "/tmp/notes.txt" in res.stdout
    finally:
        sb.destroy()


def test_every_file_the_tests_are_in_is_hidden_whatever_its_name():
    """Hidden paths come from test files found by name; a package whose tests live in
    `tests.py` (collected through its own pytest config) would otherwise ship the grading tests
    to the agent."""
    from types import SimpleNamespace

    from codedojo.bench.workspace import _hidden, hidden_from_agent

    task = SimpleNamespace(hidden_paths=["tests"], FAIL_TO_PASS=["pkg/tests.py::test_fix"],
                           PASS_TO_PASS=["tests/test_a.py::test_keep", "checks.py::TestX::test_y"])
    hidden = hidden_from_agent(task)
    assert hidden == ["tests", "checks.py", "pkg/tests.py"]
    assert _hidden("pkg/tests.py", hidden) and not _hidden("pkg/core.py", hidden)
