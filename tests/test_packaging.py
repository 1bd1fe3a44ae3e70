"""A wheel carries every file the package reads besides its Python modules (an editable
install, as `make setup` makes, would hide one that is missing)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

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
