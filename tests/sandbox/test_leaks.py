"""200 create/destroy cycles (with work in between) leave nothing behind: no process, mount,
cgroup or directory, checked through /proc, /proc/mounts and the cgroup filesystem."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from codedojo.sandbox.base import SandboxSpec
from tests.sandbox.conftest import SMALL


def _pids() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def _mounts(root: str) -> list[str]:
    """Mounts of sandboxes (the store's own tmpfs for sandbox directories stays)."""
    with open("/proc/mounts") as f:
        return [m for m in (line.split()[1] for line in f) if m.startswith(root + "/sandboxes/")]


def _cgroups(provider) -> list[str]:
    return [d for d in provider.cgroups.existing() if d.startswith(provider._tag)]


def test_200_cycles_leave_nothing(provider, project):
    sdir = os.path.join(provider.root, "sandboxes")
    provider.drain_pool()  # pooled sandboxes are counted at the end, after draining
    before_pids = _pids()
    before_mounts = _mounts(provider.root)
    assert before_mounts == [] and os.listdir(sdir) == [] and _cgroups(provider) == []
    for i in range(200):
        sb = provider.create(SandboxSpec(image=project, limits=SMALL))
        if i % 20 == 0:
            # every so often: work that starts processes, a shell, a snapshot and a fork
            sb.exec("sleep 100 & setsid sleep 100 >/dev/null 2>&1 &")
            sb.shell().run("cd /tmp")
            fork = sb.fork(1)[0]
            fork.destroy()
        sb.destroy()
    provider.drain_pool()
    assert _mounts(provider.root) == []
    assert os.listdir(sdir) == []
    assert _cgroups(provider) == []
    leaked = {p for p in _pids() - before_pids if os.path.exists(f"/proc/{p}")}
    # only processes outside the sandboxes may have come and gone meanwhile (other tests' work
    # is not running); none of ours may be a child of this process
    ours = [p for p in leaked if _ppid(p) == os.getpid()]
    assert ours == []
    # (other processes on the machine may run their own sandboxes from other stores)
    assert [p for p in leaked if provider.root + "/" in _cmdline(p)] == []


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_gc_cleans_up_after_a_crashed_owner(provider, project):
    """A process that dies without destroying its sandbox (kill -9 of the service) leaves
    processes, mounts, a cgroup and a directory; gc removes all of them."""
    code = (
        "import os, sys\n"
        "from codedojo.sandbox.local import LocalProvider\n"
        "from codedojo.sandbox.base import SandboxSpec\n"
        f"p = LocalProvider(root={provider.root!r}, pool_size=0)\n"
        f"sb = p.create(SandboxSpec(image={project!r}))\n"
        "sb.exec('setsid sleep 1000 >/dev/null 2>&1 &')\n"
        "print(sb.id, sb.init_pid, flush=True)\n"
        "os._exit(0)  # no cleanup at all, as in a crash\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    sid, init_pid = out.stdout.split()
    assert os.path.exists(f"/proc/{init_pid}")
    assert any(sid in m for m in _mounts(provider.root))
    assert provider.gc() == [sid]
    assert not any(sid in m for m in _mounts(provider.root))
    assert not os.path.exists(os.path.join(provider.root, "sandboxes", sid))
    assert not any(sid in name for name in provider.cgroups.existing())
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{init_pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/{init_pid}")


def test_gc_cleans_up_a_destroy_that_failed_in_this_process(provider, project, monkeypatch):
    """A teardown step that fails leaves what depends on it behind (the directory: never
    removed through a mount that may still be there); the owner is alive (this process), and
    gc still cleans it, and nothing of a live sandbox."""
    live = provider.create(SandboxSpec(image=project, limits=SMALL))
    sb = provider.create(SandboxSpec(image=project, limits=SMALL))

    def fail() -> None:
        raise OSError("unmount failed")

    monkeypatch.setattr(sb, "_unmount_fs", fail)
    with pytest.raises(OSError, match="unmount failed"):
        sb.destroy()
    assert os.path.isdir(os.path.join(provider.root, "sandboxes", sb.id))
    assert provider.gc() == [sb.id]
    assert not any(sb.id in m for m in _mounts(provider.root))
    assert not os.path.exists(os.path.join(provider.root, "sandboxes", sb.id))
    assert not any(sb.id in name for name in provider.cgroups.existing())
    assert live.exec("echo alive").stdout == "alive\n"
    assert provider.gc() == []
    live.destroy()


def test_a_store_removed_leaves_no_mount_process_cgroup_or_file(tmp_path):
    """`remove_store` takes a store made for one run away whole: deleting its folder alone
    left the tmpfs of its sandbox directories mounted, one per test session or benchmark."""
    from codedojo.sandbox.local import LocalProvider

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("A = 1\n")
    root = str(tmp_path / "store")
    p = LocalProvider(root=root, pool_size=0)
    sb = p.create(SandboxSpec(image=p.images.from_directory(str(tmp_path / "src")).id,
                              limits=SMALL))
    sb.exec("sleep 100 &")
    init, tag = sb.init_pid, p._tag
    assert any(m == root + "/sandboxes" for m in _all_mounts())
    p.remove_store()
    assert not os.path.exists(root)
    assert [m for m in _all_mounts() if m.startswith(root + "/") or m == root] == []
    assert not os.path.exists(f"/proc/{init}") or _zombie(init)
    assert [d for d in p.cgroups.existing() if d.startswith(tag)] == []


def _all_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f]


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
