"""Where codedojo keeps what it builds or converts once per machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$CODEDOJO_CACHE``, else ``~/.cache/codedojo``."""
    return Path(os.environ.get("CODEDOJO_CACHE") or Path.home() / ".cache" / "codedojo")
