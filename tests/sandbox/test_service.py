"""The service and its client: the same operations as the local kind, over HTTP; bad input
gets a clear error and the service keeps serving the other sandboxes; admission control."""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time
import uuid

import pytest
import uvicorn

from codedojo.sandbox.base import (
    Change,
    FileTooLarge,
    Limits,
    NotFound,
    Sandbox,
    SandboxError,
    SandboxSpec,
)
from codedojo.sandbox.client import SandboxClient
from codedojo.sandbox.local import LocalProvider
from codedojo.sandbox.service import ServiceConfig, create_app
from tests.sandbox.conftest import SMALL


@pytest.fixture(scope="module")
def service(provider):
    config = ServiceConfig(token="test-token")
    app = create_app(config, provider=provider)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield url, config
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def client(service):
    c = SandboxClient(service[0], token="test-token")
    yield c
    for s in c.list():
        c.get(s["id"]).destroy()
    c.close()


@pytest.fixture
def remote(client, project):
    sb = client.create(SandboxSpec(image=project, limits=SMALL))
    yield sb
    sb.destroy()


def test_remote_sandbox_has_the_local_interface(remote):
    assert isinstance(remote, Sandbox)
    r = remote.exec(["python3", "-c", "import sys; print(sys.stdin.buffer.read().hex())"], stdin=b"\x00\xff")
    assert (r.exit_code, r.stdout) == (0, "00ff\n")
    assert remote.exec("echo $X; pwd", env={"X": "1"}, cwd="pkg").stdout == "1\n/workspace/pkg\n"
    assert remote.exec("sleep 10", timeout=0.2).timed_out


def test_a_command_allowed_longer_than_the_clients_timeout_is_waited_for(service, remote):
    """The client's own timeout (here 1 s) is for calls without a limit of their own: an exec
    or a shell run of 3 s is answered, not cut off while the service still runs it."""
    c = SandboxClient(service[0], token="test-token", timeout=1.0)
    try:
        sb = c.get(remote.id)
        assert sb.exec("sleep 2; echo done", timeout=3).stdout == "done\n"
        assert sb.shell().run("sleep 2; echo done", timeout=3).stdout == "done\n"
    finally:
        c.close()


def test_a_command_under_the_sandboxs_own_time_limit_is_waited_for(service, project):
    """A command given no time limit runs under the sandbox's `Limits.exec_timeout_s`: the
    client waits that long (a sandbox made, got or forked), not its own timeout (here 1 s);
    an answer that does not come in time is said to be late, not the service unreachable."""
    c = SandboxClient(service[0], token="test-token", timeout=1.0)
    sb = c.create(SandboxSpec(image=project, limits=dataclasses.replace(SMALL, exec_timeout_s=10)))
    try:
        assert sb.exec("sleep 2; echo done").stdout == "done\n"
        assert sb.shell().run("sleep 2; echo done").stdout == "done\n"
        assert c.get(sb.id).exec("sleep 2; echo got").stdout == "got\n"
        (f,) = sb.fork(1)
        try:
            assert f.exec("sleep 2; echo fork").stdout == "fork\n"
        finally:
            f.destroy()
        with pytest.raises(SandboxError, match=r"no answer .* within 1 s; the request may still "
                                               r"complete on the service"):
            sb._http.call("POST", sb._url("/exec"), json={"command": "sleep 5"})
    finally:
        sb.destroy()
        c.close()


def test_a_create_or_fork_is_waited_for_past_the_clients_timeout(service, client, remote,
                                                                  project, provider,
                                                                  monkeypatch):
    """A create or fork answered after the client's timeout (here made slow on purpose): the
    client still learns every sandbox it made (were it to give up, they would live on in the
    service, unknown to it)."""
    def slowly(call):
        def slow(*args, **kw):
            time.sleep(1.0)
            return call(*args, **kw)
        return slow

    monkeypatch.setattr(provider, "create", slowly(provider.create))
    local = provider.get(remote.id)
    monkeypatch.setattr(local, "fork", slowly(local.fork))
    short = SandboxClient(service[0], token="test-token", timeout=0.2)
    try:
        made = [short.create(SandboxSpec(image=project, limits=SMALL))]
        made += short.get(remote.id).fork(4)
        assert len(made) == 5
        assert {f.id for f in made} | {remote.id} == {s["id"] for s in client.list()}
        for f in made:
            f.destroy()
    finally:
        short.close()


def test_an_id_or_name_with_a_control_character_is_a_clear_error(client):
    with pytest.raises(SandboxError, match=r"sandbox_id: .*HTTP 404"):
        client.get("sb-\n1")
    with pytest.raises(SandboxError, match=r"HTTP 404"):
        client.get("../gc")
    with pytest.raises(SandboxError, match=r"image: no image or name 'x\\x01'"):
        client.images.resolve("x\x01")


def test_an_image_is_removed_through_the_service(client, provider, project, tmp_path):
    """`DELETE /images/{ref}` removes as `ImageStore.remove` does: an unknown image is a 404
    naming it; a named one is kept unless forced, and one a live sandbox runs on is kept
    (400s, as other refusals are)."""
    (tmp_path / "f.txt").write_text(uuid.uuid4().hex)
    named = provider.images.from_directory(str(tmp_path), name="remote-rm")
    plain = provider.images.from_directory(str(tmp_path), parent=named.id, dest="/opt/x")
    for ref in ("no-such-image", "x\x01"):
        with pytest.raises(SandboxError, match=re.escape(f"image: no image or name {ref!r} in")
                           + ".*HTTP 404"):
            client.images.remove(ref)
    with pytest.raises(SandboxError, match=r"'remote-rm' is named \(remote-rm\): kept.*HTTP 400"):
        client.images.remove("remote-rm")
    sb = client.create(SandboxSpec(image="remote-rm", limits=SMALL))
    try:
        with pytest.raises(SandboxError, match=f"in use by live sandboxes: {sb.id} .*HTTP 400"):
            client.images.remove("remote-rm", force=True)
    finally:
        sb.destroy()
    assert client.images.remove(plain.id) == plain.id  # (no name: no force needed)
    assert client.images.remove("remote-rm", force=True) == named.id
    assert "remote-rm" not in client.images.list()["names"]
    for ref in ("remote-rm", named.id, plain.id):
        with pytest.raises(SandboxError, match=re.escape(f"no image or name {ref!r} in")
                           + ".*HTTP 404"):
            client.images.resolve(ref)
    assert client.images.resolve(project)["id"] == project


def test_remote_files_and_shell(remote):
    remote.write_file("bin.dat", bytes(range(256)))
    assert remote.read_file("bin.dat") == bytes(range(256))
    # A read given a limit is refused, as FileTooLarge, by the service before it reads.
    assert remote.read_file("bin.dat", max_bytes=256) == bytes(range(256))
    with pytest.raises(FileTooLarge, match="bin.dat holds 256 bytes, more than the 255") as e:
        remote.read_file("bin.dat", max_bytes=255)
    assert (e.value.path, e.value.size, e.value.max_bytes) == ("/workspace/bin.dat", 256, 255)
    with pytest.raises(SandboxError, match="max_bytes"):
        remote.read_file("bin.dat", max_bytes=-1)
    assert remote.stat("bin.dat").size == 256
    assert "/workspace/bin.dat" in {f.path for f in remote.list_dir()}
    remote.remove("bin.dat")
    assert remote.exec("test -e bin.dat").exit_code == 1
    sh = remote.shell()
    sh.run("cd /tmp && export K=v")
    assert sh.run("pwd; echo $K").stdout == "/tmp\nv\n"
    sh.close()


def test_remote_snapshot_fork_restore_changes(remote):
    remote.write_file("a.txt", "one")
    snap = remote.snapshot()
    (f,) = remote.fork(1, snap)
    try:
        f.write_file("a.txt", "fork")
        assert remote.read_file("a.txt") == b"one"
        remote.write_file("a.txt", "two")
        remote.restore(snap)
        assert remote.read_file("a.txt") == b"one"
        assert Change("/workspace/a.txt", "added") in f.changes()
        remote.write_file("pkg/__init__.py", "VALUE = 0\n")
        assert remote.read_original("pkg/__init__.py") == b"VALUE = 41\n"
        with pytest.raises(SandboxError, match="not in the sandbox's image"):
            remote.read_original("a.txt")
        with pytest.raises(FileTooLarge, match="__init__.py holds 11 bytes, more than the 4"):
            remote.read_original("pkg/__init__.py", max_bytes=4)
    finally:
        f.destroy()


def test_bad_input_gets_clear_errors_and_service_keeps_serving(client, remote, project):
    def raw(path: str, body: bytes):
        return remote._http.call("POST", remote._url(path), content=body,
                                 headers={"content-type": "application/json"})

    cases = [
        (lambda: client.create(SandboxSpec(image="no-such-image")), "no image"),
        (lambda: client.create(SandboxSpec(image=project, limits=Limits(pids=0))), "limits.pids"),
        (lambda: remote.read_file("../../etc/passwd"), "escapes"),
        (lambda: remote.write_file("/workspace/../../x", "x"), "escapes"),
        (lambda: remote.exec(""), "command"),
        (lambda: remote.exec([]), "command"),
        (lambda: remote.exec(["a", 1]), "command"),  # type: ignore[list-item]
        (lambda: remote.restore("not-a-snapshot"), "no image"),
        (lambda: client.get("sb-missing"), "HTTP 404"),
        (lambda: remote.fork(0), "n"),
        # each of these was a 500 from deep inside: named, a 400
        (lambda: remote._http.call("POST", remote._url("/exec"),
                                   json={"command": "cat", "stdin_b64": "abc"}), "stdin_b64"),
        # (JSON can escape a lone surrogate, which no client of ours would send)
        (lambda: raw("/exec", rb'{"command": ["echo", "\udce9"]}'), "lone surrogate"),
        (lambda: raw("/exec", rb'{"command": "true", "env": {"K": "\udce9"}}'),
         "lone surrogate"),
        (lambda: remote.exec("true", timeout=1e300), "timeout: .* at most"),
        (lambda: client.create(SandboxSpec(image=project, limits=Limits(pids=10**12))),
         "limits.pids"),
        (lambda: client.create(SandboxSpec(image=project, limits=Limits(memory_mb=2**44))),
         "limits.memory_mb"),
    ]
    for call, message in cases:
        with pytest.raises(SandboxError, match=message):
            call()
    big = client.create(SandboxSpec(image=project, limits=Limits(disk_mb=4)))
    try:
        with pytest.raises(SandboxError, match="disk limit"):
            big.write_file("fill", b"0" * (8 << 20))
    finally:
        big.destroy()
    assert remote.exec("echo still serving").stdout == "still serving\n"
    assert client.health()["ok"]


def test_admission_control_names_the_resource(client, service, project):
    url, config = service
    old = config.max_memory_percent
    config.max_memory_percent = 0.0
    try:
        with pytest.raises(SandboxError, match=r"memory.*HTTP 503"):
            client.create(SandboxSpec(image=project))
    finally:
        config.max_memory_percent = old
    old = config.max_sandboxes
    config.max_sandboxes = 0
    try:
        with pytest.raises(SandboxError, match=r"sandboxes: .*HTTP 503"):
            client.create(SandboxSpec(image=project))
    finally:
        config.max_sandboxes = old
    sb = client.create(SandboxSpec(image=project, limits=SMALL))
    config.max_sandboxes = len(client.list()) + 1
    try:  # a fork of four counts as four
        with pytest.raises(SandboxError, match=r"and 4 asked for.*HTTP 503"):
            sb.fork(4)
        (one,) = sb.fork(1)
        one.destroy()
    finally:
        config.max_sandboxes = old
        sb.destroy()


def test_admission_holds_room_for_a_create_under_way(client, service, project, provider,
                                                     monkeypatch):
    """The last place left goes to one create: a second create sent while the first is still
    being made (not yet live) is refused."""
    url, config = service
    entered, release = threading.Event(), threading.Event()
    real_create = provider.create
    calls = []

    def slow_create(spec):
        calls.append(spec)
        if len(calls) == 1:  # the first create waits, admitted but not yet live
            entered.set()
            release.wait(60)
        return real_create(spec)

    monkeypatch.setattr(provider, "create", slow_create)
    old = config.max_sandboxes
    config.max_sandboxes = len(client.list()) + 1
    other = SandboxClient(url, token="test-token")
    made = {}
    first = threading.Thread(target=lambda: made.update(
        a=client.create(SandboxSpec(image=project, limits=SMALL))))
    first.start()
    try:
        assert entered.wait(60)
        with pytest.raises(SandboxError, match=r"sandboxes: .*1 being made.*HTTP 503"):
            made["b"] = other.create(SandboxSpec(image=project, limits=SMALL))
    finally:
        release.set()
        first.join(60)
        config.max_sandboxes = old
        for sb in made.values():
            sb.destroy()
        other.close()
    assert "a" in made


def test_many_sandboxes_alive_at_once(client, project):
    sandboxes = [client.create(SandboxSpec(image=project, limits=SMALL)) for _ in range(16)]
    try:
        outs = [s.exec("echo $$ > /tmp/me; cat /tmp/me").stdout for s in sandboxes]
        assert all(o.strip().isdigit() for o in outs)
        assert len(client.list()) >= 16
    finally:
        for s in sandboxes:
            s.destroy()


def _live_ids(url: str) -> set[str]:
    c = SandboxClient(url, token="test-token")
    try:
        return {s["id"] for s in c.list()}
    finally:
        c.close()


def test_cli_drives_the_service(service, project):
    # In-process (the `dojo` entry point imports every stage, which takes seconds per call).
    from typer.testing import CliRunner

    from codedojo.sandbox.cli import sandbox_app

    url, _ = service
    runner = CliRunner()

    def dojo(*args: str):
        r = runner.invoke(sandbox_app, list(args), env={"CODEDOJO_SANDBOX_URL": url,
                                                        "CODEDOJO_SANDBOX_TOKEN": "test-token"})
        r.returncode = r.exit_code
        return r

    sid = dojo("create", project, "--disk-mb", "16").stdout.strip()
    assert sid.startswith("sb-")
    r = dojo("exec", sid, "echo hi > f; cat f; exit 3")
    assert (r.returncode, r.stdout) == (3, "hi\n")
    snap = dojo("snapshot", sid).stdout.strip()
    forks = dojo("fork", sid, "-n", "2", "--snapshot", snap).stdout.split()
    assert len(forks) == 2
    assert sid in dojo("ls").stdout
    assert dojo("rm", forks[0]).returncode == 0
    r = dojo("rm", sid, "sb-nosuch", *forks)  # each one there is destroyed, each other named
    assert r.returncode == 2 and r.stderr.count("error: ") == 2, r.stderr
    assert f"no live sandbox {forks[0]!r}" in r.stderr and "'sb-nosuch'" in r.stderr
    assert not {sid, *forks} & _live_ids(url)
    r = dojo("exec", sid, "true")
    assert r.returncode == 2 and "no live sandbox" in r.stderr


def test_cli_serve_says_where_it_listens_and_where_its_token_is(provider, monkeypatch):
    """`serve` prints its URL (the port 0 picked) and the token's file, not the token; a port
    taken or out of range, and a limit below one, are named before it starts."""
    import os
    import signal
    import subprocess
    import sys

    from typer.testing import CliRunner

    from codedojo.sandbox.cli import sandbox_app

    monkeypatch.delenv("CODEDOJO_SANDBOX_TOKEN", raising=False)
    root = provider.root
    proc = subprocess.Popen(
        [sys.executable, "-c", "from codedojo.sandbox.cli import sandbox_app; sandbox_app()",
         "serve", "--root", root, "--port", "0"], stdout=subprocess.PIPE, text=True)
    killer = threading.Timer(120, proc.kill)  # a service that never says where it is fails
    killer.start()
    try:
        line = proc.stdout.readline()
        killer.cancel()
        token_file = os.path.join(root, "service.token")
        assert line.startswith("Sandbox service at http://127.0.0.1:"), line
        assert line.endswith(f" (token: {token_file})\n"), line
        url = line.split()[3]
        token = open(token_file).read().strip()
        assert token not in line
        c = SandboxClient(url, token=token)
        assert c.list() == []
        c.close()
        port = url.rsplit(":", 1)[1]
        runner = CliRunner()
        for args, said in [(["--port", port], f"error: cannot listen on 127.0.0.1:{port} "
                                               "(Address already in use)"),
                           (["--port", "70000"], "--port"), (["--port", "-1"], "--port"),
                           (["--max-sandboxes", "0"], "--max-sandboxes")]:
            r = runner.invoke(sandbox_app, ["serve", "--root", root, *args],
                              env={"COLUMNS": "200"})
            assert r.exit_code == 2 and said in r.output, (args, r.output)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)  # (uvicorn, once shut down, ends by the signal it was sent)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("signals", [("SIGTERM",), ("SIGINT", "SIGINT")])
def test_cli_serve_stopped_ends_the_commands_it_runs(provider, project, monkeypatch, signals):
    """SIGTERM (or Ctrl-C, or a second one at once) stops `serve` while a command allowed 10
    minutes runs: once requests under way have had a few seconds, its sandboxes are
    destroyed, and the command with them, instead of the service waiting for it to end."""
    import os
    import signal
    import subprocess
    import sys

    monkeypatch.delenv("CODEDOJO_SANDBOX_TOKEN", raising=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", "from codedojo.sandbox.cli import sandbox_app; sandbox_app()",
         "serve", "--root", provider.root, "--port", "0"], stdout=subprocess.PIPE, text=True)
    killer = threading.Timer(120, proc.kill)  # a service that never stops fails, not hangs
    killer.start()
    sid, ended = None, []
    try:
        url = proc.stdout.readline().split()[3]
        c = SandboxClient(url, token=open(os.path.join(provider.root, "service.token")).read()
                          .strip())  # fmt: skip
        sid = c.create(SandboxSpec(image=project, limits=SMALL)).id

        def run() -> None:
            try:
                ended.append(c.get(sid).exec("touch /workspace/started; sleep 600", timeout=600))
            except SandboxError as e:  # (its request cancelled once the few seconds are over)
                ended.append(e)

        command = threading.Thread(target=run)
        command.start()
        while c.get(sid).exec("test -e /workspace/started").exit_code != 0:
            time.sleep(0.05)
        port = int(url.rsplit(":", 1)[1])
        proc.send_signal(getattr(signal, signals[0]))
        if len(signals) > 1:  # the second once the first is taken (the service stops listening)
            while _listens(port):
                time.sleep(0.05)
            proc.send_signal(getattr(signal, signals[1]))
        proc.wait()
        assert killer.is_alive(), "the service ran on with the command"
        command.join(30)
        assert ended and not command.is_alive()
        assert not os.path.exists(os.path.join(provider.sandboxes_dir, sid))
    finally:
        killer.cancel()
        proc.kill()
        proc.wait()
        if sid is not None:
            provider.gc()


def test_cli_gc_refuses_a_root_that_is_not_a_store(tmp_path):
    """A mistyped --root is named; no store, and no tmpfs, is made there."""
    from typer.testing import CliRunner

    from codedojo.sandbox.cli import sandbox_app

    empty = tmp_path / "empty"
    empty.mkdir()
    for root in (tmp_path / "typo", empty):
        r = CliRunner().invoke(sandbox_app, ["gc", "--root", str(root)])
        assert r.exit_code == 2, r.output
        assert (f"error: {root} is not a sandbox store (no {root}/sandboxes; a store holds "
                "sandboxes/, layers/ and images/)") in r.output
    assert not (tmp_path / "typo").exists() and list(empty.iterdir()) == []


def test_cli_exec_help_says_how_to_pass_a_commands_options():
    from typer.testing import CliRunner

    from codedojo.sandbox.cli import sandbox_app

    r = CliRunner().invoke(sandbox_app, ["exec", "--help"], env={"COLUMNS": "200"})
    assert "Put -- before a command that has options" in " ".join(r.output.split())


def test_cli_image_and_gc(provider, tmp_path):
    from typer.testing import CliRunner

    from codedojo.sandbox.cli import sandbox_app

    (tmp_path / "hello.txt").write_text("hi")
    runner = CliRunner()
    r = runner.invoke(sandbox_app, ["image", str(tmp_path), "--name", "cli-image", "--root", provider.root])
    assert r.exit_code == 0 and provider.images.resolve("cli-image").id == r.stdout.strip()
    r = runner.invoke(sandbox_app, ["gc", "--root", provider.root])
    assert r.exit_code == 0 and '"cleaned": []' in r.stdout


def test_limits_roundtrip_through_json():
    assert Limits(**dataclasses.asdict(SMALL)) == SMALL


def test_only_a_caller_with_the_token_is_served(service, tmp_path, monkeypatch):
    """The service runs as root and builds images on the host: a request without its token,
    or with another, is refused; with no token given, one is made in the store, readable by
    its owner only, and the client on that machine reads it there."""
    import os
    import stat

    from codedojo.sandbox.service import service_token

    url, _ = service
    monkeypatch.delenv("CODEDOJO_SANDBOX_TOKEN", raising=False)
    monkeypatch.setenv("CODEDOJO_SANDBOX_ROOT", str(tmp_path / "elsewhere"))
    for token in (None, "wrong"):
        with pytest.raises(SandboxError, match=r"unauthorized.*\(HTTP 401\)"):
            SandboxClient(url, token=token).health()
    made = service_token(ServiceConfig(), str(tmp_path / "store"))
    path = tmp_path / "store" / "service.token"
    assert path.read_text().strip() == made and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert service_token(ServiceConfig(), str(tmp_path / "store")) == made  # read, not made again
    monkeypatch.setenv("CODEDOJO_SANDBOX_ROOT", str(tmp_path / "store"))
    from codedojo.sandbox.client import _local_token

    assert _local_token() == made


def test_the_service_has_a_worker_thread_for_each_command_it_admits(provider):
    """A running command holds a worker thread: the pool is sized at startup from the
    sandboxes the service admits, past anyio's default of 40, where 40 commands left /health
    and a destroy waiting for one to end."""
    import anyio
    import anyio.to_thread

    config = ServiceConfig(token="test-token", max_sandboxes=100)
    app = create_app(config, provider=LocalProvider(root=provider.root, pool_size=0))

    async def started() -> float:
        async with app.router.lifespan_context(app):
            return anyio.to_thread.current_default_thread_limiter().total_tokens

    assert anyio.run(started) >= 2 * config.max_sandboxes


def test_a_fault_no_route_expects_is_answered_and_the_connection_kept(client, remote,
                                                                       provider, monkeypatch):
    """An exception no handler knows is a JSON 500 naming it, and the client's next call on
    the same connection is served; a str stdin UTF-8 cannot carry is a 400 naming it."""
    def broken() -> list:
        raise RuntimeError("the store's index is unreadable")

    monkeypatch.setattr(provider.images, "list", broken)
    with pytest.raises(SandboxError, match=r"internal error: RuntimeError: the store's index "
                                           r"is unreadable \(HTTP 500\)"):
        client.images.list()
    assert client.health()["ok"]
    with pytest.raises(SandboxError, match=r"stdin: not text that UTF-8 can carry.*HTTP 400"):
        remote._http.call("POST", remote._url("/exec"), content=rb'{"command": "cat", '
                          rb'"stdin": "\udce9"}', headers={"content-type": "application/json"})
    assert remote.exec("echo ok").stdout == "ok\n"


def test_a_body_past_the_sandbox_s_disk_or_the_service_s_cap_is_refused_unread(
        client, service, project, provider, monkeypatch):
    """A file write longer than its sandbox's disk is refused (413) before it reaches the
    sandbox, whether its length is given or it is streamed; a request body past
    `max_body_mb` (a command's stdin) is refused too. The connection serves on."""
    import httpx

    url, config = service
    sb = client.create(SandboxSpec(image=project, limits=dataclasses.replace(SMALL, disk_mb=4)))
    try:
        local = provider.get(sb.id)
        writes = []
        monkeypatch.setattr(local, "write_file", lambda *a, **kw: writes.append(a))
        with pytest.raises(SandboxError, match=r"disk limit \(4 MB\) or the service.s"):
            sb.write_file("big", b"0" * (5 << 20))

        def streamed():
            for _ in range(8):
                yield b"0" * (1 << 20)

        r = httpx.put(f"{url}/sandboxes/{sb.id}/file", params={"path": "big"}, content=streamed(),
                      headers={"authorization": "Bearer test-token"})
        assert r.status_code == 413 and "disk limit (4 MB)" in r.json()["detail"]
        assert writes == []
        old, config.max_body_mb = config.max_body_mb, 1
        try:
            with pytest.raises(SandboxError, match=r"more than the service takes \(1 MB, "
                                                   r"max_body_mb\) \(HTTP 413\)"):
                sb.exec("wc -c", stdin=b"0" * (2 << 20))

            def chunked():  # (no length: counted as it comes)
                yield b'{"command": "true", "stdin": "'
                for _ in range(3):
                    yield b"0" * (1 << 20)
                yield b'"}'

            r = httpx.post(f"{url}/sandboxes/{sb.id}/exec", content=chunked(),
                           headers={"authorization": "Bearer test-token",
                                    "content-type": "application/json"})
            assert r.status_code == 413 and "max_body_mb" in r.json()["detail"]
        finally:
            config.max_body_mb = old
        sb.write_file("small", b"1" * 100)
        assert writes and sb.exec("echo ok").stdout == "ok\n"
    finally:
        sb.destroy()


def test_not_found_is_told_by_type_not_by_message(client, remote, provider, monkeypatch):
    """A 404 is an unknown or destroyed sandbox or shell (`NotFound`), whatever other
    messages say; the client's destroy lets only that pass."""
    remote.write_file("notes/what was destroyed.txt", "x")
    remote.remove("notes/what was destroyed.txt")
    with pytest.raises(SandboxError, match=r"No such file.*HTTP 400") as e:
        remote.read_file("notes/what was destroyed.txt")
    assert not isinstance(e.value, NotFound)
    with pytest.raises(NotFound, match=r"sandbox_id: .*HTTP 404"):
        client.get("sb-nosuch")
    with pytest.raises(NotFound, match=r"shell_id: .*HTTP 404"):
        remote._http.call("POST", remote._url("/shells/sh-nosuch/run"), json={"command": "true"})
    def refused() -> None:
        raise SandboxError("its cgroup was destroyed, its mounts not")

    monkeypatch.setattr(provider.get(remote.id), "destroy", refused)
    with pytest.raises(SandboxError, match=r"mounts not \(HTTP 400\)"):
        remote.destroy()
    monkeypatch.undo()
    remote.destroy()
    remote.destroy()  # gone already: no error


def test_a_remote_fork_names_the_snapshot_it_started_from(client, remote, project):
    """A fork's `source`, as a local one's: the snapshot `fork` took, for the caller to
    remove once the forks are gone."""
    assert remote.source == project and client.get(remote.id).source == project
    remote.write_file("a.txt", uuid.uuid4().hex)
    forks = remote.fork(2)
    snap = forks[0].source
    assert snap not in (None, project) and {f.source for f in forks} == {snap}
    assert client.get(forks[0].id).source == snap
    for f in forks:
        f.destroy()
    assert client.images.remove(snap) == snap
    remote.restore(project)
    assert remote.source == project


def test_a_token_file_others_could_have_read_or_set_is_refused(tmp_path, monkeypatch):
    """The store's token file is used only when it holds a token, belongs to the service's
    user and no one else may read or write it; each refusal says how to fix it. The client
    takes an empty one for none."""
    import os

    from codedojo.sandbox.client import _local_token
    from codedojo.sandbox.service import service_token

    monkeypatch.delenv("CODEDOJO_SANDBOX_TOKEN", raising=False)
    root = tmp_path / "store"
    root.mkdir()
    path = root / "service.token"
    path.write_text("guessable\n")
    for mode in (0o644, 0o620):
        os.chmod(path, mode)
        with pytest.raises(SandboxError, match=f"mode {mode:o} lets its group or others read "
                                               f"or write it: chmod 600 {path}"):
            service_token(ServiceConfig(), str(root))
    os.chmod(path, 0o600)
    assert service_token(ServiceConfig(), str(root)) == "guessable"
    os.chown(path, 1000, 1000)
    with pytest.raises(SandboxError, match=f"owned by uid 1000, not by this service's user "
                                           f"\\(uid {os.geteuid()}\\).*remove {path}"):
        service_token(ServiceConfig(), str(root))
    os.chown(path, os.geteuid(), os.getegid())
    path.write_text("\n")
    with pytest.raises(SandboxError, match=f"{path}: empty: remove {path}"):
        service_token(ServiceConfig(), str(root))
    monkeypatch.setenv("CODEDOJO_SANDBOX_ROOT", str(root))
    assert _local_token() is None


def test_the_open_files_limit_travels_to_the_service(client, project):
    limits = dataclasses.replace(SMALL, open_files=256)  # (a field LimitsIn must carry)
    sb = client.create(SandboxSpec(image=project, limits=limits))
    try:
        assert sb.exec("ulimit -n").stdout == "256\n"
    finally:
        sb.destroy()
