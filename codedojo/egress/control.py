"""Attaching sandboxes to a proxy that runs in another process (`dojo egress serve`).

The service listens on a unix socket (root-only, 0600) for one JSON object per line:

    {"op": "attach", "sandbox_id": ..., "netns_pid": ..., "mode": ..., "policy": {...},
     "secrets": {...}}          -> {"ok": true, "env": {...}, "files": {path: base64}}
    {"op": "detach", "sandbox_id": ...}  -> {"ok": true}

and `RemoteEgress(socket).attachment(policy)` is the `EgressAttachment` that speaks it, so a
sandbox service holds the same kind of object whether the proxy is in-process or not. The
policy travels as data and is validated by the service (the test-only override included, since
only root can reach the socket).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import socketserver
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from codedojo.egress.policy import EgressPolicy
from codedojo.egress.proxy import EgressProxy, Mode
from codedojo.egress.strip import SecretSet
from codedojo.sandbox.base import EgressBinding


class ControlServer:
    def __init__(self, proxy: EgressProxy, path: Path) -> None:
        self.proxy, self.path = proxy, path
        self._server: socketserver.UnixStreamServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ControlServer:
        proxy = self.proxy

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    try:
                        reply = _handle(proxy, json.loads(line))
                    except Exception as e:  # every failure is an answer, never a dead socket
                        reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    self.wfile.write(json.dumps(reply).encode() + b"\n")

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        finally:
            os.umask(old)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.path.unlink(missing_ok=True)


def _handle(proxy: EgressProxy, req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    if op == "attach":
        for key in ("sandbox_id", "netns_pid", "policy"):
            if key not in req:
                raise ValueError(f"attach: missing field {key!r}")
        binding = proxy.attach(
            str(req["sandbox_id"]),
            int(req["netns_pid"]),
            EgressPolicy.model_validate(req["policy"]),
            req.get("mode", "transparent"),
            SecretSet.from_mapping(req.get("secrets") or {}),
        )
        return {
            "ok": True,
            "env": dict(binding.env),
            "files": {p: base64.b64encode(d).decode() for p, d in binding.files.items()},
        }
    if op == "detach":
        proxy.detach(str(req["sandbox_id"]))
        return {"ok": True}
    raise ValueError(f"op: unknown operation {op!r} (attach, detach)")


class RemoteEgress:
    """Client of a `ControlServer`."""

    def __init__(self, path: str | Path, timeout: float = 30.0) -> None:
        self.path, self.timeout = str(path), timeout

    def call(self, req: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.path)
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        reply = json.loads(buf)
        if not reply.get("ok"):
            raise RuntimeError(f"egress service: {reply.get('error')}")
        return reply

    def attachment(
        self, policy: EgressPolicy, *, mode: Mode = "transparent",
        secrets: Mapping[str, str] | None = None,
    ) -> RemoteAttachment:  # fmt: skip
        SecretSet.from_mapping(secrets or {})  # refuse bad secrets here, not at sandbox start
        return RemoteAttachment(self, policy, mode, dict(secrets or {}))


class RemoteAttachment:
    def __init__(
        self, remote: RemoteEgress, policy: EgressPolicy, mode: Mode, secrets: dict[str, str]
    ) -> None:
        self.remote, self.policy, self.mode, self.secrets = remote, policy, mode, secrets

    def attach(self, sandbox_id: str, netns_pid: int) -> EgressBinding:
        reply = self.remote.call(
            {
                "op": "attach", "sandbox_id": sandbox_id, "netns_pid": netns_pid,
                "mode": self.mode, "policy": self.policy.model_dump(), "secrets": self.secrets,
            }
        )  # fmt: skip
        files = {p: base64.b64decode(d) for p, d in reply["files"].items()}
        return EgressBinding(env=reply["env"], files=files)

    def detach(self, sandbox_id: str) -> None:
        self.remote.call({"op": "detach", "sandbox_id": sandbox_id})
