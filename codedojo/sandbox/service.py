"""The sandbox service: HTTP/JSON over FastAPI, managing many local sandboxes in one process.

Every route maps to one `Sandbox`/`ImageStore` method; `client.py` maps them back, so a
`SandboxClient` sandbox behaves like a local one. Errors are JSON `{"detail": ...}`: 400 for a
request the sandbox refuses (bad path, malformed command, missing layer, limit exceeded),
413 for a file longer than the read asked for (with its ``path``, ``size`` and ``max_bytes``)
and for a request body past `ServiceConfig.max_body_mb` or a write past its sandbox's disk
(refused as it comes: a length past the cap is refused unread), 404 for an unknown or
destroyed sandbox, an unknown shell (`NotFound`) or image (where the route names one), 422 for
a malformed body (FastAPI names the field), 503 when admission control refuses a new sandbox
(the detail names the resource under pressure), 500 for a host error or a fault of the
service's own (the detail names its type).
A failure in one sandbox never takes the service down: every route catches its own errors,
and what none expected is answered too, on a connection that stays open.

Every route but a file write and /health is a plain function that runs on a worker thread:
a running command holds one, so the pool is sized from `ServiceConfig.max_sandboxes` at
startup (anyio's default of 40 would let 40 commands leave no thread for anything else).

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
import logging
import os
import resource
import secrets
import stat
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import anyio.to_thread
import psutil
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from codedojo.sandbox.base import (
    TOKEN_ENV,
    FileTooLarge,
    Limits,
    NotFound,
    SandboxError,
    SandboxSpec,
    token_path,
)
from codedojo.sandbox.images import NoSuchImage
from codedojo.sandbox.local import LocalProvider, LocalSandbox, LocalShell

log = logging.getLogger(__name__)


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
    max_body_mb: int = Field(256, description="Refuse a request whose body is longer than "
                             "this (a command's stdin, a file written), before reading it.")


class _BodyTooLong(Exception):
    pass


class _BodyCap:
    """Refuses (413) a request body past `ServiceConfig.max_body_mb`: unread where its length
    says so, and as its bytes come where it has none (chunked), so that what a route reads whole
    (a JSON body, a command's stdin) is never more than that in the service's memory."""

    def __init__(self, app: Any, config: ServiceConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen, started, past, cap = 0, False, False, self.config.max_body_mb << 20
        too_long = JSONResponse({"detail": f"request body: more than the service takes "
                                 f"({self.config.max_body_mb} MB, max_body_mb)"},
                                status_code=413)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > cap:  # (refused unread)
            return await too_long(scope, receive, send)

        async def counted() -> dict:
            nonlocal seen, past
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > cap:
                past = True
                raise _BodyTooLong
            return message

        async def sending(message: dict) -> None:
            nonlocal started
            if past and not started:  # (what the route answered to a body it lost: not sent)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception:
            if not past or started:
                raise
        if past and not started:  # (however the app took the error: FastAPI's body parser
            # makes it a 400 of its own)
            await too_long(scope, receive, send)


class LimitsIn(BaseModel):
    memory_mb: int = 2048
    pids: int = 512
    cpus: float = 1.0
    disk_mb: int = 2048
    exec_timeout_s: float = 120.0
    max_output_bytes: int = 1 << 20
    open_files: int | None = None


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


def worker_threads(config: ServiceConfig) -> int:
    """The worker threads the service's routes share: two per sandbox it admits (a command
    and a file call, say) and some for the calls that run no command, never fewer than
    anyio's default."""
    return max(40, 2 * config.max_sandboxes + 64)


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
    `service.token` (made now when there is none, mode 0600). A token file found is used only
    when it holds a token, belongs to this process's user and no one else may read or write
    it; otherwise SandboxError says what is wrong and how to fix it."""
    token = config.token or os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = token_path(root)
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        st, token = os.fstat(f.fileno()), f.read().strip()
        remake = f"remove {path} to have a new token made at the next start"
        if st.st_uid != os.geteuid():
            raise SandboxError(f"token file {path}: owned by uid {st.st_uid}, not by this "
                               f"service's user (uid {os.geteuid()}), who may have chosen or "
                               f"read the token: {remake}")
        if st.st_mode & 0o077:
            raise SandboxError(f"token file {path}: mode {stat.S_IMODE(st.st_mode):o} lets its "
                               f"group or others read or write it: chmod 600 {path}, or "
                               f"{remake} (should others have read it)")
        if not token:
            raise SandboxError(f"token file {path}: empty: {remake}")
        return token
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
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, worker_threads(config))
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
        try:
            return await call_next(request)
        except (_BodyTooLong, ClientDisconnect):  # (answered by `_BodyCap`; no one to answer)
            raise
        except Exception as e:  # a fault no route expected: answered here (Starlette's own
            # handler raises it again, and the server then drops the client's connection)
            log.exception("%s %s", request.method, request.url.path)
            return JSONResponse({"detail": f"internal error: {type(e).__name__}: {e}"},
                                status_code=500)

    app.add_middleware(_BodyCap, config=config)  # (outermost: a body with no length too)

    @app.exception_handler(FileTooLarge)
    async def _too_large(request: Request, exc: FileTooLarge) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "path": exc.path, "size": exc.size,
                             "max_bytes": exc.max_bytes}, status_code=413)

    @app.exception_handler(SandboxError)
    async def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)},
                            status_code=404 if isinstance(exc, NotFound) else 400)

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
    async def health() -> dict:  # (on the event loop: no worker thread, however busy they are)
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
        return {"id": s.id, "image": s.image.id, "source": s.source}

    @app.get("/sandboxes")
    def list_sandboxes() -> dict:
        return {"sandboxes": [{"id": s.id, "image": s.image.id, "source": s.source,
                               "lowers": list(s.lowers)} for s in provider.list()]}

    @app.get("/sandboxes/{sandbox_id}")
    def get(sandbox_id: str) -> dict:
        s = sb(sandbox_id)
        return {"id": s.id, "image": s.image.id, "source": s.source,
                "limits": dataclasses.asdict(s.spec.limits)}

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
            raise NotFound(f"shell_id: no shell {shell_id!r} in sandbox {sandbox_id!r}")
        return sh

    @app.post("/sandboxes/{sandbox_id}/shells/{shell_id}/run")
    def shell_run(sandbox_id: str, shell_id: str, body: ShellRunIn) -> dict:
        sh = shell(sandbox_id, shell_id)  # (and whether the command ended the shell)
        return {**_result(sh.run(body.command, timeout=body.timeout)), "exited": sh.exited}

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
    def read_original(sandbox_id: str, path: str = Query(...),
                      max_bytes: int | None = Query(None, ge=0)) -> Response:
        return Response(sb(sandbox_id).read_original(path, max_bytes),
                        media_type="application/octet-stream")

    @app.put("/sandboxes/{sandbox_id}/file",
             openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}}})
    async def write_file(request: Request, sandbox_id: str, path: str = Query(...),
                         mode: int = Query(0o644)) -> dict:
        """The body is the file's bytes, read only up to the sandbox's disk: a longer one is
        refused (413) as its length says so or as it passes it (the service's memory would
        hold it all)."""
        s = sb(sandbox_id)
        cap = min(s.spec.limits.disk_mb, config.max_body_mb) << 20
        too_long = HTTPException(413, detail=f"data: longer than the sandbox's disk limit "
                                             f"({s.spec.limits.disk_mb} MB) or the service's "
                                             f"({config.max_body_mb} MB, max_body_mb)")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise too_long
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise too_long
            chunks.append(chunk)
        data = b"".join(chunks)
        await anyio.to_thread.run_sync(lambda: s.write_file(path, data, mode=mode))
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
            forks = sb(sandbox_id).fork(body.n, body.snapshot)
        # the snapshot they start from (taken by the fork when none was given: its id is how
        # the caller removes it once they are gone)
        return {"ids": [s.id for s in forks], "source": forks[0].source}

    @app.post("/sandboxes/{sandbox_id}/restore")
    def restore(sandbox_id: str, body: RestoreIn) -> dict:
        s = sb(sandbox_id)
        s.restore(body.snapshot)
        return {"restored": body.snapshot, "source": s.source}

    @app.post("/gc")
    def gc() -> dict:
        return {"cleaned": provider.gc()}

    return app
