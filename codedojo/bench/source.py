"""Pinned sdists from PyPI, downloaded once with pip and cached, unpacked as read-only trees.

Cache layout under `${CODEDOJO_CACHE:-~/.cache/codedojo}/bench/`:
  sdists/<name>-<version>/<archive>   what `pip download --no-binary :all: --no-deps` saved
  src/<name>-<version>-<sha12>/        the archive unpacked, its top folder stripped
Both are written to a temporary name and renamed, so a killed build never leaves half a tree.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from codedojo.paths import cache_dir, staged_dir

# What a test run or an agent must never see in its tree: VCS history and build debris (a
# `build` or `dist` folder that holds Python modules itself, a package such as
# `pkg/build/__init__.py` or a namespace package's `pkg/dist/wheel.py`, is the package's code;
# setuptools' `build/lib/...` and `dist/x.whl` hold none at their top).
RUN_CACHES = ("__pycache__", ".pytest_cache")  # what running the code leaves, by name
BYTECODE = (".pyc", ".pyo")
SCRUB_NAMES = (".git", ".hg", ".svn", *RUN_CACHES, ".tox", ".eggs")
BUILD_OUTPUTS = ("build", "dist")


def cache_root() -> Path:
    return cache_dir() / "bench"


@dataclass(frozen=True)
class Sdist:
    name: str
    version: str
    archive: Path
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _split_req(requirement: str) -> tuple[str, str]:
    name, sep, version = requirement.partition("==")
    if not sep or not name or not version:
        raise ValueError(f"requirement {requirement!r}: must be pinned as 'name==version'")
    return name, version


def fetch_sdist(requirement: str, expect_sha256: str | None = None) -> Sdist:
    """Download (or reuse) the sdist of a pinned requirement; checks its hash when given."""
    name, version = _split_req(requirement)
    folder = cache_root() / "sdists" / f"{name.lower()}-{version}"
    archives = sorted(p for p in folder.glob("*") if p.suffix in (".gz", ".zip", ".bz2", ".tgz"))
    if not archives:
        with staged_dir(folder, replace=False) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                   "--no-deps", "--disable-pip-version-check", "-d", str(tmp), requirement]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"pip download {requirement} failed:\n{proc.stderr[-2000:]}")
            if not any(tmp.iterdir()):
                raise RuntimeError(f"pip download {requirement} saved nothing")
        archives = sorted(folder.glob("*"))
    archive = archives[0]
    sha = _sha256(archive)
    if expect_sha256 and sha != expect_sha256:
        raise RuntimeError(f"sdist {archive.name}: sha256 {sha} differs from the pinned {expect_sha256}")
    return Sdist(name, version, archive, sha)


def unpack(sdist: Sdist) -> Path:
    """The sdist's tree (top folder stripped, VCS and build debris removed), cached read-only."""
    dest = cache_root() / "src" / f"{sdist.name.lower()}-{sdist.version}-{sdist.sha256[:12]}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        if sdist.archive.suffix == ".zip":
            with zipfile.ZipFile(sdist.archive) as z:
                z.extractall(tmp)
        else:
            with tarfile.open(sdist.archive) as t:
                t.extractall(tmp, filter="data")
        tops = list(tmp.iterdir())
        root = tops[0] if len(tops) == 1 and tops[0].is_dir() else tmp
        scrub(root)
        if root is tmp:
            os.rename(tmp, dest)
        else:
            os.rename(root, dest)
    except OSError:
        if not dest.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def scrub(root: Path) -> None:
    """Remove VCS history, caches and compiled files under root."""
    for dirpath, dirnames, filenames in os.walk(root):
        for d in list(dirnames):
            if d in SCRUB_NAMES or d.endswith(".egg-info") or (
                    d in BUILD_OUTPUTS and not _holds_modules(Path(dirpath) / d)):
                shutil.rmtree(Path(dirpath) / d, ignore_errors=True)
                dirnames.remove(d)
        for f in filenames:
            if f.endswith(BYTECODE) or f in (".gitignore", ".gitattributes", ".git"):
                (Path(dirpath) / f).unlink(missing_ok=True)


def _holds_modules(folder: Path) -> bool:
    try:
        return any(e.name.endswith((".py", ".pyi")) and e.is_file(follow_symlinks=False)
                   for e in os.scandir(folder))
    except OSError:
        return False


def is_test_path(rel: str) -> bool:
    """Whether a path (relative to the sdist root) is part of the package's tests."""
    parts = rel.split("/")
    name = parts[-1]
    if any(p in ("tests", "test", "testing") for p in parts[:-1]):
        return True
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py")


def find_test_paths(root: Path) -> list[str]:
    """The smallest set of paths (folders or files) that holds every test file under root."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        for d in sorted(dirnames):
            if d in ("tests", "test", "testing"):
                out.append(f"{rel_dir}/{d}".lstrip("/"))
        dirnames[:] = [d for d in dirnames if d not in ("tests", "test", "testing")]
        for f in sorted(filenames):
            rel = f"{rel_dir}/{f}".lstrip("/")
            if f.endswith(".py") and is_test_path(rel):
                out.append(rel)
    return sorted(out)
