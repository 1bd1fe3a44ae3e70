"""Run the tool service as its own process beside one sandbox.

    python -m codedojo.harness.service --image IMAGE [--root STORE] [--port 0 | --uds PATH]
    dojo tools serve --image IMAGE ...

It creates the sandbox from IMAGE (or from a directory, `--dir`), serves the tools over
JSON-RPC, prints one JSON line `{"url", "uds", "token", "sandbox_id", "pid"}` on stdout once it
accepts calls, and destroys the sandbox when it gets SIGTERM or SIGINT.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from codedojo.harness.rpc import IDLE_S, ToolServer, serve_in_thread
from codedojo.harness.toolset import EnvToolConfig

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Stopped(BaseException):
    """SIGTERM or SIGINT: the service ends, and its sandbox with it. Not an Exception, so that
    no `except Exception` on the way (the sandbox's creation, the index's) takes it for a
    failure of its own."""


def _stop(*_: object) -> None:
    for sig in _SIGNALS:  # (a second signal does not cut the clean-up short)
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped


def serve(
    *,
    image: str | None = None,
    directory: str | None = None,
    root: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    uds: str | None = None,
    env_configs: dict[str, Path] | None = None,
    codebase_search: bool = True,
    idle_s: float | None = IDLE_S,
) -> None:
    if (image is None) == (directory is None):
        raise ValueError("image/dir: give exactly one of --image and --dir")
    envs = {"default": EnvToolConfig()}
    for name, path in (env_configs or {}).items():
        try:
            envs[name] = EnvToolConfig.from_toml(path)
        except ValueError as e:  # (the file, or a field of it)
            raise ValueError(f"--env {name}: {e}") from None
    # A signal from here on ends the service through the finally blocks below, so that a
    # sandbox made before it (the start takes a while: the sandbox, the index) is destroyed.
    previous = {sig: signal.signal(sig, _stop) for sig in _SIGNALS}
    try:
        _serve(image, directory, root, host, port, uds, envs, codebase_search, idle_s)
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(image: str | None, directory: str | None, root: str | None, host: str, port: int,
           uds: str | None, envs: dict[str, EnvToolConfig], codebase_search: bool,
           idle_s: float | None) -> None:
    from codedojo.sandbox.base import SandboxSpec
    from codedojo.sandbox.local import LocalProvider

    provider = LocalProvider(root=root, pool_size=0)  # (one sandbox: none kept ready)
    if directory is not None:
        image = provider.images.from_directory(directory).id
    assert image is not None
    sandbox = provider.create(SandboxSpec(image=image))
    try:  # (a port taken, a signal: the sandbox goes with the service)
        search = None
        if codebase_search:
            from codedojo.harness.embeddings import CodebaseIndex

            search = CodebaseIndex()  # the model loads on the first search
        server = ToolServer(sandbox=sandbox, envs=envs, search=search, idle_s=idle_s)
        try:
            running = serve_in_thread(server, host=host, port=port, uds=uds)
        except OSError as e:  # a port taken, an address not this host's, no such directory
            flag, where = ("--uds", uds) if uds else ("--host/--port", f"{host}:{port}")
            raise ValueError(f"{flag}: cannot listen on {where} ({e.strerror or e})") from None
        # the token on stdout, to the process that started this one (`ToolClient(url,
        # token=...)`)
        print(json.dumps({"url": running.url, "uds": uds, "token": running.token,
                          "sandbox_id": sandbox.id, "pid": os.getpid()}), flush=True)
        try:
            while True:
                signal.pause()  # (until a signal ends the service)
        finally:
            running.stop()
            server.close()
    finally:
        sandbox.destroy()


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image")
    ap.add_argument("--dir", dest="directory")
    ap.add_argument("--root")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--uds")
    ap.add_argument("--no-codebase-search", action="store_true")
    ap.add_argument("--idle-s", type=float, default=IDLE_S,
                    help="close an episode no call used for this long (0: never)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=TOML", help="an environment's tool config")
    a = ap.parse_args(argv)
    if not 0 <= a.idle_s < float("inf"):
        ap.error(f"--idle-s: expected seconds >= 0, got {a.idle_s}")
    envs: dict[str, Path] = {}
    for item in a.env:
        name, sep, path = item.partition("=")
        if not sep:
            ap.error(f"--env: expected NAME=TOML, got {item!r}")
        envs[name] = Path(path)
    try:
        serve(image=a.image, directory=a.directory, root=a.root, host=a.host, port=a.port, uds=a.uds,
              env_configs=envs, codebase_search=not a.no_codebase_search,
              idle_s=a.idle_s or None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
