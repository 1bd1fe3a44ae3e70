"""The per-sandbox audit log: one JSON object per line, one file per sandbox.

Every request the proxy sees from a sandbox gets one line, whether it was forwarded, blocked by
policy or failed: time, method, host, port, path, the address actually connected to, status,
bytes each way, the headers stripped, the secrets redacted (by name and where), and the reason
when the request was blocked or the response withheld. Secret values never reach this file:
paths are logged after redaction.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class AuditRecord:
    sandbox: str
    mode: str  # "explicit" | "transparent"
    method: str
    host: str
    port: int
    path: str
    scheme: str = "http"
    ip: str | None = None  # the checked address the proxy connected to
    status: int | None = None
    bytes_out: int = 0  # request body bytes sent upstream
    bytes_in: int = 0  # response body bytes returned to the sandbox
    stripped_headers: list[str] = field(default_factory=list)
    redacted_secrets: dict[str, list[str]] = field(default_factory=dict)
    blocked: str | None = None  # why the proxy refused the request, None when forwarded
    # why the proxy withheld the upstream's response (the request was forwarded; `status` is
    # the proxy's answer to the sandbox)
    response_refused: str | None = None
    error: str | None = None  # transport failure (upstream unreachable, TLS, ...)
    override: bool = False  # reached through the test-only allow_addresses override
    time: float = field(default_factory=time.time)


class AuditLog:
    """Append-only JSONL file; safe to call from the proxy loop and from other threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._f = path.open("a", buffering=1)  # line buffered: a crash loses at most one line

    def write(self, record: AuditRecord) -> None:
        # vars() rather than asdict(): no deep copy on the request path.
        line = json.dumps(vars(record)) + "\n"
        with self._lock:
            if not self._f.closed:
                self._f.write(line)
                return
            # a flow that ends after its sandbox was detached (closed): appended all the same,
            # where the file still is
            with contextlib.suppress(FileNotFoundError), self.path.open("a") as f:
                f.write(line)

    def close(self) -> None:
        with self._lock:
            self._f.close()


def read_audit(path: str | Path) -> list[dict[str, Any]]:
    """All records of one audit file, oldest first."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
