"""The small-row kernel agrees with F.linear, and training never goes through it."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import types

import pytest
import torch
import torch.nn.functional as F

from codedojo.ops import gemm, kernel_status, linear
from tests.ops.conftest import needs_kernel


def test_the_kernels_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where kernels are not turned off they must build: the kernel tests skip only then."""
    if gemm._enabled():
        assert kernel_status() == "ready"
    monkeypatch.setenv("CODEDOJO_KERNELS", "0")
    assert not gemm._enabled()


def _in_thread(fn, timeout: float) -> list:
    """Run ``fn`` in a thread; its result in a list (empty while it has not returned)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return out


def test_a_failed_build_names_the_compilers_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build directory is per CPU kind, and a build that fails says why, not only which
    command failed. A lock left by a build that was killed midway does not stop it."""
    assert gemm.cpu_kind() == gemm.cpu_kind() and len(gemm.cpu_kind()) == 12
    monkeypatch.setenv("CODEDOJO_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm, "_kernel", None)
    monkeypatch.setattr(gemm, "_error", None)
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(gemm, "SOURCES", [bad])
    build = gemm.build_dir()
    build.mkdir(parents=True)
    (build / "lock").touch()  # torch's own lock, as a killed build leaves it
    assert _in_thread(gemm.load_kernel, timeout=120) == [None], "waited on the stale lock"
    assert "undeclared_name" in gemm._error and "error:" in gemm._error, gemm._error
    assert not (build / "lock").exists()
    assert gemm.build_error(ImportError("ninja is required")) == "ImportError: ninja is required"


def test_a_cache_that_cannot_be_written_falls_back_to_f_linear(tmp_path, monkeypatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CODEDOJO_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(gemm, "_kernel", None)
    monkeypatch.setattr(gemm, "_error", None)
    assert gemm.load_kernel() is None and "NotADirectoryError" in gemm._error, gemm._error
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    torch.testing.assert_close(gemm.linear(x, w), torch.nn.functional.linear(x, w))


def test_checkouts_of_the_same_sources_share_a_build(tmp_path, monkeypatch) -> None:
    """The build directory follows the sources' content, not where they lie: a second copy of
    them builds nowhere new, a changed byte (a source or a header) builds elsewhere, and the
    build reads copies kept in its directory (torch rebuilds when the paths change)."""
    monkeypatch.setenv("CODEDOJO_CACHE", str(tmp_path / "cache"))
    here = gemm.build_dir()
    assert here.parent == tmp_path / "cache" / "kernels"
    assert here.name.startswith(f"torch-{torch.__version__}-{gemm.cpu_kind()}-")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for f in gemm._source_files():
            (tmp_path / name / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(gemm, "SOURCES", [tmp_path / "a" / f.name for f in gemm.SOURCES])
    assert gemm.build_dir() == here
    (here.parent / "x").mkdir(parents=True)  # a fresh build directory
    staged = gemm.staged_sources(here.parent / "x")
    assert [p.name for p in staged] == [f.name for f in gemm.SOURCES]
    assert all(p.read_bytes() == (tmp_path / "a" / p.name).read_bytes() for p in staged)
    assert {p.name for p in (here.parent / "x" / "src").iterdir()} == {
        f.name for f in gemm._source_files()}
    header = next(f for f in gemm._source_files() if f.suffix == ".h")
    header.write_text(header.read_text() + "// changed\n")
    assert gemm.build_dir() != here
    monkeypatch.setattr(gemm, "SOURCES", [tmp_path / "b" / f.name for f in gemm.SOURCES])
    assert gemm.build_dir() == here
    # another environment's torch (its headers' paths are in the compiler's command): apart
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv" / "torch" / "__init__.py"))
    assert gemm.build_dir() != here


def test_a_running_build_is_waited_for(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's build in progress holds the build lock: its torch lock is left alone
    and this load waits, then loads once that build is done."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv("CODEDOJO_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm, "_kernel", None)
    monkeypatch.setattr(gemm, "_error", None)
    built = types.ModuleType("codedojo_kernels")

    def load(name, sources, *, build_directory, **kw):  # torch's protocol around a build
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            baton.release()
        else:
            baton.wait()
        return built

    monkeypatch.setattr(cpp_extension, "load", load)
    build = gemm.build_dir()
    build.mkdir(parents=True)
    with open(build / "build.lock", "w") as other:  # the other build, under way
        fcntl.flock(other, fcntl.LOCK_EX)
        (build / "lock").touch()
        out = _in_thread(gemm.load_kernel, timeout=1.0)
        assert out == [] and (build / "lock").exists()
        (build / "lock").unlink()  # the other build ends
    out = _in_thread(gemm.load_kernel, timeout=30)
    assert out == [built] and gemm._kernel is built


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize(("k", "m"), [(64, 96), (37, 11), (576, 203)])
def test_kernel_matches_f_linear(rows: int, k: int, m: int) -> None:
    torch.manual_seed(rows * 1000 + k + m)
    x, w, b = torch.randn(rows, k), torch.randn(m, k), torch.randn(m)
    with torch.no_grad():
        assert gemm._kernel_applies(x, w)
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 6])
def test_bfloat16_products_are_summed_in_float32(rows: int) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 576).bfloat16(), torch.randn(203, 576).bfloat16()
    with torch.no_grad():
        assert gemm._kernel_applies(x, w)
        y = linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (x.float() @ w.float().T).bfloat16())
    # float32 activations against bfloat16 weights (the decode kernel's case): products of
    # the activations rounded to bfloat16 (AVX512-BF16) or as they are (widened weights)
    kernel = gemm.load_kernel()
    assert kernel is not None
    x32 = torch.randn(rows, 576)
    got = kernel.small_gemm(x32, w)
    exact, rounded = (a @ w.float().T for a in (x32, x32.bfloat16().float()))
    assert min(float((got - exact).abs().max()), float((got - rounded).abs().max())) < 1e-3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """Batch invariance: whatever the row count, a row's products are summed in the same order
    (K = 600: full 64-wide steps, one 16-wide step and a scalar tail)."""
    torch.manual_seed(0)
    x, w = torch.randn(16, 600).to(dtype), torch.randn(77, 600).to(dtype)
    with torch.no_grad():
        alone = torch.cat([linear(x[i:i + 1], w, out_dtype=torch.float32) for i in range(16)])
        for n in range(2, 17):
            assert torch.equal(linear(x[:n], w, out_dtype=torch.float32), alone[:n]), n


@needs_kernel
def test_leading_dims_and_strided_inputs() -> None:
    x, w = torch.randn(2, 3, 40)[:, :, 4:36], torch.randn(50, 32)  # a non-contiguous view
    with torch.no_grad():
        y = linear(x, w)
    assert y.shape == (2, 3, 50)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_training_and_large_inputs_take_f_linear() -> None:
    w = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(2, 16)
    assert not gemm._kernel_applies(x, w)  # w needs a gradient
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(8, 16))
    with torch.no_grad():
        assert gemm._kernel_applies(x, w)
        assert not gemm._kernel_applies(torch.randn(gemm.MAX_ROWS + 1, 16), w)
        assert not gemm._kernel_applies(x, w.bfloat16())  # mixed types: F.linear's error
        assert not gemm._kernel_applies(x, w.detach().t().contiguous().t())  # input-major


def test_builds_nobody_loads_are_removed_when_another_is_made(tmp_path) -> None:
    """A build whose lock nobody has taken for `UNUSED_DAYS` goes when a new one is made,
    unless a process holds it now; recently loaded builds stay."""
    import fcntl
    import os
    import time

    kernels = tmp_path / "kernels"
    old = time.time() - (gemm.UNUSED_DAYS + 1) * 86400
    for name in ("unused", "held", "recent", "new"):
        (kernels / name).mkdir(parents=True)
        (kernels / name / "codedojo_kernels.so").write_bytes(b"\0")
        (kernels / name / "build.lock").touch()
        if name != "recent":
            os.utime(kernels / name / "build.lock", (old, old))
    with open(kernels / "held" / "build.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process loading it
        assert gemm.prune_builds(kernels / "new") == [kernels / "unused"]
    assert sorted(p.name for p in kernels.iterdir()) == ["held", "new", "recent"]
    assert gemm.prune_builds(kernels / "new", unused_days=0.0) == [
        kernels / "held", kernels / "recent"]
    assert [p.name for p in kernels.iterdir()] == ["new"]


def test_a_build_pruned_while_its_lock_was_awaited_is_made_again(tmp_path) -> None:
    """A loader waiting for an old build's lock while another process prunes that build ends
    holding the lock of the directory as it is now (made again), not of the removed one."""
    build = tmp_path / "kernels" / "old"
    build.mkdir(parents=True)
    (build / "build.lock").touch()
    pruner = open(build / "build.lock", "a")
    fcntl.flock(pruner, fcntl.LOCK_EX)  # the pruning process has it
    got: list[bool] = []

    def load() -> None:
        with gemm.build_lock(build):
            got.append(build.is_dir() and (build / "build.lock").exists())

    t = threading.Thread(target=load)
    t.start()
    t.join(0.3)
    assert t.is_alive()  # waiting for the lock
    shutil.rmtree(build)  # pruned
    pruner.close()
    t.join(10)
    assert got == [True]
