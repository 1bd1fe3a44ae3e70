"""Fixtures shared by every stage's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture()
def one_thread():
    """Tiny models are all per-op overhead: extra intra-op threads only add synchronisation,
    which gets very slow when the machine is busy. Restores the previous setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
