"""The tool service over JSON-RPC: episodes, errors, per-environment config, live update."""

from __future__ import annotations

import os
import time

import pytest

from codedojo.harness.loop import Agent, LoopConfig
from codedojo.harness.policy import ScriptedPolicy
from codedojo.harness.rpc import RPCError, ToolClient, ToolServer, serve_in_thread
from codedojo.harness.toolset import EnvToolConfig
from codedojo.harness.trajectory import read_jsonl


@pytest.fixture
def service(sandbox):
    server = ToolServer(sandbox=sandbox, envs={"default": EnvToolConfig(), "tiny": EnvToolConfig(tools=["read_file"])})
    running = serve_in_thread(server)
    client = running.client()
    yield server, running, client
    client.close()
    running.stop()
    server.close()


def test_tool_calls_over_rpc(service):
    server, _, client = service
    ep = client.open_episode()
    assert {s["function"]["name"] for s in ep.schemas} >= {"read_file", "grep", "run_terminal_cmd"}
    r = ep.call("read_file", {"target_file": "README.md"})
    assert not r.is_error and r.content.startswith("     1|# inventory") and r.version == "1"
    r = ep.call("run_terminal_cmd", {"command": "cd tests && export X=1"})
    assert ep.call("run_terminal_cmd", {"command": "pwd; echo $X"}).content == "exit code: 0\n/workspace/tests\n1"
    # Tool failures are results; the service keeps serving.
    r = ep.call("read_file", '{"target_file": 3')
    assert r.is_error and "not valid JSON" in r.content
    # Half an emoji (a lone surrogate) travels as its JSON escape both ways
    r = ep.call("todo_write", {"merge": False, "todos": [{"id": "s", "content": "x \ud83d"}]})
    assert not r.is_error and ep.state()["todos"][0]["content"] == "x \ud83d"
    ep.call("todo_write", {"merge": False, "todos": [{"id": "a", "content": "x"}]})
    assert ep.state()["todos"] == [{"id": "a", "content": "x", "status": "pending"}]
    ep.close()
    assert ep.episode_id not in server.episodes
    # Bad requests are RPC errors naming the field.
    with pytest.raises(RPCError, match="episode_id: unknown episode"):
        ep.call("read_file", {"target_file": "README.md"})
    with pytest.raises(RPCError, match="env: unknown environment 'nope'"):
        client.open_episode("nope")
    with pytest.raises(RPCError, match="method: unknown method"):
        client.request("tool.explode")
    with pytest.raises(RPCError, match="episode_id: must be a string, got list"):
        client.request("tool.call", episode_id=["ep-1"], name="read_file")
    with pytest.raises(RPCError, match="name: must be a string, got int"):
        client.request("tool.call", episode_id="ep-1", name=3)
    with pytest.raises(RPCError, match="env: must be a string, got dict"):
        client.request("episode.open", env={})


def test_a_caller_without_the_services_token_is_refused(service):
    """A port on 127.0.0.1 is open to every user of the machine: a call without the token (or
    with another) runs nothing."""
    server, running, _ = service
    assert running.token and len(running.token) >= 32
    for token in (None, "guess"):
        stranger = ToolClient(running.url, token=token)
        with pytest.raises(RPCError, match="HTTP 401: .*unauthorized"):
            stranger.open_episode()
        stranger.close()
    assert not server.episodes


def test_per_environment_tool_config(service):
    _, _, client = service
    tiny = client.open_episode("tiny")
    assert [s["function"]["name"] for s in tiny.schemas] == ["read_file"]
    r = tiny.call("grep", {"pattern": "x"})
    assert r.is_error and "unknown tool 'grep'" in r.content
    client.configure_env("lenient", EnvToolConfig(tools=["read_file"], strictness="lenient"))
    len_ep = client.open_episode("lenient")
    assert not len_ep.call("read_file", {"target_file": "README.md", "limit": "1", "extra": 1}).is_error
    assert tiny.call("read_file", {"target_file": "README.md", "limit": "1"}).is_error
    with pytest.raises(RPCError, match="config"):
        client.request("env.configure", env="bad", config={"strictness": "loose"})


def test_unix_socket_transport(sandbox, tmp_path):
    server = ToolServer(sandbox=sandbox)
    sock = str(tmp_path / "tools.sock")
    running = serve_in_thread(server, uds=sock)
    client = running.client()
    try:
        assert os.stat(sock).st_mode & 0o777 == 0o600  # the owner's alone
        ep = client.open_episode()
        assert ep.call("run_terminal_cmd", {"command": "echo hi"}).content == "exit code: 0\nhi"
        with pytest.raises(FileExistsError, match="another tool service serves on"):
            serve_in_thread(server, uds=sock)  # (it took the socket a live service serves on)
        assert ep.call("run_terminal_cmd", {"command": "echo on"}).content == "exit code: 0\non"
    finally:
        client.close()
        running.stop()
    again = serve_in_thread(server, uds=sock)  # a dead service's socket is replaced
    again.stop()
    server.close()
    with pytest.raises(FileNotFoundError):  # (the caller names it, as a port taken)
        serve_in_thread(server, uds=str(tmp_path / "nosuch" / "tools.sock"))
    (tmp_path / "plain").write_text("x")
    with pytest.raises(FileExistsError, match="is not a socket"):
        serve_in_thread(server, uds=str(tmp_path / "plain"))


def test_live_update_running_episode_keeps_its_version(service, tmp_path):
    """Episode A starts on read_file v1; v2 is registered while A runs; A finishes on v1 and an
    episode started afterwards runs on v2."""
    _, _, client = service
    registered: list[int] = []

    def register_v2(messages):
        registered.append(client.register("tests.harness.live_tools", "READ_FILE_V2"))
        return [("read_file", {"target_file": "README.md"})]

    policy_a = ScriptedPolicy([
        [("read_file", {"target_file": "README.md"})],
        register_v2,  # the job registers v2 in the middle of episode A
        [("read_file", {"target_file": "inventory/__init__.py"})],
        "done",
    ])
    ep_a = client.open_episode()
    traj_a = Agent(policy_a, LoopConfig(max_turns=10)).run("read things", ep_a, out=tmp_path / "a.jsonl")
    assert registered and traj_a.status == "finished"
    assert traj_a.tool_versions["read_file"] == "1"
    versions_a = [c.version for t in traj_a.turns for c in t.tool_calls]
    assert versions_a == ["1", "1", "1"]
    assert not any("[read_file v2]" in str(m.get("content")) for m in traj_a.messages)

    ep_b = client.open_episode()
    assert ep_b.versions["read_file"] == "2" and ep_b.generation > ep_a.generation
    traj_b = Agent(ScriptedPolicy([[("read_file", {"target_file": "README.md"})], "done"])).run("read", ep_b)
    assert traj_b.tool_versions["read_file"] == "2"
    assert traj_b.turns[0].tool_calls[0].version == "2"
    assert traj_b.messages[3]["content"].startswith("[read_file v2]")
    # The saved trajectory of A records the versions it ran on.
    assert read_jsonl(tmp_path / "a.jsonl").tool_versions["read_file"] == "1"
    # Pinning in config still reaches v1 for new episodes.
    client.configure_env("pinned", EnvToolConfig(versions={"read_file": "1"}))
    assert client.open_episode("pinned").versions["read_file"] == "1"


def test_a_tool_module_registered_again_is_read_again(tmp_path, monkeypatch):
    """A module registered once, then edited: registering it again runs the edited source (an
    edit of the same size, within the second, too), while an episode pinned to the version
    before runs that version's code, helpers and all. An edit that keeps the version is
    refused, a helper's too; the module unchanged registers as before."""
    from codedojo.harness.toolset import ToolRegistry

    class NoSandbox:
        id = "sb-none"

    source = ("from codedojo.harness.tools.base import FunctionTool, obj\n"
              "def said():\n    return {said!r}\n"
              "TOOL = FunctionTool('probe', 'a probe', obj({{}}, []), lambda ctx, args: said(),"
              " version={version!r})\n")
    module = tmp_path / "probe_tool_module.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)  # (bytecode is not read)
    server = ToolServer(sandbox=NoSandbox(), registry=ToolRegistry([]),  # type: ignore[arg-type]
                        envs={"default": EnvToolConfig(tools=["probe"]),
                              "pinned": EnvToolConfig(tools=["probe"], versions={"probe": "1"})})

    def register() -> object:
        return server.dispatch("tools.register", {"module": module.stem, "attr": "TOOL"})

    try:
        module.write_text(source.format(said="old", version="1"))
        register()
        pinned = server.open_episode("pinned")
        module.write_text(source.format(said="new", version="2"))  # (the same size)
        register()
        assert server.open_episode().call("probe", {}).content == "new"
        assert pinned.call("probe", {}).content == "old"
        assert server.open_episode("pinned").call("probe", {}).content == "old"
        module.write_text(source.format(said="NEW", version="2"))  # (a helper's edit)
        with pytest.raises(RPCError, match="tool 'probe' version '2' is already registered"):
            register()
        module.write_text(source.format(said="new", version="2"))
        assert register()
        assert server.registry.versions("probe") == ["1", "2"]
        assert server.open_episode().call("probe", {}).content == "new"
    finally:
        server.close()


def test_a_dead_tool_service_ends_the_episode(sandbox, tmp_path):
    server = ToolServer(sandbox=sandbox)
    running = serve_in_thread(server)
    client = running.client(timeout=5)
    ep = client.open_episode()

    def kill(messages):
        running.stop()
        return [("read_file", {"target_file": "README.md"})]

    policy = ScriptedPolicy([[("read_file", {"target_file": "README.md"})], kill, "never reached"])
    traj = Agent(policy).run("t", ep, out=tmp_path / "t.jsonl")
    client.close()
    server.close()
    assert traj.status == "error" and traj.error
    saved = read_jsonl(tmp_path / "t.jsonl")
    assert saved.status == "error" and len(saved.turns) == 2
    saved.validate()


def test_episodes_run_concurrently(service):
    """One episode's long command does not hold up another's calls."""
    import threading
    import time

    _, running, client = service
    slow_client = running.client()
    slow = slow_client.open_episode()
    fast = client.open_episode()
    done = threading.Event()

    def long_call():
        slow.call("run_terminal_cmd", {"command": "sleep 2"})
        done.set()

    t = threading.Thread(target=long_call)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    r = fast.call("read_file", {"target_file": "README.md"})
    assert not r.is_error and not done.is_set() and time.monotonic() - t0 < 1.5
    t.join()
    slow_client.close()


def test_a_tool_allowed_longer_than_the_clients_timeout_is_waited_for(sandbox):
    """A call answers within its tool's time limit (the environment's), which may be longer
    than the client's own timeout: the client waits for it rather than ending the episode."""
    server = ToolServer(sandbox=sandbox, envs={"default": EnvToolConfig(timeouts={"run_terminal_cmd": 600})})
    running = serve_in_thread(server)
    client = running.client(timeout=1.0)
    try:
        ep = client.open_episode()
        assert ep.time_limits["run_terminal_cmd"] == 600 and ep.time_limits["read_file"] == 60
        r = ep.call("run_terminal_cmd", {"command": "sleep 2; echo done"})
        assert not r.is_error and r.content.endswith("done")
        t0 = time.perf_counter()  # an episode with a second left: a second, not 600
        r = ep.call("run_terminal_cmd", {"command": "sleep 20; echo done"}, time_left=1.0)
        assert r.is_error and "timed out after 1s" in r.content and time.perf_counter() - t0 < 10
        with pytest.raises(RPCError, match="time_left: must be a finite number of seconds > 0"):
            client.request("tool.call", episode_id=ep.episode_id, name="read_file",
                           arguments={"target_file": "README.md"}, time_left=float("nan"))
        with pytest.raises(TimeoutError):  # asked without the tool's limit: the client's own
            client.request("tool.call", episode_id=ep.episode_id, name="run_terminal_cmd",
                           arguments={"command": "sleep 2"})
    finally:
        client.close()
        running.stop()
        server.close()


def test_calls_beyond_a_thread_pools_size_do_not_hold_up_the_others():
    """Forty-five episodes each in a call that waits (a long command), and another episode's
    call is answered at once, not after them."""
    import threading

    from codedojo.harness.tools.base import FunctionTool, obj
    from codedojo.harness.toolset import ToolRegistry

    release = threading.Event()
    nap = FunctionTool("nap", "wait", obj({}, []), lambda ctx, a: str(release.wait(60)))
    echo = FunctionTool("echo", "echo", obj({}, []), lambda ctx, a: "here")

    class NoSandbox:
        id = "sb-none"

    server = ToolServer(sandbox=NoSandbox(),  # type: ignore[arg-type]
                        registry=ToolRegistry([nap, echo]),
                        envs={"default": EnvToolConfig(tools=["nap", "echo"])})
    running = serve_in_thread(server)
    try:
        eps = [running.client().open_episode() for _ in range(46)]
        waiting = [threading.Thread(target=e.call, args=("nap", {})) for e in eps[:45]]
        for t in waiting:
            t.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        assert eps[45].call("echo", {}).content == "here"
        assert time.perf_counter() - t0 < 5
    finally:
        release.set()
        for t in waiting:
            t.join()
        running.stop()
        server.close()


def test_tools_serve_names_what_it_cannot_start_from(provider, tmp_path):
    """An image or directory that is not there, or a port out of range: one line, exit 2."""
    from typer.testing import CliRunner

    from codedojo.cli import app

    root = provider.root
    for args, said in [(["--image", "nosuch"], "error: image: no image or name 'nosuch'"),
                       (["--dir", str(tmp_path / "nosuch")], "is not a directory"),
                       (["--image", "x", "--port", "-1"], "--port"),
                       (["--image", "x", "--port", "70000"], "--port")]:
        r = CliRunner().invoke(app, ["tools", "serve", "--root", root, *args],
                               env={"COLUMNS": "200"})
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (args, r.output)
        assert said in r.output and "Traceback" not in r.output, (args, r.output)


def test_tools_serve_hands_the_idle_limit_to_the_service(monkeypatch):
    from typer.testing import CliRunner

    from codedojo.cli import app
    from codedojo.harness import service

    got: list[list[str]] = []
    monkeypatch.setattr(service, "main", got.append)
    for args, idle in [([], None), (["--idle-s", "30"], "30.0"), (["--idle-s", "0"], "0.0")]:
        r = CliRunner().invoke(app, ["tools", "serve", "--image", "x", *args])
        assert r.exit_code == 0, r.output
        argv = got.pop()
        assert (argv[argv.index("--idle-s") + 1] if "--idle-s" in argv else None) == idle
    r = CliRunner().invoke(app, ["tools", "serve", "--image", "x", "--idle-s", "-1"])
    assert r.exit_code == 2 and "--idle-s" in r.output


def test_tools_serve_names_a_bad_env_file_or_address_and_leaves_no_sandbox(
        provider, repo_image, tmp_path):
    import os
    import socket

    from typer.testing import CliRunner

    from codedojo.cli import app

    (tmp_path / "bad.toml").write_text("[tools\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    sandboxes = os.path.join(provider.root, "sandboxes")
    before = set(os.listdir(sandboxes))
    for args, said in [
        (["--env", f"ci={tmp_path / 'missing.toml'}"], f"--env ci: {tmp_path}/missing.toml: no "
                                                       "such file"),
        (["--env", f"ci={tmp_path / 'bad.toml'}"], f"--env ci: {tmp_path}/bad.toml: not TOML"),
        (["--port", str(port)], f"--host/--port: cannot listen on 127.0.0.1:{port}"),
        (["--uds", str(tmp_path / "nosuch" / "t.sock")],
         f"--uds: cannot listen on {tmp_path}/nosuch/t.sock (No such file or directory)"),
    ]:
        r = CliRunner().invoke(app, ["tools", "serve", "--root", provider.root, "--image",
                                     repo_image, *args], env={"COLUMNS": "200"})
        assert r.exit_code == 2 and said in r.output, (args, r.output)
        assert "Traceback" not in r.output
    taken.close()
    assert set(os.listdir(sandboxes)) == before  # (the one made for the taken port is gone)


def test_an_episode_in_a_with_block_is_closed_however_it_ends(service):
    """The service keeps an episode's shell until it is closed: a with block closes it, an
    error inside it too."""
    server, _, client = service
    with client.open_episode() as episode:
        episode.call("run_terminal_cmd", {"command": "cd /tmp"})
        assert len(server.episodes) == 1
    assert len(server.episodes) == 0
    with pytest.raises(RuntimeError), client.open_episode():
        assert len(server.episodes) == 1
        raise RuntimeError("the loop failed")
    assert len(server.episodes) == 0


def test_tools_serve_signalled_while_it_starts_leaves_no_sandbox(provider, repo_image):
    """SIGTERM after the sandbox is made and before the service listens: the sandbox goes with
    the service, which ends as a signalled running one does."""
    import subprocess
    import sys

    child = (
        "import os, signal, sys, time\n"
        "import codedojo.harness.service as service\n"
        "def starting(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "service.serve_in_thread = starting\n"
        "service.main(sys.argv[1:])\n"
    )
    sandboxes = os.path.join(provider.root, "sandboxes")
    before = set(os.listdir(sandboxes))
    r = subprocess.run([sys.executable, "-c", child, "--root", provider.root, "--image",
                        repo_image, "--no-codebase-search"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stdout, (r.returncode, r.stderr)
    assert set(os.listdir(sandboxes)) == before


def test_an_episode_no_call_uses_is_closed_after_the_idle_limit():
    """A client that died holds its episode only for the service's idle limit; an episode in
    a call that outlasts the limit is not idle."""
    import threading

    from codedojo.harness.tools.base import FunctionTool, obj
    from codedojo.harness.toolset import ToolRegistry

    release = threading.Event()
    nap = FunctionTool("nap", "wait", obj({}, []), lambda ctx, a: str(release.wait(60)))
    echo = FunctionTool("echo", "echo", obj({}, []), lambda ctx, a: "here")

    class NoSandbox:
        id = "sb-none"

    with pytest.raises(ValueError, match="idle_s: must be a number of seconds > 0"):
        ToolServer(sandbox=NoSandbox(), idle_s=0)  # type: ignore[arg-type]
    server = ToolServer(sandbox=NoSandbox(),  # type: ignore[arg-type]
                        registry=ToolRegistry([nap, echo]),
                        envs={"default": EnvToolConfig(tools=["nap", "echo"])}, idle_s=1)
    try:
        busy = server.open_episode().episode_id
        idle = server.open_episode().episode_id
        napping = threading.Thread(target=server.dispatch, args=(
            "tool.call", {"episode_id": busy, "name": "nap", "arguments": {}}))
        napping.start()
        deadline = time.monotonic() + 30
        while idle in server.episodes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert idle not in server.episodes and busy in server.episodes
        with pytest.raises(RPCError, match=f"episode {idle!r} was closed after 1 s without a "
                                           "call"):
            server.dispatch("tool.call", {"episode_id": idle, "name": "echo"})
        release.set()
        napping.join()
        again = server.dispatch("tool.call", {"episode_id": busy, "name": "echo"})
        assert again["content"] == "here"
    finally:
        release.set()
        server.close()
