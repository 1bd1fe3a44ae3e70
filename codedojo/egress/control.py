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
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codedojo.configfile import field_errors
from codedojo.egress.policy import EgressPolicy
from codedojo.egress.proxy import EgressProxy, Mode
from codedojo.egress.strip import SecretSet
from codedojo.paths import make_way_for_socket
from codedojo.sandbox.base import EgressBinding


class ControlServer:
    def __init__(self, proxy: EgressProxy, path: Path) -> None:
        self.proxy, self.path = proxy, path
        self._server: socketserver.UnixStreamServer | None = None
        self._thread: threading.Thread | None = None
        self._inode: tuple[int, int] | None = None  # the socket file it made (device, inode)

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
        make_way_for_socket(self.path, "egress proxy")
        old = os.umask(0o177)
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        finally:
            os.umask(old)
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        # Its own socket only: one a later proxy made there (after this one's was removed)
        # is that proxy's.
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            self.path.unlink(missing_ok=True)


_M = TypeVar("_M", bound=BaseModel)


class AttachRequest(BaseModel):
    """An attach request as it comes over the socket: every field is checked, none converted
    (a pid of ``true`` or ``1.9`` is not pid 1, an id of ``null`` is not "None")."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["attach"]
    sandbox_id: str = Field(min_length=1, strict=True)
    netns_pid: int = Field(gt=0, strict=True)
    mode: Mode = "transparent"
    policy: EgressPolicy
    secrets: dict[str, str] | None = None


class DetachRequest(BaseModel):
    """A detach request, checked as `AttachRequest` is."""

    model_config = ConfigDict(extra="forbid")

    op: Literal["detach"]
    sandbox_id: str = Field(min_length=1, strict=True)


def _handle(proxy: EgressProxy, req: Any) -> dict[str, Any]:
    if not isinstance(req, dict):
        raise ValueError(f"request: a JSON object is expected, not {type(req).__name__}")
    op = req.get("op")
    if op == "attach":
        a = _parse(AttachRequest, req)
        binding = proxy.attach(
            a.sandbox_id, a.netns_pid, a.policy, a.mode, SecretSet.from_mapping(a.secrets or {})
        )
        return {
            "ok": True,
            "env": dict(binding.env),
            "files": {p: base64.b64encode(d).decode() for p, d in binding.files.items()},
        }
    if op == "detach":
        proxy.detach(_parse(DetachRequest, req).sandbox_id)
        return {"ok": True}
    raise ValueError(f"op: unknown operation {op!r} (attach, detach)")


def _parse(model: type[_M], req: dict[str, Any]) -> _M:
    """``req`` as ``model``; a ValueError naming each bad field (never quoting its value,
    which may be a secret)."""
    try:
        return model.model_validate(req)
    except ValidationError as e:
        raise ValueError(f"{req['op']}: {field_errors(e.errors())}") from None


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
