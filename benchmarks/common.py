"""What the benchmark scripts share (a module, not a benchmark: it measures nothing)."""

from __future__ import annotations

import sys
from typing import NoReturn

# The exit status of a benchmark that cannot run here (automake's "skipped"): `make bench` goes
# on past it.
SKIPPED = 77


def skip(reason: str) -> NoReturn:
    """Exit with `SKIPPED`, saying on stderr why the benchmark cannot run here."""
    print(reason, file=sys.stderr)
    sys.exit(SKIPPED)
