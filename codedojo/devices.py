"""Which device a command computes on: one reading of ``auto``, ``cpu``, ``cuda`` and ``cuda:N``,
checked against this machine, for serving and training alike."""

from __future__ import annotations

import torch


def resolve_device(requested: str, default_index: int = 0) -> torch.device:
    """``auto`` (a GPU when CUDA is available, else the CPU), ``cpu``, ``cuda`` (GPU
    ``default_index``) or ``cuda:N``. A malformed name, or a GPU this machine does not have, is a
    ValueError that quotes the request."""
    asked = requested
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    named = f"{asked!r}: not one of auto, cpu, cuda, cuda:N"
    try:
        dev = torch.device(requested)
    except RuntimeError:
        raise ValueError(named) from None
    if dev.type == "cpu" and dev.index in (None, 0):
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(named)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = default_index if dev.index is None else dev.index
    if index >= n:
        raise ValueError(f"{asked!r}: this machine has {n or 'no'} CUDA device"
                         f"{'' if n == 1 else 's'}{f', so no GPU {index}' if n else ''}")
    return torch.device("cuda", index)
