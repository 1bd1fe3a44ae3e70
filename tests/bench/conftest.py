"""Shared fixtures: a small package written for the tests, packed as an sdist in a private
bench cache, a suite built from it once per session, and a local sandbox provider."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest

CORE = '''\
"""Small numeric and text helpers."""


def clamp(value, low, high):
    """Limit value to the closed range [low, high]; low must not exceed high."""
    if low > high:
        raise ValueError("low must not exceed high")
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    """The arithmetic mean of a non-empty sequence of numbers."""
    if not values:
        raise ValueError("mean of an empty sequence")
    total = 0
    for v in values:
        total += v
    return total / len(values)


def chunks(items, size):
    """Split items into consecutive lists of at most `size` elements."""
    if size <= 0:
        raise ValueError("size must be positive")
    out = []
    for start in range(0, len(items), size):
        out.append(items[start:start + size])
    return out


def parse_pair(text):
    """Parse 'key=value' into a (key, value) tuple of stripped strings."""
    try:
        key, value = text.split("=", 1)
    except ValueError:
        raise ValueError(f"not a pair: {text!r}") from None
    return key.strip(), value.strip()
'''

TESTS = '''\
import pytest

from tinycalc.core import chunks, clamp, mean, parse_pair


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-3, 0, 10) == 0


def test_clamp_high():
    assert clamp(12, 0, 10) == 10


def test_clamp_edges():
    assert clamp(0, 0, 10) == 0
    assert clamp(10, 0, 10) == 10


def test_clamp_bad_range():
    with pytest.raises(ValueError):
        clamp(1, 5, 0)


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_single():
    assert mean([7]) == 7


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_chunks():
    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_chunks_exact():
    assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_chunks_bad_size():
    with pytest.raises(ValueError):
        chunks([1], 0)


def test_parse_pair():
    assert parse_pair(" a = b ") == ("a", "b")


def test_parse_pair_keeps_later_equals():
    assert parse_pair("a=b=c") == ("a", "b=c")


def test_parse_pair_bad():
    with pytest.raises(ValueError):
        parse_pair("novalue")
'''

FILES = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: tinycalc\nVersion: 0.1.0\n",
    "tinycalc/__init__.py": "from tinycalc.core import chunks, clamp, mean, parse_pair\n",
    "tinycalc/core.py": CORE,
    "tests/__init__.py": "",
    "tests/test_core.py": TESTS,
}


def make_sdist(folder: Path, name: str = "tinycalc", version: str = "0.1.0") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{rel}")
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="session")
def bench_cache():
    """A private CODEDOJO_CACHE holding the fixture sdist where `pip download` would put it."""
    old = os.environ.get("CODEDOJO_CACHE")
    root = Path(tempfile.mkdtemp(prefix="dojobench-test-"))
    os.environ["CODEDOJO_CACHE"] = str(root)
    make_sdist(root / "bench" / "sdists" / "tinycalc-0.1.0")
    yield root
    if old is None:
        os.environ.pop("CODEDOJO_CACHE", None)
    else:
        os.environ["CODEDOJO_CACHE"] = old
    if (root / "bench" / "sandbox").is_dir():  # (the store `dojo bench` made in this cache)
        from codedojo.sandbox.local import LocalProvider

        LocalProvider(root=str(root / "bench" / "sandbox"), pool_size=0).remove_store()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_suite(bench_cache, tmp_path_factory):
    from codedojo.bench.builder import BuildRecipe, build_suite

    recipe = BuildRecipe.model_validate({
        "name": "tiny", "version": "0.0.1", "seed": 3, "runs": 2, "max_f2p": 10, "max_p2p": 10,
        "created_at": "2026-01-02T03:04:05Z", "pytest": pytest.__version__,
        "packages": [{"requirement": "tinycalc==0.1.0", "bugfix": 1, "feature": 1, "log_investigation": 1,
                      "max_candidates": 40}],
    })
    return build_suite(recipe, tmp_path_factory.mktemp("tiny-suite"), log=lambda m: None)


@pytest.fixture(scope="session")
def provider():
    """Local sandboxes. The store outlives the session (under the user's cache unless
    CODEDOJO_SANDBOX_ROOT says otherwise) so the test environment's venv is built once."""
    from codedojo.sandbox.local import LocalProvider

    root = os.environ.get("CODEDOJO_SANDBOX_ROOT") or str(Path("~/.cache/codedojo/bench/sandbox").expanduser())
    p = LocalProvider(root=root)
    yield p
    p.close()


@pytest.fixture(scope="session")
def images(provider, tiny_suite):
    from codedojo.bench.workspace import TaskImages

    return TaskImages(provider)
