"""Shared by the engine's tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture()
def failing_steps(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``fail(n)``: the engine's next n samplings raise RuntimeError("boom"), as any error in a
    step would (a model's, an out-of-memory)."""
    from codedojo.engine import engine as engine_mod

    real, left = engine_mod.sample_batch, [0]

    def flaky(*args, **kw):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("boom")
        return real(*args, **kw)

    monkeypatch.setattr(engine_mod, "sample_batch", flaky)

    def fail(n: int = 1) -> None:
        left[0] = n

    return fail
