"""Many sandboxes in one process: a destroy costs the same however many live, a teardown that
fails leaves nothing gc misses, a pooled sandbox that died is not handed out, and running out
of file descriptors is refused up front or named plainly."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import time

import pytest

from codedojo.sandbox import local
from codedojo.sandbox.base import SandboxSpec
from codedojo.sandbox.local import LocalProvider, LocalSandbox
from codedojo.sandbox.service import FD_HEADROOM, FDS_PER_SANDBOX, ServiceConfig, admission_check
from tests.sandbox.conftest import SMALL


@contextlib.contextmanager
def soft_fd_limit(soft: int):
    """This process's soft RLIMIT_NOFILE set to ``soft`` for the block."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # (not the one the listing used)


def _limit_leaving(room: int) -> int:
    """A soft RLIMIT_NOFILE under which this process can open ``room`` more fds: the limit
    bounds fd numbers, and a new fd takes the lowest free one (a long session's closed fds
    leave holes below its highest)."""
    fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        taken = {int(n) for n in os.listdir(fd)} - {fd}
    finally:
        os.close(fd)
    free = (n for n in range(len(taken) + room + 1) if n not in taken)
    for _ in range(room - 1):
        next(free)
    return next(free) + 1


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _full_pool(provider, n: int) -> list[LocalSandbox]:
    """The pool once it holds ``n`` sandboxes."""
    blank = provider._take_blank()  # (starts the filler, should it not run yet)
    if blank is not None:
        blank._teardown(keep_dir=False)
    deadline = time.monotonic() + 60
    while len(provider._pool) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(provider._pool) >= n
    return list(provider._pool)


def test_a_destroy_reads_no_mount_table(provider, project, monkeypatch):
    """The host's mount table grows with every live sandbox: a destroy that read it would cost
    more the more there are. A pooled sandbox's self-bind is still undone."""
    _full_pool(provider, 1)
    pooled = provider.create(SandboxSpec(image=project, limits=SMALL))
    with open("/proc/self/mountinfo") as f:
        assert pooled.dir in [line.split()[4] for line in f]  # its self-bind
    monkeypatch.setattr(provider, "pool_size", 0)
    direct = provider.create(SandboxSpec(image=project, limits=SMALL))

    def no_scan(prefix: str) -> list[str]:
        raise AssertionError("the mount table was read")

    monkeypatch.setattr(local, "_mounts_under", no_scan)
    for sb in (pooled, direct):
        sb.destroy()
        assert not os.path.exists(sb.dir)
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if pooled.id in line or direct.id in line]


def test_a_create_that_fails_with_the_fd_table_full_leaves_nothing_gc_misses(
        provider, project, monkeypatch):
    """Commands running meanwhile hold every fd left: the create fails, and its teardown with
    it (no directory is removed without an fd). The failure says what ran out; what is left
    is logged and gc's, though this process lives on."""
    provider.drain_pool()  # (no pooled sandbox is being made meanwhile)
    monkeypatch.setattr(provider, "pool_size", 0)
    hog: list[int] = []

    def start_init(self, *args, **kwargs) -> None:
        assert not hog
        with contextlib.suppress(OSError):
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(LocalSandbox, "_start_init", start_init)
    sdir = os.path.join(provider.root, "sandboxes")
    before = set(os.listdir(sdir))
    try:
        with soft_fd_limit(_open_fds() + 64), pytest.raises(OSError, match="out of file desc"):
            provider.create(SandboxSpec(image=project, limits=SMALL))
    finally:
        for fd in hog:
            os.close(fd)
    left = set(os.listdir(sdir)) - before
    assert len(left) == 1 and left <= provider._unfinished
    (sid,) = left
    assert sid in provider.gc()
    assert not os.path.exists(os.path.join(sdir, sid))
    assert not any(sid in name for name in provider.cgroups.existing())
    with open("/proc/self/mountinfo") as f:
        assert sid not in f.read()


def test_a_pooled_sandbox_whose_init_died_is_not_handed_out(provider, project, monkeypatch):
    """Its init killed while it waited (the OOM killer) or while it is claimed: the fork goes
    on with the next one, or the direct path, and the dead one is torn down."""
    parent = provider.create(SandboxSpec(image=project, limits=SMALL))
    try:
        snap = parent.snapshot()
        dead = _full_pool(provider, provider.pool_size)
        for blank in dead:
            os.kill(blank.init_pid, signal.SIGKILL)
        while not all(_gone(b.init_pid) for b in dead):
            time.sleep(0.01)
        forks = parent.fork(2, snap)
        assert [f.exec("echo ok").stdout for f in forks] == ["ok\n", "ok\n"]
        for f in forks:
            f.destroy()
        assert not any(os.path.exists(b.dir) for b in dead)

        # dead only once taken from the pool: its claim finds it so
        victim = _full_pool(provider, 1)[-1]
        os.kill(victim.init_pid, signal.SIGKILL)
        while not _gone(victim.init_pid):
            time.sleep(0.01)

        def take_victim() -> LocalSandbox:
            monkeypatch.undo()
            with provider._pool_cv:
                provider._pool.remove(victim)
            return victim

        monkeypatch.setattr(provider, "_take_blank", take_victim)
        (f,) = parent.fork(1, snap)
        assert f is not victim and f.exec("echo ok").stdout == "ok\n"
        f.destroy()
        assert not os.path.exists(victim.dir)
    finally:
        parent.destroy()


def test_a_command_whose_pipes_find_no_room_is_named_and_killed(sandbox, provider, monkeypatch):
    """Room for the connection to init but not for the three pipes it sends back: the kernel
    drops them; the error says the host is out of file descriptors, and the command ends."""
    provider.drain_pool()  # (no pooled sandbox is being made meanwhile)
    monkeypatch.setattr(provider, "pool_size", 0)
    sandbox.exec("true")
    with soft_fd_limit(_limit_leaving(1)), pytest.raises(OSError) as caught:
        sandbox.exec("sleep 0.3; touch /workspace/ran")
    assert caught.value.errno == errno.EMFILE
    assert "out of file descriptors" in str(caught.value) and "RLIMIT_NOFILE" in str(caught.value)
    time.sleep(0.6)
    assert sandbox.exec("test -e /workspace/ran").exit_code == 1
    assert sandbox.exec("echo fine").stdout == "fine\n"


def test_a_full_fd_table_is_told_apart_by_its_errno_and_type():
    """EMFILE met in a block is named, with what it stopped, whatever its own text says (here
    a path that reads like the named error); one named already, deeper in, is left as it is."""
    with pytest.raises(OSError, match="no sandbox can be started") as caught:
        with local._fd_exhaustion_named("no sandbox can be started"):
            raise OSError(errno.EMFILE, "Too many open files", "/store/out of file descriptors")
    assert caught.value.errno == errno.EMFILE and "RLIMIT_NOFILE" in str(caught.value)
    with pytest.raises(OSError, match="its pipes") as caught:
        with local._fd_exhaustion_named("no command can be started"):
            raise local._out_of_fds("its pipes")
    assert "no command can be started" not in str(caught.value)
    with pytest.raises(OSError) as caught:
        with local._fd_exhaustion_named("no command can be started"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.errno == errno.ENOSPC and "file descriptors" not in str(caught.value)


def test_a_provider_raises_the_soft_fd_limit_to_the_hard_one(provider, monkeypatch):
    """A live sandbox holds two fds: the usual soft limit of 1024 would cap a provider at a
    few hundred."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    monkeypatch.setattr(local, "_nofile_raised", False, raising=False)
    with soft_fd_limit(min(1024, hard)):
        LocalProvider(root=provider.root, pool_size=0)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard


def test_admission_refuses_what_the_fd_limit_cannot_hold(provider):
    config = ServiceConfig(max_sandboxes=1 << 20, max_memory_percent=100.0,
                           max_disk_percent=100.0, max_load_per_cpu=1e9)
    with soft_fd_limit(_open_fds() + 10 + FD_HEADROOM + FDS_PER_SANDBOX * 100):
        assert admission_check(config, provider, 10) is None
        reason = admission_check(config, provider, 200)
        assert reason is not None and reason.startswith("file descriptors:")
        assert "RLIMIT_NOFILE" in reason
        assert admission_check(config, provider, 10, reserved=190) is not None


def test_gc_leaves_a_sandbox_the_pool_is_starting(provider, monkeypatch):
    """The pool's thread makes a blank's directory before it writes its state: a `gc` run in
    between (by another thread of the process) must not take it for a leftover."""
    import threading

    provider.drain_pool()
    started, go = threading.Event(), threading.Event()
    real = provider.cgroups.create

    def slow_cgroup(*args, **kwargs):
        started.set()  # (its directory is there, its state not yet)
        go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(provider.cgroups, "create", slow_cgroup)
    blank = provider._take_blank()  # (starts the filler)
    assert blank is None
    assert started.wait(60)
    try:
        assert provider.gc() == []
    finally:
        go.set()
    pooled = _full_pool(provider, 1)
    assert pooled[0]._init_alive() and os.path.isdir(pooled[0].dir)
