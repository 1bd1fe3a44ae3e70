"""Every operation of the local sandbox, on real sandboxes."""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
import uuid
from dataclasses import replace

import pytest

from codedojo.sandbox import local
from codedojo.sandbox.base import (
    Change,
    EgressBinding,
    ExecResult,
    FileTooLarge,
    Limits,
    NotFound,
    Sandbox,
    SandboxError,
    SandboxSpec,
)
from tests.sandbox.conftest import SMALL, fds_under


def test_sandbox_implements_the_protocol(sandbox):
    assert isinstance(sandbox, Sandbox)


def test_exec_runs_as_unprivileged_user_in_workspace(sandbox):
    r = sandbox.exec("id -u; pwd; hostname; cat pkg/__init__.py")
    assert r.exit_code == 0, r
    assert r.stdout.split("\n")[:4] == ["1000", "/workspace", "sandbox", "VALUE = 41"]


def test_exec_argv_stdin_env_cwd_and_exit_code(sandbox):
    r = sandbox.exec(["python3", "-c", "import sys,os; print(sys.stdin.read().upper(), os.environ['X'], os.getcwd()); sys.exit(3)"],
                     stdin="abc", env={"X": "y"}, cwd="pkg")
    assert r == ExecResult(3, "ABC y /workspace/pkg\n", "", duration_s=r.duration_s)
    assert sandbox.exec(["no-such-binary"]).exit_code == 127
    r = sandbox.exec("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")


def test_exec_timeout_and_output_cap(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=Limits(max_output_bytes=1000, disk_mb=16)))
    try:
        r = sb.exec("echo started; sleep 30", timeout=0.3)
        assert r.timed_out and r.exit_code == 137 and r.stdout == "started\n"
        r = sb.exec("head -c 5000 /dev/zero | tr '\\0' a; echo END")
        cut = "\n[... 4004 bytes cut by the sandbox ...]\n"
        assert r.truncated and r.stdout == "a" * 500 + cut + "a" * 496 + "END\n"
        assert r.exit_code == 0
        assert sb.exec("echo still alive").stdout == "still alive\n"
    finally:
        sb.destroy()


def test_a_timeout_ends_what_the_command_started_setsid_included(provider, project):
    """A kill at the time limit reaches a daemon that left the command's session; a command that
    ends by itself leaves what it started in the background running."""
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))
    try:
        r = sb.exec("setsid sleep 601 >/dev/null 2>&1 & (setsid sh -c 'sleep 602' >/dev/null "
                    "2>&1 &); sleep 0.3; echo started; sleep 30", timeout=1.5)
        assert r.timed_out and r.exit_code == 137 and r.stdout == "started\n"
        ps = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
        left = sb.exec(ps).stdout
        assert "sleep 601" not in left and "sleep 602" not in left, left
        assert sb.exec("setsid sleep 603 >/dev/null 2>&1 & echo ok").stdout == "ok\n"
        assert "sleep 603" in sb.exec(ps).stdout
        r = sb.exec("sh -c 'kill -SEGV $$'")
        assert r.exit_code == 128 + 11  # a command's own end comes through as it was
    finally:
        sb.destroy()


def test_a_fork_bomb_ends_at_the_time_limit(provider, project):
    """Every process of the command's tree, stopped and then killed, however fast they fork:
    the call returns at its limit, and nothing of it is left."""
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))
    try:
        bomb = "python3 -c 'import os\nwhile True:\n  try: os.fork()\n  except OSError: pass'"
        t0 = time.monotonic()
        r = sb.exec(bomb, timeout=2)
        assert r.timed_out and r.exit_code == 137 and time.monotonic() - t0 < 20
        assert sb.exec("echo alive").stdout == "alive\n"
        if sb.cgroup is not None:
            assert len(sb.cgroup.pids()) <= 2  # init and its shepherd's next command at most
    finally:
        sb.destroy()


def test_a_shell_says_how_it_ended_and_is_let_go(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))
    try:
        for _ in range(10):  # its pipes close before init's report comes: it is waited for
            sh = sb.shell()
            assert sh.run("exit 3").exit_code == 3
            sh.close()
        assert not sb._shells  # closed shells are not kept
        sh = sb.shell()
        import threading

        ran: list = []
        t = threading.Thread(target=lambda: ran.append(sh.run("sleep 20", timeout=20)))
        t.start()
        time.sleep(1)
        t0 = time.monotonic()
        sb.destroy()  # at once, not at the command's limit
        assert time.monotonic() - t0 < 5
        t.join(10)
        assert ran and ran[0].exit_code == 137
    finally:
        sb.destroy()


def test_spec_env_reaches_every_command(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=SMALL, env={"TASK": "t1"}))
    try:
        assert sb.exec("echo $TASK $HOME").stdout == "t1 /home/user\n"
        assert sb.shell().run("echo $TASK").stdout == "t1\n"
    finally:
        sb.destroy()


@pytest.mark.parametrize("env", [{"A=B": "1"}, {"X": "a\0b"}, {"": "x"}, {"X": 1},
                                 {"X": "\udcff"}, ["X"]])
def test_a_spec_env_no_command_could_take_is_refused_at_create(provider, project, env):
    with pytest.raises(SandboxError, match="spec.env"):
        provider.create(SandboxSpec(image=project, limits=SMALL, env=env))


def test_the_spec_env_is_kept_as_checked_at_create(provider, project):
    """The spec's variables are checked once, at create, and the sandbox keeps them as they
    were then: a later change to the caller's mapping reaches no command."""
    env = {"TASK": "t1"}
    sb = provider.create(SandboxSpec(image=project, limits=SMALL, env=env))
    try:
        env["TASK"], env["BAD=NAME"] = "t2", "x"
        assert sb.exec("echo $TASK").stdout == "t1\n"
        with pytest.raises(SandboxError, match="env: invalid variable 'A=B'"):
            sb.exec("true", env={"A=B": "1"})  # the call's own variables: checked per call
    finally:
        sb.destroy()


@pytest.mark.parametrize("command", ["", "   ", [], ["ls", 3], ["a\0b"], 42])
def test_malformed_commands_are_refused(sandbox, command):
    with pytest.raises(SandboxError, match="command"):
        sandbox.exec(command)
    assert sandbox.exec("true").exit_code == 0


def test_files_read_write_list_stat_remove(sandbox):
    sandbox.write_file("src/new/mod.py", "x = 1\n")
    assert sandbox.read_file("/workspace/src/new/mod.py") == b"x = 1\n"
    r = sandbox.exec("stat -c '%U %a' src/new/mod.py src/new; cat src/new/mod.py")
    assert r.stdout == "user 644\nuser 755\nx = 1\n"
    sandbox.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sandbox.exec("./run.sh").stdout == "ran\n"
    names = {f.path: f for f in sandbox.list_dir()}
    assert {"/workspace/src", "/workspace/run.sh", "/workspace/pkg", "/workspace/README.md"} <= set(names)
    assert names["/workspace/src"].kind == "dir" and names["/workspace/run.sh"].mode == 0o755
    info = sandbox.stat("README.md")
    assert (info.kind, info.size, info.path) == ("file", 6, "/workspace/README.md")
    sandbox.exec("ln -s README.md link")
    assert sandbox.stat("link").kind == "symlink"
    assert sandbox.read_file("link") == b"hello\n"
    sandbox.remove("src")
    sandbox.remove("README.md")
    assert sandbox.exec("ls src README.md").exit_code != 0
    with pytest.raises(SandboxError, match="no such file"):
        sandbox.remove("README.md")
    with pytest.raises(SandboxError):
        sandbox.read_file("missing.txt")
    with pytest.raises(SandboxError, match="directory"):
        sandbox.read_file("pkg")
    # files written by commands are visible to the host side and back
    sandbox.exec("echo from-cmd > /tmp/t.txt")
    assert sandbox.read_file("/tmp/t.txt") == b"from-cmd\n"
    # system directories come from the host, read-only
    assert sandbox.read_file("/usr/bin/python3")[:4] == b"\x7fELF"


@pytest.mark.parametrize("path", ["../x", "../../etc/passwd", "/workspace/../../root/x", "a/../../..", "", "a\0b"])
def test_escaping_paths_are_refused(sandbox, path):
    with pytest.raises(SandboxError, match="path"):
        sandbox.write_file(path, "x")
    with pytest.raises(SandboxError, match="path"):
        sandbox.read_file(path)


def test_host_writes_respect_sandbox_permissions(sandbox):
    with pytest.raises(SandboxError, match="permission denied"):
        sandbox.write_file("/etc/passwd", "evil")
    with pytest.raises(SandboxError):
        sandbox.write_file("/usr/evil", "x")
    assert not os.path.exists("/usr/evil")
    sandbox.write_file("/tmp/ok", "fine", mode=0o4755)
    assert sandbox.stat("/tmp/ok").mode == 0o755  # no setuid from the host side


def test_a_write_through_a_relative_link_lands_where_a_command_s_would(sandbox):
    """A link's relative target is taken from the directory the link is in, which a link on
    the way there (/workspace/a) may have moved."""
    sandbox.exec("mkdir /tmp/real && ln -s /tmp/real /workspace/a && ln -s ../x /tmp/real/f")
    sandbox.write_file("/workspace/a/f", "from the host\n")
    assert sandbox.read_file("/tmp/x") == b"from the host\n"
    r = sandbox.exec("cat /workspace/a/f; ls /workspace/x")
    assert r.stdout == "from the host\n" and r.exit_code != 0


def test_persistent_shell_keeps_cwd_and_env(sandbox):
    sh = sandbox.shell()
    assert sh.run("cd pkg && export A=1 && B=2").exit_code == 0
    r = sh.run("pwd; echo $A $B; printf 'no newline'")
    assert r.stdout == "/workspace/pkg\n1 2\nno newline"
    assert sh.run("false").exit_code == 1
    assert sh.run("echo 'a\"b' && echo héllo\necho two; cat").stdout == 'a"b\nhéllo\ntwo\n'  # stdin: /dev/null
    assert sh.run("if then").exit_code == 2  # a syntax error does not break the session
    assert sh.run("echo err >&2; pwd").stderr == "err\n"
    r = sh.run("sleep 20", timeout=0.3)
    assert r.timed_out
    assert sh.run("pwd").stdout == "/workspace\n"  # a fresh shell after the timeout
    sh.close()


def test_snapshot_fork_independence(sandbox):
    sandbox.write_file("state.txt", "parent-1")
    snap = sandbox.snapshot()
    a, b = sandbox.fork(2, snap)
    try:
        a.write_file("state.txt", "fork-a")
        a.write_file("only-a.txt", "a")
        b.exec("rm README.md")
        assert b.read_file("state.txt") == b"parent-1"
        assert sandbox.read_file("state.txt") == b"parent-1"
        assert sandbox.exec("ls only-a.txt").exit_code != 0
        assert b.exec("ls only-a.txt").exit_code != 0
        assert a.read_file("README.md") == b"hello\n" == sandbox.read_file("README.md")
        sandbox.write_file("after.txt", "p")
        assert a.exec("ls after.txt").exit_code != 0
        # forks of forks stack layers
        c = a.fork(1)[0]
        try:
            assert c.read_file("state.txt") == b"fork-a" and c.read_file("only-a.txt") == b"a"
        finally:
            c.destroy()
    finally:
        a.destroy()
        b.destroy()


def test_restore_is_byte_identical_and_kills_processes(sandbox):
    sandbox.exec("mkdir -p d/e && head -c 100000 /dev/urandom > d/e/blob && ln -s d/e/blob ln && chmod 600 d/e/blob")
    before = sandbox.exec("cd /workspace && find . -printf '%p %y %m %l\\n' | sort && find . -type f -printf '%p %s\\n' | sort && sha256sum d/e/blob data.bin").stdout
    snap = sandbox.snapshot()
    sandbox.exec("setsid sleep 600 >/dev/null 2>&1 & rm -rf d data.bin; echo junk > d2; chmod 700 pkg")
    assert sandbox.exec("pgrep -x sleep").exit_code == 0
    sandbox.restore(snap)
    after = sandbox.exec("cd /workspace && find . -printf '%p %y %m %l\\n' | sort && find . -type f -printf '%p %s\\n' | sort && sha256sum d/e/blob data.bin").stdout
    assert after == before
    assert sandbox.exec("pgrep -x sleep").exit_code == 1
    # restore to the original image too
    sandbox.restore(sandbox.image.id)
    assert sandbox.exec("ls d").exit_code != 0


def test_deletions_survive_snapshot_and_fork(sandbox):
    sandbox.exec("rm old.txt && rm -r pkg && mkdir pkg && echo new > pkg/fresh.py")
    fork = sandbox.fork(1)[0]
    try:
        assert fork.exec("ls old.txt").exit_code != 0
        assert fork.exec("ls pkg").stdout == "fresh.py\n"  # opaque: old pkg contents gone
    finally:
        fork.destroy()


def test_changes_lists_what_the_agent_did(sandbox):
    sandbox.write_file("pkg/__init__.py", "VALUE = 42\n")
    sandbox.write_file("new.py", "")
    sandbox.remove("old.txt")
    sandbox.exec("touch README.md")  # same bytes: copied up but not a change
    want = [Change("/workspace/new.py", "added"), Change("/workspace/old.txt", "deleted"),
            Change("/workspace/pkg/__init__.py", "modified")]
    assert sandbox.changes() == want
    # the other side of each change: the image's bytes
    assert sandbox.read_original("pkg/__init__.py") == b"VALUE = 41\n"
    assert sandbox.read_original("/workspace/old.txt") == b"to be deleted\n"
    with pytest.raises(SandboxError, match="new.py: not in the sandbox's image"):
        sandbox.read_original("new.py")
    snap = sandbox.snapshot()
    fork = sandbox.fork(1, snap)[0]
    try:
        assert fork.changes() == want  # relative to the original image, not the snapshot
        assert fork.read_original("pkg/__init__.py") == b"VALUE = 41\n"
    finally:
        fork.destroy()


def test_changes_closes_the_layers_it_holds_open(provider, sandbox, monkeypatch):
    """`changes` and `read_original` hold the layers' roots open while they look, and close
    them after, also when the comparison fails."""
    provider.drain_pool()  # (no pooled sandbox is started meanwhile: its fds would count)
    sandbox.write_file("pkg/__init__.py", "VALUE = 42\n")
    before = fds_under(provider.root)
    assert sandbox.changes() == [Change("/workspace/pkg/__init__.py", "modified")]
    assert sandbox.read_original("pkg/__init__.py") == b"VALUE = 41\n"
    assert fds_under(provider.root) == before

    def fail(*args: object) -> bool:
        raise SandboxError("compare failed")

    monkeypatch.setattr(local, "_same_entry", fail)
    with pytest.raises(SandboxError, match="compare failed"):
        sandbox.changes()
    assert fds_under(provider.root) == before


def test_a_directory_removed_or_replaced_reports_what_it_held(provider, tmp_path):
    src = tmp_path / "tree"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("A = 1\n")
    (src / "pkg" / "sub" / "deep.py").write_text("B = 2\n")
    (src / "keep.py").write_text("C = 3\n")
    image = provider.images.from_directory(str(src), name="tree").id
    gone = [Change("/workspace/pkg/__init__.py", "deleted"),
            Change("/workspace/pkg/sub/deep.py", "deleted")]
    for command, extra in (("rm -rf pkg", []),
                           ("rm -rf pkg && echo hi > pkg", [Change("/workspace/pkg", "added")]),
                           ("rm -rf pkg && ln -s /etc pkg", [Change("/workspace/pkg", "added")])):
        sb = provider.create(SandboxSpec(image=image, limits=SMALL))
        try:
            sb.exec(command)
            assert sb.changes() == sorted(gone + extra, key=lambda c: c.path), command
        finally:
            sb.destroy()


def test_a_snapshot_of_another_image_is_refused(sandbox, provider, tmp_path):
    """What changed, and from what, is told against the sandbox's image: a stack of another
    image's layers would make changes() report nothing of what it holds."""
    (tmp_path / "evil.py").write_text("X = 1\n")
    other = provider.images.from_directory(str(tmp_path), name="other").id
    for call in (lambda: sandbox.restore(other), lambda: sandbox.fork(1, other)):
        with pytest.raises(SandboxError, match="is not a snapshot of this sandbox's image"):
            call()
    assert sandbox.changes() == [] and sandbox.exec("cat README.md").stdout == "hello\n"


def test_the_original_of_a_link_in_the_image_is_never_a_host_file(provider, tmp_path):
    """An image's links are read as the sandbox would resolve them, never on the host."""
    src = tmp_path / "linked"
    src.mkdir()
    (src / "etc").mkdir()
    (src / "etc" / "hostname").write_text("the image's own\n")
    os.symlink("/etc/hostname", src / "file_link")
    os.symlink("/etc", src / "dir_link")
    image = provider.images.from_directory(str(src), name="linked")
    sb = provider.create(SandboxSpec(image=image.id, limits=SMALL))
    try:
        with pytest.raises(SandboxError, match="file_link is not a regular file in the sandbox's"):
            sb.read_original("file_link")
        # through a linked directory: a path is read as written (as `changes` names it), and
        # a link on it is no directory (the host's /etc/hostname is never looked at)
        with pytest.raises(SandboxError, match="dir_link/hostname: not in the sandbox's image"):
            sb.read_original("dir_link/hostname")
        assert sb.read_original("etc/hostname") == b"the image's own\n"
    finally:
        sb.destroy()


def test_missing_image_or_layer_is_a_clear_error(provider, project):
    with pytest.raises(SandboxError, match="no image"):
        provider.create(SandboxSpec(image="does-not-exist"))
    img = provider.images.from_directory(os.path.dirname(__file__), dest="/opt/t")
    os.rename(provider.images.layer_path(img.layers[0]), provider.images.layer_path(img.layers[0]) + ".gone")
    try:
        with pytest.raises(SandboxError, match="missing"):
            provider.create(SandboxSpec(image=img.id))
    finally:
        os.rename(provider.images.layer_path(img.layers[0]) + ".gone", provider.images.layer_path(img.layers[0]))
    with pytest.raises(SandboxError, match="limits.memory_mb"):
        provider.create(SandboxSpec(image=project, limits=Limits(memory_mb=0)))
    with pytest.raises(SandboxError, match="sandbox_id"):
        provider.get("sb-nope")


def test_destroyed_sandbox_refuses_work(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))
    sb.destroy()
    sb.destroy()  # idempotent
    for call in (lambda: sb.exec("true"), lambda: sb.read_file("README.md")):
        with pytest.raises(NotFound, match="destroyed"):
            call()
    with pytest.raises(NotFound, match="sandbox_id"):
        provider.get(sb.id)


def test_image_builders(provider, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("v1\n")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    first = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (repo / "f.txt").write_text("v2\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)
    img = provider.images.from_git(str(repo), rev=first, name="repo-v1")
    assert provider.images.resolve("repo-v1").id == img.id
    # same content, same address (a clone's .git differs each time, so compare directories)
    assert provider.images.from_directory(str(repo)).id == provider.images.from_directory(str(repo)).id
    wheel = _tiny_wheel(tmp_path)
    env = provider.images.from_python_env([str(wheel)], dest="/opt/venv", parent=img.id, name="repo-env",
                                          pip_args=["--no-index", "--no-deps"])
    cmd = provider.images.from_command("echo built > /workspace/built.txt && mkdir -p /home/user/.cache",
                                       parent=env.id, name="repo-built")
    assert len(cmd.layers) == len(env.layers) + 1 == len(img.layers) + 2
    sb = provider.create(SandboxSpec(image="repo-built", limits=SMALL))
    try:
        r = sb.exec("cat f.txt built.txt && git log --oneline | wc -l && /opt/venv/bin/python -c 'import sys, tinypkg; print(sys.prefix, tinypkg.X)'")
        assert r.stdout == "v1\nbuilt\n1\n/opt/venv 7\n", r
    finally:
        sb.destroy()
    with pytest.raises(SandboxError, match="command"):
        provider.images.from_command("exit 3", parent=img.id)
    with pytest.raises(SandboxError, match="dest"):
        provider.images.from_directory(str(repo), dest="/usr/x")
    with pytest.raises(SandboxError, match="repo"):
        provider.images.from_git(str(tmp_path / "nope"))


def _tiny_wheel(tmp_path):
    """A pure-Python wheel made by hand, so the venv builder is tested without the network."""
    import zipfile

    path = tmp_path / "tinypkg-0.1-py3-none-any.whl"
    files = {
        "tinypkg/__init__.py": "X = 7\n",
        "tinypkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 0.1\n",
        "tinypkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + "tinypkg-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
        z.writestr("tinypkg-0.1.dist-info/RECORD", record)
    return path


def test_criu_is_reported_plainly():
    from codedojo.sandbox.local import criu_available

    assert criu_available() in (True, False)


def test_snapshot_repeating_an_earlier_layer(sandbox):
    """The same writable-layer content twice in one stack (overlayfs forbids a repeated dir)."""
    sandbox.write_file("a.txt", "A")
    s1 = sandbox.snapshot()
    sandbox.restore(s1)
    assert sandbox.snapshot() == s1  # nothing changed since: the same image
    sandbox.write_file("b.txt", "B")
    s2 = sandbox.snapshot()
    sandbox.restore(s2)
    sandbox.remove("a.txt")
    sandbox.restore(s2)
    sandbox.write_file("a.txt", "A")  # upper now equals s1's layer, which is deeper in the stack
    s3 = sandbox.snapshot()
    (fork,) = sandbox.fork(1, s3)
    try:
        assert fork.read_file("a.txt") == b"A" and fork.read_file("b.txt") == b"B"
    finally:
        fork.destroy()


def test_deep_layer_stack_beyond_the_mount_option_limit(provider, project):
    """Forks of forks stack layers; 120 exceed mount(2)'s 4 KiB option string."""
    store = provider.images
    layers = list(store.resolve(project).layers)
    for i in range(120):
        with store.build_dir() as tmp:
            os.makedirs(os.path.join(tmp, "workspace"))
            os.chown(os.path.join(tmp, "workspace"), 1000, 1000)
            with open(os.path.join(tmp, "workspace", f"layer{i:03d}.txt"), "w") as f:
                f.write(str(i))
            layers.insert(0, store.commit_layer(tmp))
    image = store.put_image(layers)
    sb = provider.create(SandboxSpec(image=image.id, limits=SMALL))
    try:
        r = sb.exec("ls layer*.txt | wc -l; cat layer000.txt layer119.txt pkg/__init__.py")
        assert r.stdout == "120\n0119VALUE = 41\n", r
    finally:
        sb.destroy()


def test_host_file_calls_serve_only_the_sandboxs_own_files(sandbox):
    """The host-side calls act as the sandbox user would, on the sandbox's own file systems:
    a symlink the sandbox planted leads nowhere it could not write itself, and never into its
    kernel's file systems (/proc/sys is the host's kernel's); devices and FIFOs are refused
    instead of read forever; init carries none of the host's environment."""
    before = sandbox.exec("cat /etc/hostname").stdout
    sandbox.exec("ln -s /etc/hostname h && ln -s /proc/sys/kernel/core_pattern core "
                 "&& ln -s /proc/sys/kernel k && mkfifo fifo && ln -s own.txt alias")
    with pytest.raises(SandboxError, match="permission denied"):
        sandbox.write_file("h", "evil")  # a root-owned file of the image, through a link
    assert sandbox.exec("cat /etc/hostname").stdout == before
    for path in ("core", "k/core_pattern", "/proc/sys/kernel/core_pattern"):
        with pytest.raises(SandboxError, match="kernel file system"):
            sandbox.read_file(path)
        with pytest.raises(SandboxError, match="kernel file system"):
            sandbox.write_file(path, "|/tmp/x")
    for path in ("/dev/zero", "fifo"):
        with pytest.raises(SandboxError, match="kernel file system|not a regular file"):
            sandbox.read_file(path)
    with pytest.raises(SandboxError, match="not a regular file"):
        sandbox.write_file("fifo", "x")
    with pytest.raises(SandboxError, match="kernel file system"):
        sandbox.list_dir("/proc/1")
    with pytest.raises(SandboxError, match="not readable"):
        sandbox.list_dir("/root")
    sandbox.write_file("alias", "through a link of its own")  # where the sandbox may write
    assert sandbox.read_file("own.txt") == b"through a link of its own"
    assert sandbox.exec("readlink alias").stdout == "own.txt\n"
    init_env = open(f"/proc/{sandbox.init_pid}/environ", "rb").read().split(b"\0")
    assert [e for e in init_env if e and not e.startswith(b"PATH=")] == []


class _Recorder:
    """An egress attachment that records its calls and hands the sandbox files to place."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files, self.calls = files, []

    def attach(self, sandbox_id: str, netns_pid: int) -> EgressBinding:
        self.calls.append("attach")
        return EgressBinding(env={"HTTPS_PROXY": "http://10.0.0.1:1"}, files=self.files)

    def detach(self, sandbox_id: str) -> None:
        self.calls.append("detach")


def test_egress_files_replace_a_link_and_a_failed_attachment_is_undone(provider, project):
    """The binding's files replace what lies there without following it (a resolv.conf that
    links to the host's systemd, which does not exist inside); a sandbox whose files cannot be
    placed is not created, and its attachment is undone."""
    ok = _Recorder({"/etc/resolv.conf": b"nameserver 10.0.0.1\n"})
    sb = provider.create(SandboxSpec(image=project, limits=SMALL, egress=ok))
    try:
        assert sb.read_file("/etc/resolv.conf") == b"nameserver 10.0.0.1\n"
        sb.exec("ln -s ../run/nowhere/stub-resolv.conf /tmp/r")  # dangling, as on systemd hosts
        sb._write_as_root("/tmp/r", b"nameserver 10.0.0.1\n")
        assert sb.exec("test -L /tmp/r || cat /tmp/r").stdout == "nameserver 10.0.0.1\n"
    finally:
        sb.destroy()
    assert ok.calls == ["attach", "detach"]
    bad = _Recorder({"/proc/sys/kernel/nope": b"x"})  # a place no file can go
    with pytest.raises(SandboxError):
        provider.create(SandboxSpec(image=project, limits=SMALL, egress=bad))
    assert bad.calls == ["attach", "detach"]


def test_a_binding_env_no_command_could_take_is_refused_at_attach(provider, project):
    """An egress binding's variables are checked once, as it is attached: a bad one refuses
    the sandbox (naming the variable), and the attachment is undone."""
    class BadEnv(_Recorder):
        def attach(self, sandbox_id: str, netns_pid: int) -> EgressBinding:
            super().attach(sandbox_id, netns_pid)
            return EgressBinding(env={"BAD=NAME": "1"})

    bad = BadEnv({})
    with pytest.raises(SandboxError, match="egress env: invalid variable 'BAD=NAME'"):
        provider.create(SandboxSpec(image=project, limits=SMALL, egress=bad))
    assert bad.calls == ["attach", "detach"]


def test_a_snapshot_copies_only_once_every_task_has_stopped(sandbox, monkeypatch):
    """The kernel freezes a cgroup asynchronously: the freeze returns once every task is
    stopped; one that never completes fails the snapshot and leaves the sandbox running."""
    sandbox.exec("(while true; do echo x >> busy.log; done) >/dev/null 2>&1 &")
    # (the writer's first line, which a loaded machine may be slow to run)
    assert sandbox.exec("until test -s busy.log; do sleep 0.01; done", timeout=20).exit_code == 0
    sandbox.write_file("state.txt", "s")
    cg = sandbox.cgroup
    cg.freeze(True)
    try:
        assert cg._frozen()
        size = sandbox.stat("busy.log").size
        time.sleep(0.05)
        assert sandbox.stat("busy.log").size == size  # nothing runs while frozen
    finally:
        cg.freeze(False)
    from codedojo.sandbox import cgroups

    monkeypatch.setattr(type(cg), "_frozen", lambda self: False)
    monkeypatch.setattr(cgroups, "FREEZE_TIMEOUT_S", 0.2)
    with pytest.raises(TimeoutError, match="did not all stop"):
        sandbox.snapshot()
    assert sandbox.exec("echo alive").stdout == "alive\n"  # thawed


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1, True, "5"])
def test_a_time_limit_that_is_no_finite_positive_number_is_refused(sandbox, timeout):
    """A NaN deadline is never passed: such a command ran for as long as it liked."""
    with pytest.raises(SandboxError, match="timeout: must be a finite number of seconds > 0"):
        sandbox.exec("true", timeout=timeout)
    with pytest.raises(SandboxError, match="timeout: must be a finite number of seconds > 0"):
        sandbox.shell().run("true", timeout=timeout)
    assert sandbox.exec("true", timeout=5).exit_code == 0


def test_a_sparse_file_stays_sparse_on_the_host_and_is_not_read_whole(sandbox, provider):
    """A file of the writable layer with more holes than the sandbox's disk is refused by
    read_file, where the host would have held all of it in memory; a snapshot copies its
    data, not its holes; and a setuid program is not put on the host's disk by a snapshot."""
    sandbox.exec("truncate -s 1G big && printf x | dd of=big bs=1 seek=4096 conv=notrunc "
                 "2>/dev/null && cp /bin/true suid && chmod 4755 suid")
    with pytest.raises(SandboxError, match="big holds 1073741824 bytes, more than the "
                                           "sandbox's disk"):
        sandbox.read_file("big")
    sandbox.exec("head -c 5000 /dev/zero > mid && ln -s mid link")
    for name in ("mid", "link"):  # a limit asked for is held before the file is read
        with pytest.raises(FileTooLarge, match=f"{name} holds 5000 bytes, more than the 4999"):
            sandbox.read_file(name, max_bytes=4999)
    assert sandbox.read_file("link", max_bytes=5000) == bytes(5000)
    snap = sandbox.snapshot()
    layer = provider.images.layer_path(provider.images.resolve(snap).layers[0])
    st = os.stat(os.path.join(layer, "workspace", "big"))
    assert st.st_size == 1 << 30 and st.st_blocks * 512 < 1 << 20
    # a sandbox made from the snapshot has the holes in its image: read_original refuses them
    child = provider.create(SandboxSpec(image=snap, limits=sandbox.spec.limits))
    try:
        with pytest.raises(SandboxError, match="big holds 1073741824 bytes, more than the "):
            child.read_original("big")
    finally:
        child.destroy()
    with open(os.path.join(layer, "workspace", "big"), "rb") as f:
        f.seek(4096)
        assert f.read(1) == b"x"
    assert os.stat(os.path.join(layer, "workspace", "suid")).st_mode & 0o7777 == 0o755
    assert sandbox.exec("test -x suid && ./suid").exit_code == 0


def test_a_shell_command_s_output_is_kept_to_the_cap_and_the_shell_goes_on(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=Limits(max_output_bytes=1000)))
    try:
        sh = sb.shell()
        sh.run("cd /tmp && export K=v")
        r = sh.run("head -c 3000000 /dev/zero | tr '\\0' a; echo END; echo tail >&2; "
                   "exit_code() { :; }; false")
        assert (r.exit_code, r.truncated, r.timed_out) == (1, True, False)
        cut = "\n[... 2999004 bytes cut by the sandbox ...]\n"
        assert r.stdout == "a" * 500 + cut + "a" * 496 + "END\n" and r.stderr == "tail\n"
        assert sh.run("pwd; echo $K").stdout == "/tmp\nv\n"  # the same shell
    finally:
        sb.destroy()


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_the_shell_s_marker_is_found_across_reads(piece):
    """In reads of any size, the marker is found where it starts, the output before it kept
    to the cap (its start and its end), and nothing looked for twice."""
    from codedojo.sandbox.local import _MarkerScan

    marker = b"\x1e__mark__"
    stream = b"a" * 25 + b"z" * 25 + marker + b"0\n"
    scan = _MarkerScan(marker, cap=20)
    for i in range(0, len(stream), piece):
        scan.feed(stream[i:i + piece])
    assert scan.found is not None and scan.kept.total == 50
    cut = b"\n[... 30 bytes cut by the sandbox ...]\n"
    assert scan.output() == b"a" * 10 + cut + b"z" * 10 + marker + b"0\n"
    whole = _MarkerScan(marker, cap=100)
    whole.feed(stream)
    assert whole.output() == stream


def test_what_follows_the_shell_s_status_is_not_kept():
    """Bytes after the marker and its status were written once the command had ended (by a
    process it left in the background): they are not kept, however many come."""
    from codedojo.sandbox.local import _MarkerScan

    marker = b"\x1e__mark__"
    scan = _MarkerScan(marker, cap=20)
    scan.feed(b"out" + marker + b"0\n" + b"y" * 100)
    for _ in range(100):
        scan.feed(b"y" * 4096)
    out = scan.output()
    assert out.startswith(b"out" + marker + b"0\n") and len(out) < 100


def test_a_command_that_moves_the_shell_s_stdout_or_stderr_leaves_the_shell_working(sandbox):
    """The end of each command is marked on the shell's own pipes: `exec 2>&1` or
    `exec >/dev/null` change where the next commands write, not whether their end is seen."""
    sh = sandbox.shell()
    sh.run("cd /tmp; export K=v")
    r = sh.run("exec 2>&1; echo hi; echo err >&2", timeout=10)
    assert (r.exit_code, r.timed_out, r.stdout, r.stderr) == (0, False, "hi\nerr\n", "")
    assert sh.run("pwd; echo $K >&2").stdout == "/tmp\nv\n"  # the same shell
    r = sh.run("exec >/dev/null; echo gone; false", timeout=10)
    assert (r.exit_code, r.timed_out, r.stdout) == (1, False, "")


def test_a_shell_s_background_writer_neither_holds_the_call_nor_passes_the_cap(provider,
                                                                               project):
    """A writer the command left behind, with the shell's stderr gone to /dev/null: the call
    ends with the command, its output within the cap, and the shell goes on."""
    sb = provider.create(SandboxSpec(image=project, limits=Limits(max_output_bytes=1000,
                                                                  disk_mb=16)))
    try:
        sh = sb.shell()
        sh.run("export K=v")
        r = sh.run("exec 2>/dev/null; echo hi; (head -c 3000000 /dev/zero | tr '\\0' a &)",
                   timeout=10)
        assert (r.exit_code, r.timed_out) == (0, False) and r.stdout.startswith("hi\n")
        assert len(r.stdout) <= 1000 + len("\n[... 3000000 bytes cut by the sandbox ...]\n")
        assert sh.run('test "$K" = v', timeout=10).exit_code == 0  # the same shell
    finally:
        sb.destroy()


def test_a_shell_used_after_a_restore_is_closed_with_the_sandbox(provider, project):
    """A restore closes every shell; one used again starts a fresh bash, which the sandbox's
    destroy closes (its pipes and connection are not left open in the host)."""
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))
    try:
        snap = sb.snapshot()
        sh = sb.shell()
        sh.run("cd /tmp")
        sb.restore(snap)
        assert sh.run("pwd").stdout == "/workspace\n"  # a fresh shell
        proc = sh._proc
        assert proc is not None
    finally:
        sb.destroy()
    assert sh._proc is None and proc.conn.fileno() == -1


def test_file_calls_during_restores_resolve_in_the_sandbox_s_own_tree(provider, tmp_path):
    """File calls while another thread restores (two requests to the service): a restore
    closes the root they resolve paths in and replaces init, whose fd number and pid may then
    name something else. Each call waits for the restore or finishes in the tree it began in;
    after a destroy it is refused as such."""
    (tmp_path / "whoami").write_text("X")
    image = provider.images.from_directory(str(tmp_path))
    sb = provider.create(SandboxSpec(image=image.id, limits=SMALL))
    try:
        snap = sb.snapshot()
        done = threading.Event()

        def restore() -> None:
            try:
                for _ in range(15):
                    sb.restore(snap)
            finally:
                done.set()

        restorer = threading.Thread(target=restore)
        restorer.start()
        seen = set()
        while not done.is_set():
            for call in (lambda: sb.read_file("whoami"), lambda: sb.stat("whoami").size,
                         lambda: [f.path for f in sb.list_dir()]):
                try:
                    seen.add(repr(call()))
                except SandboxError as e:
                    seen.add(f"{type(e).__name__}: {e}")
        restorer.join()
        assert seen <= {"b'X'", "1", "['/workspace/whoami']"}, seen
    finally:
        sb.destroy()
    with pytest.raises(NotFound, match="was destroyed"):
        sb.read_file("whoami")


def test_a_path_deeper_than_python_s_stack_and_stdin_utf8_cannot_carry(sandbox):
    """Parents of a path 1200 directories deep are made one by one (not by recursion); a
    str stdin that UTF-8 cannot carry is refused by name."""
    deep = "d/" * 1200 + "f"
    sandbox.write_file(deep, "x")
    assert sandbox.read_file(deep) == b"x"
    assert sandbox.exec(["stat", "-c", "%U", deep]).stdout == "user\n"
    with pytest.raises(SandboxError, match="stdin: not text that UTF-8 can carry"):
        sandbox.exec("cat", stdin="\udce9")


def test_a_file_of_the_image_bigger_than_the_sandbox_s_disk_is_read(provider, tmp_path):
    """The disk limit bounds the writable layer, not the image: an image's file bigger than
    that disk is read (by read_file and read_original) like any other, within max_bytes."""
    data = os.urandom(3 << 20)
    (tmp_path / "big.bin").write_bytes(data)
    image = provider.images.from_directory(str(tmp_path))
    sb = provider.create(SandboxSpec(image=image.id, limits=Limits(disk_mb=2)))
    try:
        assert sb.read_file("big.bin") == data
        assert sb.read_original("big.bin") == data
        with pytest.raises(FileTooLarge, match="big.bin holds 3145728 bytes"):
            sb.read_file("big.bin", max_bytes=1 << 20)
        # the image's side, as the rewards read it: refused before it is read
        sb.remove("big.bin")
        with pytest.raises(FileTooLarge, match="big.bin holds 3145728 bytes, more than the 1048"):
            sb.read_original("big.bin", max_bytes=1 << 20)
        assert sb.read_original("big.bin", max_bytes=3 << 20) == data
        with pytest.raises(SandboxError, match="max_bytes: a count of bytes >= 0 expected"):
            sb.read_original("big.bin", max_bytes=-1)
    finally:
        sb.destroy()


def test_a_fork_that_fails_removes_the_snapshot_it_took(sandbox, provider, monkeypatch):
    """A fork(n) that cannot make all n destroys those made and the snapshot it took, which no
    caller could know of; a snapshot that was already there (taken by the caller, of the
    same layers) is kept."""
    real, made = provider._create, []

    def third_fails(*args, **kw):
        made.append(1)
        if len(made) == 3:
            raise SandboxError("out of pids")
        return real(*args, **kw)

    def images() -> set[str]:
        return {doc["id"] for doc in provider.images.list()}

    sandbox.write_file("step", uuid.uuid4().hex)
    before = images()
    monkeypatch.setattr(provider, "_create", third_fails)
    with pytest.raises(SandboxError, match="out of pids"):
        sandbox.fork(4)
    assert images() == before and provider.list() == [sandbox]
    kept = sandbox.snapshot()
    made.clear()
    with pytest.raises(SandboxError, match="out of pids"):
        sandbox.fork(4)
    assert images() == before | {kept}
    provider.images.remove(kept)


def test_a_file_call_that_cannot_read_init_s_mount_table_says_so_and_keeps_no_fd(
        provider, sandbox, monkeypatch):
    sandbox.read_file("README.md")
    before = fds_under(provider.root)
    monkeypatch.setattr(sandbox, "_kernel_devs", None)
    monkeypatch.setattr(sandbox, "init_pid", 4194311)  # (no such process)
    for _ in range(3):
        with pytest.raises(SandboxError, match="its mount table cannot be read"):
            sandbox.read_file("README.md")
    assert fds_under(provider.root) == before


def test_commands_get_the_open_files_limit_not_the_provider_s(provider, project):
    """`Limits.open_files` is every command's RLIMIT_NOFILE (soft = hard, no raising it), in a
    sandbox from the pool, one started directly and after a restore; not the provider's own,
    raised for many sandboxes. A limit no command could be given is refused at create."""
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 4096 or pytest.skip(
        "the provider's own limit is no higher than the default")
    direct = local.LocalProvider(root=provider.root, pool_size=0)
    sbs = [provider.create(SandboxSpec(image=project, limits=SMALL)),
           provider.create(SandboxSpec(image=project, limits=replace(SMALL, open_files=256))),
           direct.create(SandboxSpec(image=project, limits=replace(SMALL, open_files=300)))]
    try:
        sbs[1].restore(sbs[1].snapshot())
        got = [sb.exec("ulimit -n; ulimit -Hn; ulimit -n 5000 2>/dev/null || echo fixed").stdout
               for sb in sbs]
        assert got == ["4096\n4096\nfixed\n", "256\n256\nfixed\n", "300\n300\nfixed\n"]
    finally:
        for sb in sbs:
            sb.destroy()
    # (below 200, the shell's own fds 198 and 199 could not be: every shell call failed)
    for bad in (8, 199, 1 << 30, True):
        with pytest.raises(SandboxError, match="limits.open_files: must be an integer"):
            provider.create(SandboxSpec(image=project, limits=Limits(open_files=bad)))


def test_the_default_open_files_limit_is_the_hosts_hard_limit_where_that_is_lower(
        provider, project, monkeypatch):
    """A service started under `ulimit -n 1024` (its hard limit too) creates sandboxes of the
    default limits, whose commands get 1024; a limit past it is refused by name."""
    monkeypatch.setattr(local, "_hard_nofile", lambda: 1024)
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))
    try:
        assert sb.exec("ulimit -n").stdout == "1024\n"
        assert sb.shell().run("ulimit -Hn").stdout == "1024\n"
    finally:
        sb.destroy()
    with pytest.raises(SandboxError, match=r"limits.open_files: must be an integer in "
                                           r"\[200, 1024\], got 4096"):
        provider.create(SandboxSpec(image=project, limits=replace(SMALL, open_files=4096)))


def test_a_store_whose_path_has_a_space_keeps_one_tmpfs_and_its_sandboxes(tmp_path):
    """The mount table escapes a space or a tab (and newline, backslash) in a mount point: a
    second provider on the store (the CLI's gc beside the service) finds its tmpfs mounted and
    leaves the first's live sandboxes alone; remove_store leaves nothing mounted."""
    root = str(tmp_path / "a store\twith a tab")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.txt").write_text("f\n")
    first = local.LocalProvider(root=root, pool_size=0)
    try:
        image = first.images.from_directory(str(tmp_path / "src")).id
        sb = first.create(SandboxSpec(image=image, limits=SMALL))
        second = local.LocalProvider(root=root, pool_size=0)
        assert second.gc() == []
        assert sb.exec("cat f.txt").stdout == "f\n"
        assert local._mount_points().count(os.path.join(first.root, "sandboxes")) == 1
        sb.destroy()
    finally:
        first.remove_store()
    assert local._mounts_under(first.root) == []
    assert not os.path.exists(root)


def test_a_write_that_does_not_fit_leaves_no_file_and_remove_lists_as_the_user_would(
        provider, project):
    """A new file the disk has no room for is not left behind (empty, and root's: no write
    could replace it); `remove` empties only directories the user may list, as `rm -rf`."""
    sb = provider.create(SandboxSpec(image=project, limits=replace(SMALL, disk_mb=2)))
    try:
        with pytest.raises(SandboxError, match="disk limit"):
            sb.write_file("/workspace/big", b"x" * (3 << 20))
        assert sb.exec("ls -A /workspace/big").exit_code != 0
        sb.write_file("/workspace/big", b"small")
        assert sb.exec("cat /workspace/big").stdout == "small"
        sb.exec("mkdir -p /workspace/shut/in && chmod 000 /workspace/shut", timeout=30)
        assert sb.exec("rm -rf /workspace/shut").exit_code != 0
        with pytest.raises(SandboxError, match="may not list it"):
            sb.remove("/workspace/shut")
        assert sb.exec("chmod 755 /workspace/shut && ls /workspace/shut").stdout == "in\n"
        sb.exec("mkdir /workspace/empty && chmod 000 /workspace/empty", timeout=30)
        sb.remove("/workspace/empty")  # (empty: `rm -rf` takes it, unlisted)
        assert sb.exec("ls -d /workspace/empty").exit_code != 0
    finally:
        sb.destroy()
