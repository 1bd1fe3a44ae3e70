"""An engine decoding at a large model's pace (its steps slowed), for tests of time limits."""

from __future__ import annotations

import time

from codedojo.engine.engine import Engine


def slow_steps(engine: Engine, seconds: float) -> Engine:
    """``engine`` with each decode step taking ``seconds`` more."""
    decode = engine._decode_step

    def slow(live):
        time.sleep(seconds)
        decode(live)

    engine._decode_step = slow  # type: ignore[method-assign]
    return engine
