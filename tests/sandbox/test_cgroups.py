"""Where v2 sandbox cgroups go, on a real cgroup2 hierarchy mounted for the test. On a host
whose memory, pids and cpu controllers sit on v1 hierarchies (as here), the v2 one offers
only the controllers no v1 hierarchy holds (hugetlb); the kernel's rule is the same for
every controller: a cgroup that holds processes cannot pass controllers to its children."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from codedojo.sandbox import cgroups


@pytest.fixture
def v2(tmp_path, monkeypatch):
    """A cgroup2 mount whose hugetlb stands in for the sandbox controllers, and a process in
    `/slice/own`, this process's cgroup as the manager will read it."""
    mnt = tmp_path / "cg2"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "cgroup2", "none", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a cgroup2 hierarchy (not root, or no cgroup2)")
    sleeper = None
    try:
        if "hugetlb" not in (mnt / "cgroup.controllers").read_text().split():
            pytest.skip("no controller free for a cgroup2 mount on this host")
        _disable_at_root(mnt)  # the hierarchy is the host's: start as a host without it
        (mnt / "slice" / "own").mkdir(parents=True)
        sleeper = subprocess.Popen(["sleep", "600"])
        (mnt / "slice" / "own" / "cgroup.procs").write_text(str(sleeper.pid))
        monkeypatch.setattr(cgroups, "CGROUP_FS", str(mnt))
        monkeypatch.setattr(cgroups, "V2_CONTROLLERS", ("hugetlb",))
        monkeypatch.setattr(cgroups, "is_v2", lambda: True)
        monkeypatch.setattr(cgroups, "_own_cgroups", lambda: {"": "/slice/own"})
        yield mnt
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        for d, _, _ in sorted(os.walk(mnt), key=lambda w: -len(w[0])):
            if d != str(mnt):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
        _disable_at_root(mnt)
        subprocess.run(["umount", str(mnt)], check=True)


def _disable_at_root(mnt):
    with contextlib.suppress(OSError):
        (mnt / "cgroup.subtree_control").write_text("-hugetlb")


def test_v2_sandbox_cgroups_go_beside_a_cgroup_that_holds_processes(v2):
    manager = cgroups.CgroupManager()
    base = v2 / "slice" / "codedojo"  # `own` holds a process: its children get no controller
    assert manager.bases == {"v2": str(base)}
    assert (base / "cgroup.subtree_control").read_text().split() == ["hugetlb"]
    assert not (v2 / "slice" / "own" / "codedojo").exists()  # never tried
    (base / "sb").mkdir()
    assert "hugetlb" in (base / "sb" / "cgroup.controllers").read_text().split()


def test_v2_sandbox_cgroups_say_why_when_no_cgroup_can_have_the_controllers(v2, monkeypatch):
    real = cgroups._write

    def root_holds_processes(path, value):  # as a container's namespace root does
        if path == os.path.join(cgroups.CGROUP_FS, "cgroup.subtree_control"):
            raise OSError(16, "Device or resource busy")
        real(path, value)

    monkeypatch.setattr(cgroups, "_write", root_holds_processes)
    with pytest.raises(OSError, match=r"no cgroup where sandboxes can have the hugetlb "
                                      r"controllers .*hugetlb in .*cg2: Device or resource busy"):
        cgroups.CgroupManager()
