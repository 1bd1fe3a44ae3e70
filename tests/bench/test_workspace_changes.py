"""An episode's changes as grading takes them: collected from the agent's sandbox, applied to
a fresh copy of the same image, the copy holds what the agent's sandbox held."""

from __future__ import annotations

import os

import pytest

from codedojo.bench.workspace import apply_changes, collect_changes
from codedojo.sandbox.base import SandboxSpec


@pytest.fixture
def image(provider, tmp_path):
    """A small tree: a module, its tests, a data file, notes, and two scripts (one executable)."""
    files = {
        "pkg/__init__.py": "",
        "tests/test_core.py": "def test_core():\n    pass\n",
        "pkg/core.py": "VALUE = 1\n",
        "data": "a\n",
        "notes.txt": "notes\n",
        "tool.sh": "#!/bin/sh\necho old\n",
        "other.sh": "#!/bin/sh\necho other\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    os.chmod(tmp_path / "tool.sh", 0o755)
    return provider.images.from_directory(str(tmp_path)).id


@pytest.fixture
def pair(provider, image):
    """(the agent's sandbox, a fresh one of the same image: the grading copy)."""
    made = [provider.create(SandboxSpec(image=image)) for _ in range(2)]
    yield made
    for sb in made:
        sb.destroy()


def _graded(pair, script: str) -> dict:
    """What ``script`` changed in the agent's sandbox, applied to the fresh one (but for the
    tests, which grading keeps as they are)."""
    agent, fresh = pair
    r = agent.exec(f"cd /workspace && {script}")
    assert r.exit_code == 0, r.stderr
    changes = collect_changes(agent)
    apply_changes(fresh, changes, lambda rel: rel.startswith("tests/"))
    return changes


def test_a_file_that_became_a_directory_is_replaced_by_it(pair):
    changes = _graded(pair, "rm data && mkdir data && echo b > data/part.txt")
    assert changes["data"] is None  # the file's removal, recorded
    fresh = pair[1]
    assert fresh.stat("/workspace/data").kind == "dir"
    assert fresh.read_file("/workspace/data/part.txt") == b"b\n"


def test_a_link_inside_the_workspace_is_graded_as_the_file_it_leads_to(pair):
    """`mv core.py impl.py && ln -s impl.py core.py`: the grading copy's core.py is the fixed
    impl.py, not the image's. A link that leads outside /workspace, or nowhere, or to a
    directory is no file of the agent's: the image's file it replaced is deleted, and a
    directory it replaced keeps what grading protects in it."""
    changes = _graded(
        pair,
        "cd pkg && mv core.py impl.py && echo 'VALUE = 2' > impl.py && "
        "ln -s impl.py core.py && cd .. && ln -sf /etc/hostname notes.txt && "
        "ln -s pkg/missing.py dangling.py && ln -s pkg pkglink && "
        "mkdir /tmp/t && cp -r tests/* /tmp/t && rm -r tests && ln -s /tmp/t tests",
    )
    fresh = pair[1]
    assert fresh.read_file("/workspace/pkg/core.py") == b"VALUE = 2\n"
    assert fresh.stat("/workspace/pkg/core.py").kind == "file"
    assert changes["notes.txt"] is None
    assert fresh.exec("test -e /workspace/notes.txt").exit_code == 1
    assert {"dangling.py", "pkglink", "tests"}.isdisjoint(changes)  # (new: nothing to delete)
    assert fresh.read_file("/workspace/tests/test_core.py").startswith(b"def test_core")
    r = fresh.exec("cd /workspace && python3 -c 'import pkg.core; print(pkg.core.VALUE)'")
    assert r.stdout.strip() == "2", r.stderr


def test_a_changed_file_keeps_its_mode(pair):
    """An executable script edited stays executable, one made executable becomes so, and plain
    bytes written over an executable file keep its mode."""
    _graded(pair, "echo 'echo new' >> tool.sh && chmod +x other.sh")
    fresh = pair[1]
    assert fresh.stat("/workspace/tool.sh").mode & 0o777 == 0o755
    assert fresh.exec("/workspace/tool.sh").stdout.split() == ["old", "new"]
    assert fresh.exec("/workspace/other.sh").stdout.strip() == "other"
    apply_changes(fresh, {"tool.sh": b"#!/bin/sh\necho plain\n"}, lambda rel: False)
    assert fresh.exec("/workspace/tool.sh").stdout.strip() == "plain"
