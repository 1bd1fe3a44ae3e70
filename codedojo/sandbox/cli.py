"""`dojo sandbox ...`: serve the service, drive it (create, exec, snapshot, fork, ls, rm), build
images and clean up after a crash (gc).

Sandboxes live in the service process (`serve`), so the driving commands talk to it at
--url (default $CODEDOJO_SANDBOX_URL or http://127.0.0.1:8181), with the service's token
($CODEDOJO_SANDBOX_TOKEN, or the store's `service.token` on the service's machine, readable by
root only: the service runs as root and builds images on the host). `image` and `gc` work on the
store directly and need no service.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

import typer

sandbox_app = typer.Typer(help="Sandboxes: serve, create, exec, snapshot, fork, restore, ls, rm, "
                               "gc, image.",
                          no_args_is_help=True)

SHUTDOWN_GRACE_S = 5  # how long `serve`, once stopped, waits for requests under way
URL = typer.Option(None, "--url", help="Service URL (default $CODEDOJO_SANDBOX_URL or http://127.0.0.1:8181).")
ROOT = typer.Option(None, "--root", help="Store directory (default $CODEDOJO_SANDBOX_ROOT or /var/lib/codedojo/sandbox).")


def _client(url: str | None):
    from codedojo.sandbox.client import SandboxClient

    return SandboxClient(url or os.environ.get("CODEDOJO_SANDBOX_URL", "http://127.0.0.1:8181"))


def _fail(e: Exception | str) -> NoReturn:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


@sandbox_app.command()
def serve(root: str = ROOT, host: str = typer.Option("127.0.0.1"),
          port: int = typer.Option(8181, min=0, max=65535, help="0 picks a free port."),
          max_sandboxes: int = typer.Option(512, min=1),
          max_memory_percent: float = typer.Option(90.0)) -> None:
    """Run the sandbox service (HTTP/JSON) until interrupted; prints its URL and where its
    token is once it listens."""
    import socket

    import uvicorn

    from codedojo.sandbox.base import TOKEN_ENV, SandboxError, token_path
    from codedojo.sandbox.service import ServiceConfig, create_app

    v6 = ":" in host
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
    try:  # bound here: a port taken is named, and the one 0 picks is known
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        _fail(f"cannot listen on {host}:{port} ({e.strerror or e})")
    try:
        app = create_app(ServiceConfig(root=root,
                                       max_sandboxes=max_sandboxes,
                                       max_memory_percent=max_memory_percent))
    except (SandboxError, OSError) as e:
        sock.close()
        _fail(e)
    token = f"${TOKEN_ENV}" if os.environ.get(TOKEN_ENV) else token_path(app.state.provider.root)
    url = f"http://{f'[{host}]' if v6 else host}:{sock.getsockname()[1]}"
    typer.echo(f"Sandbox service at {url} (token: {token})")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            # The app's lifespan does this too, but a second Ctrl-C skips it; and until its
            # sandbox is gone, the thread running a command keeps the process alive.
            app.state.provider.close()

    # SIGTERM or Ctrl-C: requests under way get SHUTDOWN_GRACE_S to finish, then the sandboxes
    # are destroyed, ending the commands still running in them.
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    Server(config).run(sockets=[sock])


@sandbox_app.command()
def create(image: str, memory_mb: int = 2048, pids: int = 512, cpus: float = 1.0, disk_mb: int = 2048,
           url: str = URL) -> None:
    """Create a sandbox from an image id or name; prints its id."""
    from codedojo.sandbox.base import Limits, SandboxError, SandboxSpec

    try:
        sb = _client(url).create(SandboxSpec(image=image, limits=Limits(memory_mb=memory_mb, pids=pids, cpus=cpus, disk_mb=disk_mb)))
    except SandboxError as e:
        _fail(e)
    typer.echo(sb.id)


@sandbox_app.command("exec")
def exec_(sandbox_id: str, command: list[str], timeout: float = typer.Option(None), url: str = URL) -> None:
    """Run a command (one argument: through sh -c; several: as argv); exits with its status.
    Put -- before a command that has options: dojo sandbox exec ID -- ls -la."""
    from codedojo.sandbox.base import SandboxError

    try:
        r = _client(url).get(sandbox_id).exec(command[0] if len(command) == 1 else command, timeout=timeout)
    except SandboxError as e:
        _fail(e)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    if r.timed_out:
        typer.echo("timed out", err=True)
    raise typer.Exit(r.exit_code)


@sandbox_app.command()
def snapshot(sandbox_id: str, url: str = URL) -> None:
    """Freeze a sandbox's writable layer; prints the snapshot id."""
    from codedojo.sandbox.base import SandboxError

    try:
        typer.echo(_client(url).get(sandbox_id).snapshot())
    except SandboxError as e:
        _fail(e)


@sandbox_app.command()
def fork(sandbox_id: str, n: int = typer.Option(1, "-n"), snapshot: str = typer.Option(None), url: str = URL) -> None:
    """Start N sandboxes from a snapshot (a fresh one when not given); prints their ids."""
    from codedojo.sandbox.base import SandboxError

    try:
        for sb in _client(url).get(sandbox_id).fork(n, snapshot):
            typer.echo(sb.id)
    except SandboxError as e:
        _fail(e)


@sandbox_app.command()
def restore(sandbox_id: str, snapshot: str, url: str = URL) -> None:
    """Roll a sandbox back to a snapshot."""
    from codedojo.sandbox.base import SandboxError

    try:
        _client(url).get(sandbox_id).restore(snapshot)
    except SandboxError as e:
        _fail(e)


@sandbox_app.command("ls")
def ls(url: str = URL) -> None:
    """List live sandboxes (JSON lines)."""
    from codedojo.sandbox.base import SandboxError

    try:
        for s in _client(url).list():
            typer.echo(json.dumps(s))
    except SandboxError as e:
        _fail(e)


@sandbox_app.command("rm")
def rm(sandbox_ids: list[str], url: str = URL) -> None:
    """Destroy sandboxes: each one there is, naming each one that is not (exit status 2)."""
    from codedojo.sandbox.base import SandboxError

    client = _client(url)
    failed = False
    for i in sandbox_ids:
        try:
            client.get(i).destroy()
        except SandboxError as e:
            typer.echo(f"error: {e}", err=True)
            failed = True
    if failed:
        raise typer.Exit(2)


@sandbox_app.command()
def gc(root: str = ROOT, all_owners: bool = typer.Option(False, help="Also sandboxes of other live processes.")) -> None:
    """Clean up after a crash: processes, mounts, cgroups and directories of dead owners."""
    from codedojo.sandbox.local import LocalProvider, missing_from_store, store_root

    # A store is made where none is: a mistyped root would get one (and a tmpfs), not a gc.
    if (missing := missing_from_store(store := store_root(root))) is not None:
        _fail(f"{store} is not a sandbox store (no {missing}; a store holds sandboxes/, "
              "layers/ and images/)")
    cleaned = LocalProvider(root=root).gc(all_owners=all_owners)
    typer.echo(json.dumps({"cleaned": cleaned}))


@sandbox_app.command()
def image(path: str, name: str = typer.Option(None), dest: str = typer.Option("/workspace"),
          parent: str = typer.Option(None), root: str = ROOT) -> None:
    """Build an image from a directory (or a git URL ending in .git); prints its id."""
    from codedojo.sandbox.base import SandboxError
    from codedojo.sandbox.local import LocalProvider

    store = LocalProvider(root=root).images
    try:
        img = (store.from_git(path, dest=dest, parent=parent, name=name) if path.endswith(".git")
               else store.from_directory(path, dest=dest, parent=parent, name=name))
    except SandboxError as e:
        _fail(e)
    typer.echo(img.id)


def register(app: typer.Typer) -> None:
    app.add_typer(sandbox_app, name="sandbox")
