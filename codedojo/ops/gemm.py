"""``linear(x, w, bias)``: ``F.linear`` with a faster path for decode-sized inputs on the CPU.

Decoding multiplies 1-16 activation rows by each weight matrix. On the CPU, BLAS is tuned for
large row counts: at batch 1 it streams the weights at about half the read bandwidth, and at
2-16 rows (a speculative verification pass, a small decode batch) it reads them several times
over. ``small_gemm.cpp`` streams each weight matrix once per call whatever the row count (see
``benchmarks/decode.py`` for the figures); bfloat16 weights are read as they are, at half the
bytes, their products summed in float32 (see ``small_gemm.h``). The kernels (this one and
``decode_step.cpp``) are compiled once per machine with the system C++ compiler (``python -m
codedojo.ops`` builds them ahead of time; ``make setup`` does) into ``$CODEDOJO_CACHE/kernels``
(`build_dir`); where they cannot be built, or with ``CODEDOJO_KERNELS=0``, everything goes
through ``F.linear``. Training never uses them: inputs or weights that need
gradients take the ``F.linear`` path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from codedojo.paths import cache_dir

MAX_ROWS = 16  # above this BLAS is as fast (compute, not weight reads, dominates)
# the weight types the kernels take (bfloat16: half the bytes read per token)
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
SOURCES = [Path(__file__).with_name(f)
           for f in ("small_gemm.cpp", "decode_step.cpp", "greedy.cpp", "bindings.cpp")]
log = logging.getLogger(__name__)

_kernel: ModuleType | None = None
_error: str | None = None
_lock = threading.Lock()


def _enabled() -> bool:
    return os.environ.get("CODEDOJO_KERNELS", "1") not in ("0", "false", "no")


def load_kernel(verbose: bool = False) -> ModuleType | None:
    """Compile (first time on this machine) and import the kernels; None when unavailable."""
    global _kernel, _error
    if _kernel is not None or _error is not None:
        return _kernel
    with _lock:
        if _kernel is not None or _error is not None:
            return _kernel
        if not _enabled():
            _error = "disabled by CODEDOJO_KERNELS=0"
            return None
        from torch.utils.cpp_extension import load

        flags = ["-O3", "-march=native", "-fopenmp"]
        try:  # a cache that cannot be written (a service user's missing home) falls back too
            build = build_dir()
            try:
                build.mkdir(parents=True)
            except FileExistsError:  # built before, or being built now
                pass
            else:  # a new build: the old ones nobody loads go
                for old in prune_builds(build):
                    log.info("removed %s: not loaded for %d days", old, UNUSED_DAYS)
            with build_lock(build):
                sources = staged_sources(build)
                _kernel = load("codedojo_kernels", [str(s) for s in sources],
                               extra_cflags=flags, extra_ldflags=["-fopenmp"],
                               build_directory=str(build),
                               extra_include_paths=[str(sources[0].parent)], verbose=verbose)
        except Exception as e:  # no compiler, no ninja, an unsupported platform
            _error = build_error(e)
            log.warning("CPU kernels unavailable (%s); using F.linear", _error)
        return _kernel


def _source_files() -> list[Path]:
    """The sources, then the headers beside them."""
    return [*SOURCES, *sorted(SOURCES[0].parent.glob("*.h"))]


def build_dir() -> Path:
    """Where the kernels are built: a directory per torch installation, CPU kind and sources.
    ``-march=native`` makes a build serve only CPUs with the same instruction sets, so a
    cache shared between machines (a home directory over NFS) keeps one build per CPU kind.
    The sources count by their content: checkouts of the same sources share one build, and
    checkouts of different ones never rebuild each other's. torch rebuilds when the compiler's
    command changes, and that names the sources' paths and torch's headers and libraries: so
    the build reads copies of the sources kept in it (`staged_sources`), and two environments
    (a CI clone's own beside a working tree's) build apart."""
    digest = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode() + b"\0")
    for f in _source_files():
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return (cache_dir() / "kernels"
            / f"torch-{torch.__version__}-{cpu_kind()}-{digest.hexdigest()[:12]}")


# A build not loaded for this long is removed when another is made (a build is a few MB; each
# change of the sources, torch or environment leaves one behind).
UNUSED_DAYS = 30


def prune_builds(keep: Path, unused_days: float = UNUSED_DAYS) -> list[Path]:
    """Remove the builds beside ``keep`` that no process has loaded for ``unused_days`` (a
    load takes a build's lock, which marks its lock file: `build_lock`), skipping any another
    process holds; the ones removed."""
    removed = []
    cutoff = time.time() - unused_days * 86400
    for d in sorted(keep.parent.iterdir()):
        lock = d / "build.lock"
        if d == keep or not d.is_dir() or not lock.exists() or lock.stat().st_mtime > cutoff:
            continue
        with open(lock, "a") as held:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # building or loading now
                continue
            if os.fstat(held.fileno()).st_mtime > cutoff:  # (loaded since it was looked at)
                continue
            # out of the way in one step, so that a loader arriving meanwhile makes it anew
            gone = d.with_name(f".{d.name}.pruned-{os.getpid()}")
            os.rename(d, gone)
            shutil.rmtree(gone, ignore_errors=True)
        removed.append(d)
    return removed


def staged_sources(build: Path) -> list[Path]:
    """The sources' copies in ``build/src`` (headers too), made once; the caller holds the
    build lock. Each is written whole before it takes its name, so a copy stopped midway is
    never built from."""
    src = build / "src"
    src.mkdir(exist_ok=True)
    for f in _source_files():
        if not (src / f.name).exists():
            shutil.copyfile(f, src / f".{f.name}.part")
            os.replace(src / f".{f.name}.part", src / f.name)
    return [src / f.name for f in SOURCES]


@contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """Hold the build directory against other processes for one build.

    torch's own lock is a file that its holder deletes when done (``build/lock``): a build
    killed midway leaves it behind, and every later build then waits on it forever. This lock
    is the kernel's (``flock`` on ``build/build.lock``), so it goes with the process that holds
    it. Every build here takes it first, so a torch lock found while holding it was left by a
    build that no longer runs, and is removed.

    A build `prune_builds` removed while this waited for its lock is made again: the lock
    held must be the file the directory has now."""
    while True:
        try:
            build.mkdir(parents=True, exist_ok=True)
            held = open(build / "build.lock", "w")  # closing it releases the lock
        except FileNotFoundError:  # (pruned between the two)
            continue
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(held.fileno()), os.stat(build / "build.lock")):
                break
        except FileNotFoundError:  # (pruned meanwhile)
            pass
        except BaseException:
            held.close()
            raise
        held.close()
    with held:
        stale = build / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield


def cpu_kind() -> str:
    """A short digest of this CPU's architecture and instruction-set flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, Arm
                flags = line.split(":", 1)[1]
                break
    except OSError:  # not Linux
        flags = platform.processor()
    key = f"{platform.machine()} {' '.join(sorted(flags.split()))}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def build_error(e: Exception) -> str:
    """The exception's first line, and the compiler's first error when it was a build that
    failed (the first line alone only names the failing command)."""
    lines = f"{type(e).__name__}: {e}".splitlines()
    first = next((ln.strip() for ln in lines[1:] if "error:" in ln), None)
    return lines[0] if first is None else f"{type(e).__name__}: the C++ build failed: {first}"


def kernel_status() -> str:
    """'ready', or why the kernel is not in use."""
    if load_kernel() is not None:
        return "ready"
    return _error or "not loaded"


def _kernel_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and w.dtype == x.dtype
            and w.dim() == 2 and w.is_contiguous() and x.numel() <= MAX_ROWS * w.shape[1]
            and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (..., K) @ w (M, K)^T (+ bias): ``F.linear``'s contract, the result as ``out_dtype``
    (default: x's). The kernel sums in float32, so float32 logits from bfloat16 weights are
    not rounded to bfloat16 on the way."""
    if _kernel_applies(x, w) and (kernel := load_kernel()) is not None:
        y = kernel.small_gemm(x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous(), w)
        if bias is not None:
            y += bias
        return y.to(out_dtype or x.dtype).view(*x.shape[:-1], w.shape[0])
    y = F.linear(x, w, bias)
    return y if out_dtype is None else y.to(out_dtype)
