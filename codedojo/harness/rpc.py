"""Tool RPC: the tool library as a JSON-RPC 2.0 service beside a sandbox, and its client.

One `ToolServer` serves the episodes of the sandboxes it can reach (its own sandbox, or any
sandbox its `SandboxProvider` knows). Heavy tools run here, outside the sandbox: the
`codebase_search` index lives in this process. Methods:

    episode.open   {env, sandbox_id?}        -> {episode_id, generation, versions, schemas,
                                                  time_limits}
    tool.call      {episode_id, name, arguments} -> ToolResult
    episode.state  {episode_id}              -> the episode's tool state (todos, paths edited)
    episode.close  {episode_id}              -> {}
    tools.register {module, attr}            -> {generation}   (live update)
    env.configure  {env, config}             -> {}
    tools.versions {name}                    -> [versions]

Transport is HTTP over TCP (127.0.0.1) or a unix socket. Errors in tool calls are results,
not RPC errors; RPC errors are for bad requests (unknown method, unknown episode).

An episode is leased, not owned: one that no call has used for the server's ``idle_s`` is
closed (its shell and background jobs with it), so that a client that died without closing
its episodes does not hold them until the sandbox goes. A later call to it is an RPC error
that says so.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import importlib
import importlib.util
import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import Response

from codedojo.harness.tools.base import ToolContext, ToolResult
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, ToolSession
from codedojo.harness.trajectory import json_text
from codedojo.paths import make_way_for_socket
from codedojo.sandbox.base import Sandbox, SandboxError, SandboxProvider, seconds

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
METHOD_NOT_FOUND = -32601
SERVER_ERROR = -32000

# How long an episode may go without a call before the server closes it (generous: a model's
# turn between two calls takes minutes at most).
IDLE_S = 1800.0
IDLED_KEPT = 10_000  # the idle-closed episodes a later call is told of as such

log = logging.getLogger(__name__)


class RPCError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Episode:
    """An open episode and its lease."""

    session: ToolSession
    used: float  # when a call last ended (time.monotonic)
    calls: int = 0  # running now: an episode in a call is not idle


def load_source(module: str) -> tuple[types.ModuleType, str]:
    """(a new module object run from ``module``'s source file as it reads now, the source's
    sha256). Not the import cache's module, nor its bytecode (whose check, the file's size and
    mtime in seconds, misses a quick edit): a tool registered before keeps the module, helpers
    and all, it was registered from, so an episode pinned to its version runs what it ran."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        raise ImportError(f"no source file for module {module!r}")
    with open(spec.origin, "rb") as f:
        source = f.read()
    loaded = importlib.util.module_from_spec(spec)
    exec(compile(source, spec.origin, "exec"), loaded.__dict__)
    return loaded, hashlib.sha256(source).hexdigest()


class ToolServer:
    """The service state: registry, environment configs, open episodes. ``idle_s``: how long
    an episode may go without a call before it is closed (None: as long as the server runs),
    by a thread that runs until `close`, which every server needs."""

    def __init__(
        self,
        *,
        sandbox: Sandbox | None = None,
        provider: SandboxProvider | None = None,
        registry: ToolRegistry | None = None,
        envs: dict[str, EnvToolConfig] | None = None,
        search: Any = None,
        idle_s: float | None = IDLE_S,
    ) -> None:
        if sandbox is None and provider is None:
            raise ValueError("ToolServer needs a sandbox or a sandbox provider")
        if idle_s is not None and not 0 < idle_s < float("inf"):
            raise ValueError(f"idle_s: must be a number of seconds > 0, or None, got {idle_s}")
        self.sandbox = sandbox
        self.provider = provider
        self.registry = registry or ToolRegistry()
        self.envs: dict[str, EnvToolConfig] = dict(envs or {"default": EnvToolConfig()})
        self.search = search
        self.episodes: dict[str, _Episode] = {}
        self.idle_s = idle_s
        self._idled: dict[str, None] = {}  # the latest episodes closed for going idle
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if idle_s is not None:
            threading.Thread(target=self._close_idle, daemon=True, name="tool-rpc-idle").start()

    # -- methods ---------------------------------------------------------------------------

    def open_episode(self, env: str = "default", sandbox_id: str | None = None) -> ToolSession:
        if env not in self.envs:
            raise RPCError(INVALID_PARAMS, f"env: unknown environment {env!r}; known: {sorted(self.envs)}")
        if sandbox_id is not None:
            if self.provider is None:
                if self.sandbox is None or self.sandbox.id != sandbox_id:
                    raise RPCError(INVALID_PARAMS, f"sandbox_id: unknown sandbox {sandbox_id!r}")
                sandbox = self.sandbox
            else:
                sandbox = self.provider.get(sandbox_id)
        elif self.sandbox is not None:
            sandbox = self.sandbox
        else:
            raise RPCError(INVALID_PARAMS, "sandbox_id: required (this server has no default sandbox)")
        try:
            toolset = self.registry.resolve(self.envs[env])
        except ValueError as e:
            raise RPCError(INVALID_PARAMS, str(e)) from e
        session = ToolSession(toolset, ToolContext(sandbox=sandbox, search=self.search))
        with self._lock:
            self.episodes[session.episode_id] = _Episode(session, time.monotonic())
        return session

    def session(self, episode_id: str) -> ToolSession:
        with self._lock:
            return self._episode(episode_id).session

    def _episode(self, episode_id: str) -> _Episode:
        e = self.episodes.get(episode_id)
        if e is None and episode_id in self._idled:
            raise RPCError(INVALID_PARAMS, f"episode_id: episode {episode_id!r} was closed "
                                           f"after {self.idle_s:g} s without a call (the "
                                           f"service's idle limit)")
        if e is None:
            raise RPCError(INVALID_PARAMS, f"episode_id: unknown episode {episode_id!r}")
        return e

    @contextmanager
    def _using(self, episode_id: str) -> Iterator[ToolSession]:
        """The episode's session, not idle while the caller uses it."""
        with self._lock:
            e = self._episode(episode_id)
            e.calls += 1
        try:
            yield e.session
        finally:
            with self._lock:
                e.calls -= 1
                e.used = time.monotonic()

    def close_episode(self, episode_id: str) -> None:
        with self._lock:
            e = self.episodes.pop(episode_id, None)
        if e is not None:
            e.session.close()

    def _close_idle(self) -> None:
        """Close, every while, the episodes idle for longer than ``idle_s``."""
        assert self.idle_s is not None
        while not self._closed.wait(min(60.0, self.idle_s / 4)):
            now = time.monotonic()
            with self._lock:
                idle = [eid for eid, e in self.episodes.items()
                        if not e.calls and now - e.used > self.idle_s]
                gone = [self.episodes.pop(eid).session for eid in idle]
                self._idled.update(dict.fromkeys(idle))
                while len(self._idled) > IDLED_KEPT:  # (the oldest become unknown ids)
                    del self._idled[next(iter(self._idled))]
            for s in gone:
                try:
                    s.close()
                except Exception as e:  # (the others are closed all the same)
                    log.warning("closing idle episode %s: %s: %s", s.episode_id,
                                type(e).__name__, e)

    def register_import(self, module: str, attr: str) -> int:
        """Register ``module.attr`` as its source file reads now (`load_source`), recording
        which source it came from: the same version from the same source again is the tool
        registered before, from other source it is refused."""
        try:
            loaded, digest = load_source(module)
            tool = getattr(loaded, attr)
        except Exception as e:  # (a module that is not there, or fails to run: SyntaxError...)
            raise RPCError(INVALID_PARAMS, f"module/attr: cannot import {module}:{attr}: "
                                           f"{type(e).__name__}: {e}") from e
        try:
            return self.registry.register(tool, origin=f"{module}@{digest}")
        except ValueError as e:
            raise RPCError(INVALID_PARAMS, str(e)) from e

    def dispatch(self, method: str, p: dict[str, Any]) -> Any:
        if method == "tool.call":
            name = _req(p, "name")
            left = p.get("time_left")
            try:
                left = None if left is None else seconds(left, "time_left")
            except SandboxError as e:
                raise RPCError(INVALID_PARAMS, str(e)) from None
            with self._using(_req(p, "episode_id")) as s:
                return s.call(name, p.get("arguments"), left).to_dict()
        if method == "episode.open":
            s = self.open_episode(_opt(p, "env") or "default", _opt(p, "sandbox_id"))
            cfg = s.toolset.config
            return {
                "episode_id": s.episode_id,
                "generation": s.toolset.generation,
                "versions": s.versions,
                "schemas": s.schemas,
                # each tool's time limit in this episode: how long a call may take to answer
                "time_limits": {n: cfg.timeouts.get(n, cfg.default_timeout_s) for n in s.toolset.tools},
            }
        if method == "episode.state":
            with self._using(_req(p, "episode_id")) as s:
                return s.state()
        if method == "episode.close":
            self.close_episode(_req(p, "episode_id"))
            return {}
        if method == "tools.register":
            return {"generation": self.register_import(_req(p, "module"), _req(p, "attr"))}
        if method == "env.configure":
            try:
                self.envs[_req(p, "env")] = EnvToolConfig.model_validate(p.get("config", {}))
            except ValueError as e:
                raise RPCError(INVALID_PARAMS, f"config: {e}") from e
            return {}
        if method == "tools.versions":
            return self.registry.versions(_req(p, "name"))
        raise RPCError(METHOD_NOT_FOUND, f"method: unknown method {method!r}")

    def close(self) -> None:
        self._closed.set()
        for eid in list(self.episodes):
            self.close_episode(eid)


def _req(p: dict[str, Any], key: str) -> str:
    """A required string parameter (every one is a name or an id)."""
    if key not in p:
        raise RPCError(INVALID_PARAMS, f"{key}: required")
    if not isinstance(p[key], str):
        raise RPCError(INVALID_PARAMS, f"{key}: must be a string, got {type(p[key]).__name__}")
    return p[key]


def _opt(p: dict[str, Any], key: str) -> str | None:
    """An optional string parameter (None when not given)."""
    return _req(p, key) if p.get(key) is not None else None


def _response(rid: Any, result: Any = None, error: RPCError | None = None,
              status: int = 200) -> Response:
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": rid}
    if error is not None:
        body["error"] = {"code": error.code, "message": str(error)}
    else:
        body["result"] = result
    return Response(json_text(body), status_code=status, media_type="application/json")


# Calls running at once, each on a thread of its own: a call mostly waits on its sandbox, so
# one per episode of a large rollout job (anyio's default pool, 40, held every later call of
# every episode behind the 40 longest).
MAX_CALLS = 4096


def create_app(server: ToolServer, max_calls: int = MAX_CALLS, token: str | None = None
               ) -> FastAPI:
    """The HTTP face of a `ToolServer`: POST /rpc (JSON-RPC 2.0), GET /health.

    The body is parsed by hand rather than through a pydantic model: a tool call is a few
    hundred bytes and this path is paid on every call. Calls run on threads, up to
    ``max_calls`` at once, so one episode's long command does not hold up the others. With
    ``token``, a request without ``Authorization: Bearer <token>`` is refused (401): a port on
    127.0.0.1 is open to every user of the machine, and a call runs commands in a sandbox.
    """
    app = FastAPI(title="codedojo tools")
    calls = anyio.CapacityLimiter(max_calls)
    expected = f"Bearer {token}".encode() if token else None

    @app.post("/rpc")
    async def rpc(request: Request) -> Response:
        rid = None
        if expected is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), expected):
            return _response(None, error=RPCError(INVALID_REQUEST, "unauthorized: send the "
                             "service's token (Authorization: Bearer ...)"), status=401)
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise RPCError(PARSE_ERROR, f"body: not JSON ({e})") from e
            if not isinstance(body, dict):
                raise RPCError(INVALID_PARAMS, "body: must be a JSON-RPC request object")
            rid = body.get("id")
            method = body.get("method")
            params = body.get("params") or {}
            if not isinstance(method, str):
                raise RPCError(INVALID_PARAMS, "method: must be a string")
            if not isinstance(params, dict):
                raise RPCError(INVALID_PARAMS, "params: must be an object")
            result = await anyio.to_thread.run_sync(server.dispatch, method, params,
                                                    limiter=calls)
            return _response(rid, result)
        except RPCError as e:
            return _response(rid, error=e)
        except Exception as e:  # the service must keep serving other episodes
            return _response(rid, error=RPCError(SERVER_ERROR, f"{type(e).__name__}: {e}"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "episodes": len(server.episodes), "generation": server.registry.generation}

    return app


# ---- running the service --------------------------------------------------------------------


@dataclass
class RunningServer:
    url: str
    uds: str | None
    token: str | None  # what a client must send (`client`)
    _server: Any
    _thread: threading.Thread

    def client(self, timeout: float = 300.0) -> ToolClient:
        return ToolClient(self.url, self.uds, timeout, token=self.token)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def serve_in_thread(server: ToolServer, host: str = "127.0.0.1", port: int = 0,
                    uds: str | None = None, token: str | None = "new") -> RunningServer:
    """Start the service on a background thread (port 0 = any free port); returns when it
    accepts. ``token``: what clients must send, a new random one by default (`RunningServer.
    token`); None: none (only where no other user can reach the address). A Unix socket is
    made owner-only."""
    import uvicorn

    if token == "new":
        token = secrets.token_urlsafe(32)
    app = create_app(server, token=token)
    if uds:
        # Bound here, as the TCP socket below is: an address it cannot take (a directory that
        # is not there, or not writable) is an OSError to the caller, and the socket is the
        # owner's alone before it listens.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            make_way_for_socket(uds, "tool service")  # (only a dead service's socket goes)
            sock.bind(uds)
            os.chmod(uds, 0o600)
        except OSError:
            sock.close()
            raise
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=300)
        url = "http://tools"
    else:
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when the
        # protocol is spelled out, and without it every response waits ~40 ms on delayed ACKs.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=300)
        url = f"http://{host}:{sock.getsockname()[1]}"
    userver = uvicorn.Server(config)
    thread = threading.Thread(
        target=userver.run, kwargs={"sockets": [sock]}, daemon=True, name="tool-rpc"
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not userver.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("tool RPC server did not start")
        time.sleep(0.005)
    return RunningServer(url=url, uds=uds, token=token, _server=userver, _thread=thread)


# ---- client ---------------------------------------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class _TCPHTTPConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        # Request and response are small single writes; never wait on Nagle's algorithm.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# What a tool call may take beyond its tool's time limit before the client gives up on it: the
# service's own work around the call (a sandbox's command is killed at the limit).
ANSWER_MARGIN_S = 30.0


class ToolClient:
    """JSON-RPC client of a `ToolServer` over one kept-alive connection.

    Built on `http.client` rather than a full HTTP client: this is the per-call cost the
    agent loop pays on every tool call. Thread-safe (one request at a time per client).
    """

    def __init__(self, url: str, uds: str | None = None, timeout: float = 300.0,
                 token: str | None = None) -> None:
        """``token``: the service's (`RunningServer.token`, or what `dojo`'s tool service
        printed), sent with every request."""
        parsed = urlparse(url)
        self.url = url
        self._uds = uds
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 80
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def _connect(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._uds:
                self._conn = _UnixHTTPConnection(self._uds, self._timeout)
            else:
                self._conn = _TCPHTTPConnection(self._host, self._port, timeout=self._timeout)
        return self._conn

    def _post(self, payload: bytes, wait: float | None = None) -> bytes:
        with self._lock:
            for attempt in (0, 1):
                conn = self._connect()
                # how long the answer may take: this call's own limit when longer than the
                # client's (a tool allowed ten minutes is not cut off at five)
                conn.timeout = self._timeout if wait is None else max(self._timeout, wait)
                if conn.sock is not None:
                    conn.sock.settimeout(conn.timeout)
                try:
                    conn.request("POST", "/rpc", body=payload, headers=self._headers)
                except OSError:
                    # Sending failed (e.g. the server closed an idle connection): nothing was
                    # processed, so one retry on a fresh connection is safe.
                    self._reset()
                    if attempt:
                        raise
                    continue
                try:
                    resp = conn.getresponse()
                    data = resp.read()
                except (http.client.RemoteDisconnected, ConnectionResetError) as e:
                    self._reset()
                    if attempt or not isinstance(e, http.client.RemoteDisconnected):
                        raise
                    continue  # the idle connection was closed before the request reached it
                except BaseException:
                    self._reset()
                    raise
                if resp.status != 200:
                    raise RPCError(SERVER_ERROR, f"HTTP {resp.status}: {data[:500].decode(errors='replace')}")
                return data
        raise AssertionError("unreachable")

    def _reset(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, method: str, *, wait: float | None = None, **params: Any) -> Any:
        """Call ``method``; ``wait``: how long its answer may take, when longer than the
        client's timeout."""
        payload = json_text(
            {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": params}).encode()
        body = json.loads(self._post(payload, wait))
        if "error" in body:
            raise RPCError(body["error"]["code"], body["error"]["message"])
        return body["result"]

    def open_episode(self, env: str = "default", sandbox_id: str | None = None) -> RemoteEpisode:
        params: dict[str, Any] = {"env": env}
        if sandbox_id is not None:
            params["sandbox_id"] = sandbox_id
        return RemoteEpisode(self, self.request("episode.open", **params))

    def register(self, module: str, attr: str) -> int:
        return int(self.request("tools.register", module=module, attr=attr)["generation"])

    def configure_env(self, env: str, config: EnvToolConfig) -> None:
        self.request("env.configure", env=env, config=config.model_dump())

    def close(self) -> None:
        with self._lock:
            self._reset()


class RemoteEpisode:
    """The client side of one episode: same shape as `ToolSession` (schemas, versions, call).
    The service holds its state (a shell, todos) until `close`: ``with client.open_episode()
    as episode:`` closes it however the episode ends."""

    def __init__(self, client: ToolClient, opened: dict[str, Any]) -> None:
        self.client = client
        self.episode_id: str = opened["episode_id"]
        self.generation: int = opened["generation"]
        self.versions: dict[str, str] = opened["versions"]
        self.schemas: list[dict[str, Any]] = opened["schemas"]
        self.time_limits: dict[str, float] = opened.get("time_limits", {})

    def call(self, name: str, arguments: Any, time_left: float | None = None) -> ToolResult:
        """Tool failures come back as error results; a failing service (unreachable, unknown
        episode) raises, and the agent loop ends the episode."""
        limit = self.time_limits.get(name)  # the tool's own, and the service's time to answer
        if time_left is not None:
            time_left = max(time_left, 0.001)
            limit = time_left if limit is None else min(limit, time_left)
        return ToolResult.from_dict(self.client.request(
            "tool.call", wait=None if limit is None else limit + ANSWER_MARGIN_S,
            episode_id=self.episode_id, name=name, arguments=arguments, time_left=time_left))

    def state(self) -> dict[str, Any]:
        return self.client.request("episode.state", episode_id=self.episode_id)

    def close(self) -> None:
        try:
            self.client.request("episode.close", episode_id=self.episode_id)
        except (RPCError, OSError):
            pass

    def __enter__(self) -> RemoteEpisode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
