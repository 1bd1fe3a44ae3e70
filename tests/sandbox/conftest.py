"""Shared fixtures: one store per test session (built once: the helper, the base layer), a
small project image, and a check that every test leaves no sandbox behind."""

from __future__ import annotations

import os
import shutil

import pytest

from codedojo.sandbox.base import Limits, SandboxSpec
from codedojo.sandbox.local import LocalProvider

SMALL = Limits(memory_mb=256, pids=64, cpus=1.0, disk_mb=64, exec_timeout_s=30)


def fds_under(path: str) -> set[str]:
    """What this process's open fds name under ``path``: only those, since threads other tests
    left running open and close fds of their own while a test counts."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # (closed since the listing, or the listing's own)
            continue
        if target == path or target.startswith(path.rstrip("/") + "/"):
            found.add(f"{fd} {target}")
    return found


@pytest.fixture(scope="session")
def provider():
    # One store reused across test runs: the compiled helper and the base layer are cached in
    # it (content-addressed, safe to share); sandboxes themselves never outlive the session.
    root = os.environ.get("CODEDOJO_SANDBOX_TEST_ROOT", "/tmp/codedojo-sandbox-test")
    p = LocalProvider(root=root)
    p.gc()
    yield p
    p.close()
    p.gc()
    shutil.rmtree(os.path.join(root, "tmp"), ignore_errors=True)
    os.makedirs(os.path.join(root, "tmp"))


@pytest.fixture(scope="session")
def project(provider, tmp_path_factory) -> str:
    """An image with a tiny Python package in /workspace."""
    src = tmp_path_factory.mktemp("project")
    (src / "pkg").mkdir()
    (src / "pkg" / "__init__.py").write_text("VALUE = 41\n")
    (src / "README.md").write_text("hello\n")
    (src / "data.bin").write_bytes(os.urandom(4096))
    (src / "old.txt").write_text("to be deleted\n")
    return provider.images.from_directory(str(src), name="project").id


@pytest.fixture
def sandbox(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))
    yield sb
    sb.destroy()


@pytest.fixture(autouse=True)
def _no_leftover_sandboxes(no_leftover_sandboxes):
    """Every test here is checked for sandboxes it left alive (see tests/conftest.py)."""
