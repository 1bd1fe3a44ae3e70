"""The sandbox service: HTTP/JSON over FastAPI, managing many local sandboxes in one process.

Every route maps to one `Sandbox`/`ImageStore` method; `client.py` maps them back, so a
`SandboxClient` sandbox behaves like a local one. Errors are JSON `{"detail": ...}`: 400 for a
request the sandbox refuses (bad path, malformed command, missing layer, limit exceeded),
413 for a file longer than the read asked for (with its ``path``, ``size`` and ``max_bytes``),
404 for an unknown sandbox, shell or image (where the route names one), 422 for a malformed
body (FastAPI names the field), 503 when admission control refuses a new sandbox (the detail
names the resource under pressure).
A failure in one sandbox never takes the service down: every route catches its own errors.

Admission control reads live pressure with psutil before each create/fork: memory in use, the
store's disk, the 1-minute load per CPU, the number of live sandboxes and the file descriptors
this process has left; room for the sandboxes a create/fork asks for is held from its check
until it returns.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import hmac
import os
import resource
import secrets
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from codedojo.sandbox.base import (
    TOKEN_ENV,
    FileTooLarge,
    Limits,
    SandboxError,
    SandboxSpec,
    token_path,
)
from codedojo.sandbox.images import NoSuchImage
from codedojo.sandbox.local import LocalProvider, LocalSandbox, LocalShell


class ServiceConfig(BaseModel):
    """Settings of `dojo sandbox serve`."""

    root: str | None = Field(None, description="Store directory (default $CODEDOJO_SANDBOX_ROOT or /var/lib/codedojo/sandbox).")
    token: str | None = Field(None, description="Bearer token every request must carry (default "
                              "$CODEDOJO_SANDBOX_TOKEN, else the store's service.token, made "
                              "at the first start, readable by its owner only).")
    max_sandboxes: int = Field(512, description="Refuse creates beyond this many live sandboxes.")
    max_memory_percent: float = Field(90.0, description="Refuse creates while host memory use is above this.")
    max_disk_percent: float = Field(95.0, description="Refuse creates while the store's disk is fuller than this.")
    max_load_per_cpu: float = Field(16.0, description="Refuse creates while the 1-min load average per CPU is above this.")


class LimitsIn(BaseModel):
    memory_mb: int = 2048
    pids: int = 512
    cpus: float = 1.0
    disk_mb: int = 2048
    exec_timeout_s: float = 120.0
    max_output_bytes: int = 1 << 20


class CreateIn(BaseModel):
    image: str
    limits: LimitsIn = Field(default_factory=LimitsIn)
    env: dict[str, str] = Field(default_factory=dict)


class ExecIn(BaseModel):
    command: str | list[str]
    stdin: str | None = None
    stdin_b64: str | None = None
    timeout: float | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None


class ShellRunIn(BaseModel):
    command: str
    timeout: float | None = None


class ForkIn(BaseModel):
    n: int = Field(1, ge=1, le=4096)
    snapshot: str | None = None


class RestoreIn(BaseModel):
    snapshot: str


class DirectoryImageIn(BaseModel):
    path: str
    dest: str = "/workspace"
    parent: str | None = None
    name: str | None = None


class GitImageIn(BaseModel):
    repo: str
    rev: str | None = None
    dest: str = "/workspace"
    parent: str | None = None
    name: str | None = None


class PythonEnvImageIn(BaseModel):
    packages: list[str] = Field(default_factory=list)
    dest: str = "/opt/venv"
    parent: str | None = None
    name: str | None = None
    pip_args: list[str] = Field(default_factory=list)


class CommandImageIn(BaseModel):
    command: str | list[str]
    parent: str | None = None
    name: str | None = None
    timeout: float = 600.0


# File descriptors each live sandbox holds (its init's pidfd and root), and those kept free for
# what runs meanwhile: commands (five each: a connection, three pipes, a selector), the pool's
# refill and the server's sockets.
FDS_PER_SANDBOX = 2
FD_HEADROOM = 256


def admission_check(config: ServiceConfig, provider: LocalProvider, n: int = 1,
                    reserved: int = 0) -> str | None:
    """The reason ``n`` new sandboxes must wait, or None. ``reserved``: sandboxes admitted and
    still being made (one already started counts twice until its create returns, so a create
    may be refused early but none is let past the limit)."""
    live = len(provider.list())
    if live + reserved + n > config.max_sandboxes:
        being_made = f", {reserved} being made" if reserved else ""
        return (f"sandboxes: {live} live{being_made} and {n} asked for, the limit is "
                f"{config.max_sandboxes}")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:
        used = psutil.Process().num_fds()
        if used + FDS_PER_SANDBOX * (reserved + n) + FD_HEADROOM > soft:
            return (f"file descriptors: {used} open, {FDS_PER_SANDBOX} for each of {n} asked "
                    f"for and {FD_HEADROOM} kept for commands would pass this process's limit "
                    f"(RLIMIT_NOFILE {soft})")
    mem = psutil.virtual_memory().percent
    if mem > config.max_memory_percent:
        return f"memory: {mem:.1f}% in use > {config.max_memory_percent}%"
    disk = psutil.disk_usage(provider.root).percent
    if disk > config.max_disk_percent:
        return f"disk: {disk:.1f}% of the store's disk in use > {config.max_disk_percent}%"
    load = os.getloadavg()[0] / (psutil.cpu_count() or 1)
    if load > config.max_load_per_cpu:
        return f"cpu: load {load:.1f} per CPU > {config.max_load_per_cpu}"
    return None


def service_token(config: ServiceConfig, root: str) -> str:
    """The token callers must send: the config's, $CODEDOJO_SANDBOX_TOKEN, or the store's
    `service.token` (made now when there is none, mode 0600)."""
    token = config.token or os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = token_path(root)
    with contextlib.suppress(FileNotFoundError):
        return open(path).read().strip()
    os.makedirs(root, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _result(r: Any) -> dict:
    return dataclasses.asdict(r)


def create_app(config: ServiceConfig | None = None, provider: LocalProvider | None = None) -> FastAPI:
    config = config or ServiceConfig()
    provider = provider or LocalProvider(root=config.root)
    shells: dict[str, tuple[str, LocalShell]] = {}
    shells_lock = threading.Lock()
    admission_lock = threading.Lock()
    reserved = 0  # sandboxes admitted whose create/fork has not returned yet
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        provider.close()  # the service's sandboxes do not outlive it

    app = FastAPI(title="codedojo sandbox service", lifespan=lifespan)
    app.state.provider = provider
    app.state.config = config
    # The service runs as root and builds images on the host (pip installs, copies of any
    # directory): only a caller who can read the token (root, or who was given it) may ask.
    expected = f"Bearer {service_token(config, provider.root)}".encode()

    @app.middleware("http")
    async def _authorized(request: Request, call_next: Any) -> Any:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            why = (f"unauthorized: send the service's token (Authorization: Bearer ...; "
                   f"${TOKEN_ENV} or {token_path(provider.root)})")
            return JSONResponse({"detail": why}, status_code=401)
        return await call_next(request)

    @app.exception_handler(FileTooLarge)
    async def _too_large(request: Request, exc: FileTooLarge) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "path": exc.path, "size": exc.size,
                             "max_bytes": exc.max_bytes}, status_code=413)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        msg = str(exc)
        status = 404 if msg.startswith(("sandbox_id:", "shell_id:")) or "was destroyed" in msg else 400
        return JSONResponse({"detail": msg}, status_code=status)

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError) -> JSONResponse:
        return JSONResponse({"detail": f"host error: {exc}"}, status_code=500)

    def sb(sandbox_id: str) -> LocalSandbox:
        return provider.get(sandbox_id)

    @contextlib.contextmanager
    def admitted(n: int = 1) -> Iterator[None]:
        """Room for ``n`` new sandboxes, checked and held in one step until the block ends
        (so two creates cannot both take the last place)."""
        nonlocal reserved
        with admission_lock:
            reason = admission_check(config, provider, n, reserved)
            if reason:
                raise HTTPException(503, detail=f"admission refused, {reason}")
            reserved += n
        try:
            yield
        finally:
            with admission_lock:
                reserved -= n

    @app.get("/health")
    def health() -> dict:
        return {"ok": True, "sandboxes": len(provider.list()), "root": provider.root}

    # ---- images ----
    @app.get("/images")
    def images() -> dict:
        return {"images": provider.images.list(), "names": provider.images.names()}

    @contextlib.contextmanager
    def named_image() -> Iterator[None]:
        """For a route that names an image: an unknown one is a 404 (elsewhere, as a create's
        image or a build's parent, it is a 400, like any other bad field)."""
        try:
            yield
        except NoSuchImage as e:
            raise HTTPException(404, detail=str(e)) from None

    @app.get("/images/{ref}")
    def image(ref: str) -> dict:
        with named_image():
            return dataclasses.asdict(provider.images.resolve(ref))

    @app.delete("/images/{ref}")
    def remove_image(ref: str, force: bool = Query(False)) -> dict:
        """`ImageStore.remove`: its layers stay until `/gc` prunes them."""
        with named_image():
            return {"removed": provider.images.remove(ref, force=force)}

    @app.post("/images/directory")
    def image_directory(body: DirectoryImageIn) -> dict:
        return dataclasses.asdict(provider.images.from_directory(body.path, dest=body.dest, parent=body.parent, name=body.name))

    @app.post("/images/git")
    def image_git(body: GitImageIn) -> dict:
        return dataclasses.asdict(provider.images.from_git(body.repo, rev=body.rev, dest=body.dest, parent=body.parent, name=body.name))

    @app.post("/images/python-env")
    def image_python_env(body: PythonEnvImageIn) -> dict:
        return dataclasses.asdict(provider.images.from_python_env(
            body.packages, dest=body.dest, parent=body.parent, name=body.name, pip_args=body.pip_args))

    @app.post("/images/command")
    def image_command(body: CommandImageIn) -> dict:
        return dataclasses.asdict(provider.images.from_command(body.command, parent=body.parent, name=body.name, timeout=body.timeout))

    # ---- sandboxes ----
    @app.post("/sandboxes")
    def create(body: CreateIn) -> dict:
        spec = SandboxSpec(image=body.image, limits=Limits(**body.limits.model_dump()),
                           env=body.env)
        with admitted():
            s = provider.create(spec)
        return {"id": s.id, "image": s.image.id}

    @app.get("/sandboxes")
    def list_sandboxes() -> dict:
        return {"sandboxes": [{"id": s.id, "image": s.image.id, "lowers": list(s.lowers)} for s in provider.list()]}

    @app.get("/sandboxes/{sandbox_id}")
    def get(sandbox_id: str) -> dict:
        s = sb(sandbox_id)
        return {"id": s.id, "image": s.image.id, "limits": dataclasses.asdict(s.spec.limits)}

    @app.delete("/sandboxes/{sandbox_id}")
    def destroy(sandbox_id: str) -> dict:
        sb(sandbox_id).destroy()
        with shells_lock:
            for k in [k for k, (owner, _) in shells.items() if owner == sandbox_id]:
                shells.pop(k)
        return {"destroyed": sandbox_id}

    @app.post("/sandboxes/{sandbox_id}/exec")
    def exec_(sandbox_id: str, body: ExecIn) -> dict:
        stdin: bytes | str | None = body.stdin
        if body.stdin_b64 is not None:
            try:
                stdin = base64.b64decode(body.stdin_b64, validate=True)
            except binascii.Error as e:
                raise SandboxError(f"stdin_b64: not base64 ({e})") from None
        return _result(sb(sandbox_id).exec(body.command, stdin=stdin, timeout=body.timeout, env=body.env, cwd=body.cwd))

    @app.post("/sandboxes/{sandbox_id}/shells")
    def open_shell(sandbox_id: str) -> dict:
        shell_id = "sh-" + uuid.uuid4().hex[:12]
        with shells_lock:
            shells[shell_id] = (sandbox_id, sb(sandbox_id).shell())
        return {"shell_id": shell_id}

    def shell(sandbox_id: str, shell_id: str) -> LocalShell:
        with shells_lock:
            owner, sh = shells.get(shell_id, (None, None))
        if sh is None or owner != sandbox_id:
            raise SandboxError(f"shell_id: no shell {shell_id!r} in sandbox {sandbox_id!r}")
        return sh

    @app.post("/sandboxes/{sandbox_id}/shells/{shell_id}/run")
    def shell_run(sandbox_id: str, shell_id: str, body: ShellRunIn) -> dict:
        return _result(shell(sandbox_id, shell_id).run(body.command, timeout=body.timeout))

    @app.delete("/sandboxes/{sandbox_id}/shells/{shell_id}")
    def shell_close(sandbox_id: str, shell_id: str) -> dict:
        shell(sandbox_id, shell_id).close()
        with shells_lock:
            shells.pop(shell_id, None)
        return {"closed": shell_id}

    @app.get("/sandboxes/{sandbox_id}/file")
    def read_file(sandbox_id: str, path: str = Query(...),
                  max_bytes: int | None = Query(None, ge=0)) -> Response:
        return Response(sb(sandbox_id).read_file(path, max_bytes),
                        media_type="application/octet-stream")

    @app.get("/sandboxes/{sandbox_id}/original")
    def read_original(sandbox_id: str, path: str = Query(...)) -> Response:
        return Response(sb(sandbox_id).read_original(path), media_type="application/octet-stream")

    @app.put("/sandboxes/{sandbox_id}/file")
    def write_file(sandbox_id: str, path: str = Query(...), mode: int = Query(0o644),
                   data: bytes = Body(b"", media_type="application/octet-stream")) -> dict:
        sb(sandbox_id).write_file(path, data, mode=mode)
        return {"written": path, "bytes": len(data)}

    @app.delete("/sandboxes/{sandbox_id}/file")
    def remove(sandbox_id: str, path: str = Query(...)) -> dict:
        sb(sandbox_id).remove(path)
        return {"removed": path}

    @app.get("/sandboxes/{sandbox_id}/list")
    def list_dir(sandbox_id: str, path: str = Query("/workspace")) -> dict:
        return {"entries": [dataclasses.asdict(f) for f in sb(sandbox_id).list_dir(path)]}

    @app.get("/sandboxes/{sandbox_id}/stat")
    def stat(sandbox_id: str, path: str = Query(...)) -> dict:
        return dataclasses.asdict(sb(sandbox_id).stat(path))

    @app.get("/sandboxes/{sandbox_id}/changes")
    def changes(sandbox_id: str) -> dict:
        return {"changes": [dataclasses.asdict(c) for c in sb(sandbox_id).changes()]}

    @app.post("/sandboxes/{sandbox_id}/snapshot")
    def snapshot(sandbox_id: str) -> dict:
        return {"snapshot": sb(sandbox_id).snapshot()}

    @app.post("/sandboxes/{sandbox_id}/fork")
    def fork(sandbox_id: str, body: ForkIn) -> dict:
        with admitted(body.n):
            return {"ids": [s.id for s in sb(sandbox_id).fork(body.n, body.snapshot)]}

    @app.post("/sandboxes/{sandbox_id}/restore")
    def restore(sandbox_id: str, body: RestoreIn) -> dict:
        sb(sandbox_id).restore(body.snapshot)
        return {"restored": body.snapshot}

    @app.post("/gc")
    def gc() -> dict:
        return {"cleaned": provider.gc()}

    return app
