"""Fixtures shared by every stage's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

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


@pytest.fixture()
def gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``gpus(n)``: torch sees n CUDA devices (none: no CUDA) for the rest of the test."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return see


@pytest.fixture()
def no_leftover_sandboxes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used a `provider` fixture: fail it if it left sandboxes alive (and
    destroy them, so one leak does not cascade into the next test)."""
    yield
    if "provider" in request.fixturenames:
        p = request.getfixturevalue("provider")
        leftover = [sb.id for sb in p.list()]
        for sb in p.list():
            sb.destroy()
        assert not leftover, f"test left sandboxes alive: {leftover}"
