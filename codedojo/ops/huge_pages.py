"""Tensors in memory backed by 2 MB pages, for weights read end to end on every decode step.

A batch-1 decode step reads every weight once. In 4 KB pages that is a TLB miss every 4 KB
(about 130,000 a step for SmolLM2-135M in float32), and each costs a page walk in the middle of
a stream the core would rather keep busy (more so in a virtual machine, where a walk goes
through two page tables). In 2 MB pages (Linux transparent huge pages, asked for with
``madvise``) a batch-1 decode step of SmolLM2-135M on a 2-core Zen 4 VM took 0.82-0.92x the
time (three runs, the two kinds of memory alternating step by step); a sum over 512 MB read
up to a fifth faster (``benchmarks/decode.py`` samples both kinds). Where the system has no
transparent huge pages the same calls give ordinary pages: values and behaviour never change,
only speed.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor starts on a page of its own (the kernels stream from there)


def huge_page_buffer(n_bytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping of at least ``n_bytes`` and the offset of its first 2 MB
    boundary, from where ``n_bytes`` are advised to be backed by huge pages. Tensors made over
    it with ``torch.frombuffer`` keep it alive."""
    if n_bytes < 0:
        raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")
    # private: a shared anonymous mapping is shmem, which takes huge pages only where
    # shmem_enabled allows (rarely)
    m = mmap.mmap(-1, n_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = _first_boundary(m)
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None and n_bytes:
        try:
            m.madvise(advise, start, n_bytes)
        except OSError:  # a kernel built without transparent huge pages: ordinary pages
            pass
    return m, start


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in huge-page memory (its own mapping)."""
    count = int(torch.Size(shape).numel())
    if count == 0:  # nothing to map (a mapping cannot be empty)
        return torch.empty(shape, dtype=dtype)
    m, start = huge_page_buffer(count * dtype.itemsize)
    return torch.frombuffer(m, dtype=dtype, count=count, offset=start).view(shape)


def move_to_huge_pages(module: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Move every CPU parameter of ``module`` into one huge-page mapping, in place; returns the
    bytes moved. ``dtype``: the floating-point parameters are converted on the way (one copy,
    not a conversion and then a move). Values, shapes, ``requires_grad`` and the Parameter
    objects stay (an optimizer holding them is unaffected); each parameter becomes contiguous,
    with a storage of its own (it saves as before). Views taken of a parameter before the move
    keep the old memory and no longer see in-place updates, so call this before anything holds
    such views (``load_model`` does, as it builds the model)."""
    if dtype is not None:  # (an empty one has no bytes to move, but takes the dtype all the same)
        for p in module.parameters():
            if p.device.type == "cpu" and not p.numel() and p.is_floating_point():
                p.data = p.data.to(dtype)
    params = [p for p in module.parameters() if p.device.type == "cpu" and p.numel()]
    if not params:
        return 0
    dtypes = [dtype if dtype is not None and p.is_floating_point() else p.dtype for p in params]
    sizes = [-(-p.numel() * dt.itemsize // _ALIGN) * _ALIGN
             for p, dt in zip(params, dtypes, strict=True)]
    m, offset = huge_page_buffer(sum(sizes))
    with torch.no_grad():
        for p, dt, size in zip(params, dtypes, sizes, strict=True):
            t = torch.frombuffer(m, dtype=dt, count=p.numel(), offset=offset)
            p.data = t.view(p.shape).copy_(p.data)
            if p.grad is not None and p.grad.dtype != dt:  # a gradient follows its parameter's type
                p.grad = p.grad.to(dt)
            offset += size
    return sum(sizes)


def _first_boundary(m: mmap.mmap) -> int:
    """Offset of the first 2 MB-aligned address in ``m``."""
    t = torch.frombuffer(m, dtype=torch.uint8, count=1)
    return -t.data_ptr() % HUGE_PAGE
