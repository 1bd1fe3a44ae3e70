"""Real sandboxes for the harness tests: one local provider per session, a small Python
repository with a bug (and pytest on a layer of its own), and a check that nothing is left."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from codedojo.harness.tools.base import ToolContext
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, ToolSession
from codedojo.sandbox.base import Limits, SandboxSpec
from codedojo.sandbox.local import LocalProvider

LIMITS = Limits(memory_mb=512, pids=128, cpus=1.0, disk_mb=128, exec_timeout_s=60)
PYLIB = "/opt/pylib"
SANDBOX_ENV = {"PYTHONPATH": PYLIB, "PYTHONDONTWRITEBYTECODE": "1"}
# pygments is left out: pytest imports it only to colour output, and it is the bulk of the copy.
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py.py")

STOCK = '''\
"""A tiny inventory: items with a price and a quantity."""

from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    qty: int


def total_value(items):
    return sum(i.price * i.qty for i in items)


def low_stock(items, threshold):
    """Names of the items whose quantity is at or below `threshold`."""
    return [i.name for i in items if i.qty < threshold]


def restock(items, name, qty):
    for i in items:
        if i.name == name:
            i.qty += qty
            return i
    raise KeyError(name)
'''

TESTS = '''\
from inventory.stock import Item, low_stock, restock, total_value


def items():
    return [Item("bolt", 0.5, 10), Item("nut", 0.25, 3), Item("gear", 4.0, 5)]


def test_total_value():
    assert total_value(items()) == 0.5 * 10 + 0.25 * 3 + 4.0 * 5


def test_low_stock_includes_threshold():
    assert low_stock(items(), 5) == ["nut", "gear"]


def test_restock():
    its = items()
    assert restock(its, "nut", 7).qty == 10
'''

F2P = ["tests/test_stock.py::test_low_stock_includes_threshold"]
P2P = ["tests/test_stock.py::test_total_value", "tests/test_stock.py::test_restock"]


def write_repo(root: Path) -> None:
    (root / "inventory").mkdir(parents=True)
    (root / "inventory" / "__init__.py").write_text('"""Inventory helpers."""\n')
    (root / "inventory" / "stock.py").write_text(STOCK)
    (root / "tests").mkdir()
    (root / "tests" / "test_stock.py").write_text(TESTS)
    (root / "README.md").write_text("# inventory\n\nStock keeping helpers. Run the tests with pytest.\n")
    (root / "pyproject.toml").write_text('[project]\nname = "inventory"\nversion = "0.1"\n\n[tool.ruff]\nline-length = 100\n')
    (root / "data.bin").write_bytes(bytes(range(256)) * 4)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(root)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "initial"], check=True)


@pytest.fixture(scope="session")
def provider() -> Iterator[LocalProvider]:
    root = tempfile.mkdtemp(prefix="cdj-harness-")
    p = LocalProvider(root=root)
    yield p
    p.remove_store()


@pytest.fixture(scope="session")
def repo_image(provider: LocalProvider, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Pytest (copied from this interpreter, pure Python) on one layer, the repository on top."""
    lib = tmp_path_factory.mktemp("pylib")
    site = Path(__import__("pytest").__file__).resolve().parent.parent
    assert sys.version_info[:2] == (3, 11)  # the sandbox's /usr/bin/python3 runs these files
    for name in PYTEST_PACKAGES:
        if (site / name).is_dir():
            shutil.copytree(site / name, lib / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(site / name, lib / name)
    base = provider.images.from_directory(str(lib), dest=PYLIB)
    src = tmp_path_factory.mktemp("repo")
    write_repo(src)
    return provider.images.from_directory(str(src), parent=base.id, name="inventory").id


@pytest.fixture
def sandbox(provider: LocalProvider, repo_image: str):
    sb = provider.create(SandboxSpec(image=repo_image, limits=LIMITS, env=SANDBOX_ENV))
    yield sb
    sb.destroy()


@pytest.fixture
def session(sandbox) -> Iterator[ToolSession]:
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig()), ToolContext(sandbox=sandbox))
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _no_leftover_sandboxes(no_leftover_sandboxes):
    """Every test here is checked for sandboxes it left alive (see tests/conftest.py)."""
