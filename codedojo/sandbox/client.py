"""A client of the sandbox service with the same interface as the local kind.

    client = SandboxClient("http://127.0.0.1:8181")
    sb = client.create(SandboxSpec(image="repo"))      # a RemoteSandbox: exec, files, fork, ...

Errors the service reports come back as `SandboxError` with the service's message (a 404 as
`NotFound`), so code written against `Sandbox` handles both kinds the same way. Egress
attachments are Python objects and cannot cross HTTP: a spec with `egress` is refused here
(attach egress on the service's side instead).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from codedojo.configfile import field_errors
from codedojo.sandbox.base import (
    MAX_SECONDS,
    TOKEN_ENV,
    WORKSPACE,
    Change,
    ExecResult,
    FileInfo,
    FileTooLarge,
    NotFound,
    SandboxError,
    SandboxSpec,
    token_path,
)

# What a call that runs a command may take past the command's own limit (the service's work
# around it) before the client gives up on the answer.
ANSWER_MARGIN_S = 30.0
# What a create or fork may take per sandbox it makes, past ANSWER_MARGIN_S (in which a fork
# also copies the writable layer): a client giving up sooner would leave them alive, unknown
# to it.
CREATE_WAIT_S = 10.0


def _part(value: str) -> str:
    """An id or name as one segment of a request's path (a "/" or a control character in it
    is sent escaped, for the service to refuse by name)."""
    return quote(str(value), safe="")


class _Http:
    def __init__(self, base_url: str, timeout: float, token: str | None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=headers)

    def call(self, method: str, url: str, *, raw: bool = False, wait: float | None = None,
             **kw: Any) -> Any:
        """``wait``: the time the service may take on the call (a command's time limit, the
        sandboxes a create makes): its answer is waited for that long and a margin, if longer
        than the client's timeout."""
        timeout = self.timeout
        if isinstance(wait, int | float) and 0 < wait <= MAX_SECONDS and (
                wait + ANSWER_MARGIN_S > self.timeout):  # (a limit past those the service takes
            timeout = kw["timeout"] = wait + ANSWER_MARGIN_S  # is the service's to refuse)
        try:
            r = self.http.request(method, url, **kw)
        except httpx.ReadTimeout:
            raise SandboxError(f"{method} {url}: no answer from the sandbox service within "
                               f"{timeout:g} s; the request may still complete on the service"
                               ) from None
        except httpx.HTTPError as e:
            raise SandboxError(f"sandbox service unreachable: {e}") from None
        except UnicodeEncodeError as e:  # (a lone surrogate in a str: no UTF-8 stands for it)
            raise SandboxError(f"{method} {url}: the request holds text that cannot be sent "
                               f"({e})") from None
        if r.status_code >= 400:
            try:
                body = r.json()
                detail = body.get("detail", r.text)
            except ValueError:
                body, detail = {}, r.text
            if r.status_code == 413 and {"path", "size", "max_bytes"} <= body.keys():
                raise FileTooLarge(body["path"], body["size"], body["max_bytes"])
            if isinstance(detail, list):  # FastAPI validation errors: name the fields
                detail = field_errors(detail)
            raise (NotFound if r.status_code == 404 else SandboxError)(
                f"{detail} (HTTP {r.status_code})")
        return r.content if raw else r.json()


class RemoteShell:
    def __init__(self, sandbox: RemoteSandbox, shell_id: str):
        self._sandbox, self._http, self.id = sandbox, sandbox._http, shell_id
        self.exited = False  # as `LocalShell.exited`, from the service's answer

    def run(self, command: str, timeout: float | None = None) -> ExecResult:
        body = self._http.call(
            "POST", self._sandbox._url(f"/shells/{_part(self.id)}/run"),
            json={"command": command, "timeout": timeout},
            wait=self._sandbox.exec_timeout_s if timeout is None else timeout)
        self.exited = bool(body.pop("exited", False))
        return ExecResult(**body)

    def close(self) -> None:
        self._http.call("DELETE", self._sandbox._url(f"/shells/{_part(self.id)}"))


class RemoteSandbox:
    """A sandbox living in the service; implements `codedojo.sandbox.base.Sandbox`.

    ``exec_timeout_s``: its `Limits.exec_timeout_s`, how long a command given no time limit
    may run (and its answer is waited for). ``source``: the image or snapshot its layers come
    from, as `LocalSandbox.source` (a fork's is the snapshot `fork` took, to remove once the
    forks are gone)."""

    def __init__(self, client: SandboxClient, sandbox_id: str, exec_timeout_s: float,
                 source: str | None = None):
        self._client = client
        self._http = client._http
        self.id = sandbox_id
        self.exec_timeout_s = exec_timeout_s
        self.source = source

    def _url(self, tail: str) -> str:
        return f"/sandboxes/{_part(self.id)}{tail}"

    def exec(self, command: str | Sequence[str], *, stdin: bytes | str | None = None,
             timeout: float | None = None, env: Mapping[str, str] | None = None,
             cwd: str | None = None) -> ExecResult:
        body: dict[str, Any] = {"command": command if isinstance(command, str) else list(command)
                                if isinstance(command, Sequence) else command,
                                "timeout": timeout, "env": dict(env) if env else None, "cwd": cwd}
        if isinstance(stdin, bytes | bytearray):
            body["stdin_b64"] = base64.b64encode(stdin).decode()
        else:
            body["stdin"] = stdin
        wait = self.exec_timeout_s if timeout is None else timeout
        return ExecResult(**self._http.call("POST", self._url("/exec"), json=body, wait=wait))

    def shell(self) -> RemoteShell:
        return RemoteShell(self, self._http.call("POST", self._url("/shells"))["shell_id"])

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": path}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        return self._http.call("GET", self._url("/file"), params=params, raw=True)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        content = data.encode() if isinstance(data, str) else bytes(data)
        self._http.call("PUT", self._url("/file"), params={"path": path, "mode": mode}, content=content,
                        headers={"content-type": "application/octet-stream"})

    def remove(self, path: str) -> None:
        self._http.call("DELETE", self._url("/file"), params={"path": path})

    def list_dir(self, path: str = WORKSPACE) -> list[FileInfo]:
        return [FileInfo(**e) for e in self._http.call("GET", self._url("/list"), params={"path": path})["entries"]]

    def stat(self, path: str) -> FileInfo:
        return FileInfo(**self._http.call("GET", self._url("/stat"), params={"path": path}))

    def changes(self) -> list[Change]:
        return [Change(**c) for c in self._http.call("GET", self._url("/changes"))["changes"]]

    def read_original(self, path: str, max_bytes: int | None = None) -> bytes:
        params: dict[str, Any] = {"path": path}
        if max_bytes is not None:
            params["max_bytes"] = max_bytes
        return self._http.call("GET", self._url("/original"), params=params, raw=True)

    def snapshot(self) -> str:
        return self._http.call("POST", self._url("/snapshot"))["snapshot"]

    def fork(self, n: int = 1, snapshot: str | None = None) -> list[RemoteSandbox]:
        # (a fork has its parent's limits)
        doc = self._http.call("POST", self._url("/fork"), json={"n": n, "snapshot": snapshot},
                              wait=CREATE_WAIT_S * n if isinstance(n, int) else None)
        return [RemoteSandbox(self._client, i, self.exec_timeout_s, doc.get("source"))
                for i in doc["ids"]]

    def restore(self, snapshot: str) -> None:
        self.source = self._http.call("POST", self._url("/restore"),
                                      json={"snapshot": snapshot}).get("source")

    def destroy(self) -> None:
        with contextlib.suppress(NotFound):  # (gone already)
            self._http.call("DELETE", self._url(""))


class RemoteImages:
    """Image builders run by the service (paths are on the service's machine)."""

    def __init__(self, http: _Http):
        self._http = http

    def from_directory(self, path: str, *, dest: str = WORKSPACE, parent: str | None = None,
                       name: str | None = None) -> str:
        return self._http.call("POST", "/images/directory",
                               json={"path": path, "dest": dest, "parent": parent, "name": name})["id"]

    def from_git(self, repo: str, *, rev: str | None = None, dest: str = WORKSPACE,
                 parent: str | None = None, name: str | None = None) -> str:
        return self._http.call("POST", "/images/git", json={"repo": repo, "rev": rev, "dest": dest,
                                                             "parent": parent, "name": name})["id"]

    def from_python_env(self, packages: Sequence[str] = (), *, dest: str = "/opt/venv",
                        parent: str | None = None, name: str | None = None,
                        pip_args: Sequence[str] = ()) -> str:
        return self._http.call("POST", "/images/python-env", json={
            "packages": list(packages), "dest": dest, "parent": parent, "name": name,
            "pip_args": list(pip_args)})["id"]

    def from_command(self, command: str | Sequence[str], *, parent: str | None = None,
                     name: str | None = None, timeout: float = 600.0) -> str:
        return self._http.call("POST", "/images/command", json={
            "command": command if isinstance(command, str) else list(command), "parent": parent,
            "name": name, "timeout": timeout}, wait=timeout)["id"]

    def resolve(self, ref: str) -> dict:
        return self._http.call("GET", f"/images/{_part(ref)}")

    def list(self) -> dict:
        return self._http.call("GET", "/images")

    def remove(self, ref: str, *, force: bool = False) -> str:
        """Delete an image and its names as `ImageStore.remove` does (a named one only with
        ``force``); returns its id."""
        return self._http.call("DELETE", f"/images/{_part(ref)}",
                               params={"force": force})["removed"]


def _local_token() -> str | None:
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    from codedojo.sandbox.local import store_root

    try:
        with open(token_path(store_root())) as f:
            return f.read().strip() or None
    except OSError:
        return None


class SandboxClient:
    """`SandboxProvider` over HTTP: `create`, `get`, `list`, `gc`, plus `images`."""

    def __init__(self, base_url: str = "http://127.0.0.1:8181", timeout: float = 600.0,
                 token: str | None = None):
        """``token``: the service's (default $CODEDOJO_SANDBOX_TOKEN, else the local store's
        `service.token` where this user may read it)."""
        self._http = _Http(base_url, timeout, token or _local_token())
        self.images = RemoteImages(self._http)

    def create(self, spec: SandboxSpec) -> RemoteSandbox:
        if spec.egress is not None:
            raise SandboxError("spec.egress: an egress attachment cannot be sent to the service")
        body = {"image": spec.image, "limits": dataclasses.asdict(spec.limits), "env": dict(spec.env)}
        doc = self._http.call("POST", "/sandboxes", json=body, wait=CREATE_WAIT_S)
        return RemoteSandbox(self, doc["id"], spec.limits.exec_timeout_s, doc.get("source"))

    def get(self, sandbox_id: str) -> RemoteSandbox:
        doc = self._http.call("GET", f"/sandboxes/{_part(sandbox_id)}")
        return RemoteSandbox(self, sandbox_id, doc["limits"]["exec_timeout_s"], doc.get("source"))

    def list(self) -> list[dict]:
        return self._http.call("GET", "/sandboxes")["sandboxes"]

    def gc(self) -> list[str]:
        return self._http.call("POST", "/gc")["cleaned"]

    def health(self) -> dict:
        return self._http.call("GET", "/health")

    def close(self) -> None:
        self._http.http.close()
