"""Each test is an attack from inside a sandbox that must fail, and the host must be unharmed."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest

from codedojo.sandbox.base import Limits, SandboxError, SandboxSpec


def _host_pids_with(arg: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if arg.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_cannot_write_outside(sandbox):
    marker = f"/tmp/codedojo-escape-{uuid.uuid4().hex}"
    r = sandbox.exec(f"echo x > /usr/bin/evil; echo x > /etc/evil; echo x > {marker}; "
                     "echo x > /proc/sys/kernel/hostname; mount -t tmpfs x /mnt; echo done")
    assert r.stdout == "done\n"
    assert "Read-only file system" in r.stderr and "Permission denied" in r.stderr
    assert not os.path.exists("/usr/bin/evil") and not os.path.exists("/etc/evil")
    assert not os.path.exists(marker)  # the sandbox's /tmp is its own
    # a symlink planted inside cannot carry a host-side write out either
    sandbox.exec(f"ln -s {marker} /workspace/trap; ln -s ../../../../../{marker} /workspace/trap2")
    sandbox.write_file("trap", "x")
    sandbox.write_file("trap2", "y")
    assert not os.path.exists(marker)
    assert sandbox.exec(f"cat {marker}").stdout == "y"


def test_remove_takes_only_what_the_sandbox_user_could(provider, project, tmp_path):
    """Not a tree below a directory the user cannot write (a root-owned vendor/ of the image),
    nor another user's file in sticky /tmp; the user's own file there goes."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "keep.py").write_text("x\n")
    image = provider.images.from_directory(str(tmp_path), dest="/workspace/vendor",
                                           parent=project, owner=(0, 0)).id
    sb = provider.create(SandboxSpec(image=image, limits=Limits(disk_mb=16)))
    try:
        assert sb.exec("rm -rf /workspace/vendor").exit_code != 0  # (nor can the user's rm)
        with pytest.raises(SandboxError, match="permission denied"):
            sb.remove("/workspace/vendor")
        assert sb.read_file("/workspace/vendor/lib/keep.py") == b"x\n"
        sb._write_as_root("/tmp/rootfile", b"root's\n")
        sb.exec("echo mine > /tmp/mine")
        with pytest.raises(SandboxError, match="permission denied"):
            sb.remove("/tmp/rootfile")
        sb.remove("/tmp/mine")
        assert sb.exec("ls /tmp/rootfile /tmp/mine").stdout == "/tmp/rootfile\n"
    finally:
        sb.destroy()


@pytest.fixture
def host_secret():
    path = f"/root/codedojo-secret-{uuid.uuid4().hex}"
    with open(path, "w") as f:
        f.write("TOP-SECRET")
    yield path
    os.unlink(path)


def test_host_secret_is_invisible(sandbox, host_secret):
    r = sandbox.exec(f"cat {host_secret}; ls /root /work /home; grep -r TOP-SECRET /etc /root /home 2>/dev/null; echo end")
    assert "TOP-SECRET" not in r.stdout and r.stdout.endswith("end\n")
    with pytest.raises(SandboxError):
        sandbox.read_file(host_secret)
    sandbox.exec(f"ln -s {host_secret} s1; ln -s /proc/1/root{host_secret} s2")
    for link in ("s1", "s2"):
        with pytest.raises(SandboxError):
            sandbox.read_file(link)
    assert sandbox.exec("cat /etc/shadow").exit_code != 0


def test_host_processes_are_invisible(sandbox):
    r = sandbox.exec("ls /proc | grep -E '^[0-9]+$' | wc -l; cat /proc/*/cmdline | tr '\\0' ' '; kill -9 1; echo $?")
    count = int(r.stdout.split("\n")[0])
    assert count <= 6  # init, its handler and this command's few processes
    assert "pytest" not in r.stdout
    assert sandbox.exec("true").exit_code == 0  # init survived the kill attempt


def test_no_network_not_even_host_loopback(sandbox):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    srv.settimeout(1.5)

    def accept():
        try:
            accepted.append(srv.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    code = (f"import socket\nfor a in [('127.0.0.1', {port}), ('10.0.2.2', 80), ('1.1.1.1', 53)]:\n"
            "    try:\n        socket.create_connection(a, timeout=1); print('OPEN', a)\n"
            "    except OSError as e: print('closed', e.errno)\n")
    r = sandbox.exec(["python3", "-c", code])
    t.join()
    srv.close()
    assert "OPEN" not in r.stdout and r.stdout.count("closed") == 3, r
    assert not accepted
    assert sandbox.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '").stdout == "lo\n"


def test_fork_bomb_hits_pids_limit(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=Limits(pids=32, disk_mb=16)))
    try:
        code = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                "            time.sleep(60); os._exit(0)\n        n += 1\n"
                "except OSError as e:\n    print(n, e.errno)\n")
        r = sb.exec(["python3", "-c", code], timeout=20)
        n, err = map(int, r.stdout.split())
        assert n < 32 and err == 11  # EAGAIN from the pids controller
        assert sb.exec("echo ok").exit_code in (0, 126)  # the sandbox may be full, the host is not
    finally:
        sb.destroy()


def test_memory_bomb_is_killed_host_survives(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=Limits(memory_mb=64, disk_mb=16)))
    try:
        r = sb.exec(["python3", "-c", "x = b'a' * (1 << 30); print('survived')"], timeout=30)
        assert r.exit_code != 0 and "survived" not in r.stdout
        assert sb.cgroup.memory_events().get("oom_kill", 1) >= 1
        assert sb.exec("echo alive").stdout == "alive\n"  # init survived: only the bomb died
    finally:
        sb.destroy()


def test_disk_fill_hits_size_cap(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=Limits(disk_mb=8)))
    try:
        r = sb.exec("dd if=/dev/zero of=big bs=1M count=64 2>&1; df -m /workspace | tail -1")
        assert "No space left" in r.stdout
        with pytest.raises(SandboxError, match="disk limit"):
            sb.write_file("big2", b"x" * (16 << 20))
        sb.exec("rm -f big")
        sb.write_file("small", "fits again")
        assert sb.read_file("small") == b"fits again"
    finally:
        sb.destroy()


def test_a_write_past_the_size_cap_leaves_the_file_as_it_was(provider, project):
    """Made longer, or shorter, near a full disk: the file is the old bytes or the new."""
    sb = provider.create(SandboxSpec(image=project, limits=Limits(disk_mb=8)))
    try:
        old = b"".join(b"line %d\n" % i for i in range(30000))
        sb.write_file("f.txt", old)
        sb.exec("dd if=/dev/zero of=filler bs=64k count=1000 2>/dev/null; true")
        with pytest.raises(SandboxError, match="disk limit"):
            sb.write_file("f.txt", old + b"x" * (2 << 20))
        assert sb.read_file("f.txt") == old
        sb.write_file("f.txt", b"short\n")  # in the room the old bytes held
        assert sb.read_file("f.txt") == b"short\n"
        # a sparse file's size is no room: written over in place, it would be cut half-way
        sb.exec("rm -f f.txt && truncate -s 4M sparse.bin && truncate -s -1M filler")
        with pytest.raises(SandboxError, match="disk limit"):
            sb.write_file("sparse.bin", b"y" * (3 << 20))
        assert sb.read_file("sparse.bin") == b"\0" * (4 << 20)
    finally:
        sb.destroy()


def test_double_fork_setsid_does_not_survive_destroy(provider, project):
    sb = provider.create(SandboxSpec(image=project, limits=Limits(disk_mb=16)))
    tag = f"{time.time_ns() % 100000}.{os.getpid() % 1000}"
    r = sb.exec(f"(setsid sh -c 'sleep {tag}' >/dev/null 2>&1 &) ; nohup setsid sleep {tag} >/dev/null 2>&1 & echo spawned")
    assert r.stdout == "spawned\n"
    deadline = time.monotonic() + 5
    while len(_host_pids_with(f"sleep\0{tag}")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_host_pids_with(f"sleep\0{tag}")) >= 2
    sb.destroy()
    assert _host_pids_with(f"sleep\0{tag}") == []


_SYSCALL_PROBE = """
import ctypes, errno, os, platform, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": dict(add_key=248, keyctl=250, unshare=272, bpf=321, perf_event_open=298,
                     userfaultfd=323, io_uring_setup=425, clone3=435),
      "aarch64": dict(add_key=217, keyctl=219, unshare=97, bpf=280, perf_event_open=241,
                      userfaultfd=282, io_uring_setup=425, clone3=435)}[platform.machine()]
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(NR[name], *args)
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]
print("add_key", call("add_key", b"user", b"codedojo-probe", b"secret", 6, -4))
print("keyctl", call("keyctl", 0, -4, 0))  # KEYCTL_GET_KEYRING_ID of the user keyring
print("unshare_user", call("unshare", 0x10000000))  # CLONE_NEWUSER
print("bpf", call("bpf", 0, None, 0))
print("perf", call("perf_event_open", None, 0, -1, -1, 0))
print("userfaultfd", call("userfaultfd", 0))
print("io_uring", call("io_uring_setup", 1, None))
print("clone3", call("clone3", None, 0))
t = threading.Thread(target=lambda: None); t.start(); t.join()
print("thread ok")
print("child", subprocess.run(["sh", "-c", "echo spawned"], capture_output=True, text=True).stdout.strip())
"""


def test_kernel_calls_shared_across_sandboxes_are_refused(sandbox):
    # Every sandbox runs as host uid 1000, so a key in the user's keyring would be seen by all;
    # user namespaces would give a command capabilities. Threads and children still work.
    r = sandbox.exec(["python3", "-c", _SYSCALL_PROBE])
    assert r.exit_code == 0, r
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert got == {"add_key": "EPERM", "keyctl": "EPERM", "unshare_user": "EPERM", "bpf": "EPERM",
                   "perf": "EPERM", "userfaultfd": "EPERM", "io_uring": "ENOSYS", "clone3": "ENOSYS",
                   "thread": "ok", "child": "spawned"}
    assert sandbox.exec("grep Seccomp: /proc/self/status").stdout.split() == ["Seccomp:", "2"]


def test_only_the_user_who_started_a_sandbox_may_run_commands_in_it(sandbox):
    """The init's socket has an abstract name in the host's network namespace, which any host
    user can list (/proc/net/unix) and connect to: another user's command is never run."""
    import subprocess
    import sys

    probe = (
        "import socket, struct\n"
        f"addr = {sandbox._address!r}\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(addr)\n"
        "fields = [b'/', b'3', b'/bin/sh', b'-c', b'echo pwned > /workspace/README.md', b'0']\n"
        "payload = b'\\0'.join(fields) + b'\\0'\n"
        "try:\n"
        "    s.sendall(struct.pack('=I', len(payload)) + payload)\n"
        "    print('answered' if s.recv(64) else 'closed')\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    print('closed')\n")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "closed"
    assert sandbox.read_file("README.md") == b"hello\n"
    assert sandbox.exec("echo still served").stdout == "still served\n"


_SOCKET_PROBE = """
import errno, socket
def make(family, kind, proto=0):
    try:
        socket.socket(family, kind, proto).close()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
def pair(family):
    try:
        for s in socket.socketpair(family, socket.SOCK_STREAM):
            s.close()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
print("unix", make(socket.AF_UNIX, socket.SOCK_STREAM), pair(socket.AF_UNIX))
print("inet", make(socket.AF_INET, socket.SOCK_STREAM), make(socket.AF_INET6, socket.SOCK_DGRAM))
print("netlink", make(socket.AF_NETLINK, socket.SOCK_RAW))
print("vsock", make(socket.AF_VSOCK, socket.SOCK_STREAM), pair(socket.AF_VSOCK))
print("alg", make(38, socket.SOCK_SEQPACKET))  # AF_ALG: the kernel's crypto, unprivileged
"""


def test_sockets_of_families_no_network_namespace_confines_are_refused(sandbox):
    """AF_VSOCK's ports are the VM's, whatever the namespace: a sandbox could listen where
    the host's services connect. Unix, IPv4, IPv6 and netlink sockets still work."""
    r = sandbox.exec(["python3", "-c", _SOCKET_PROBE])
    assert r.exit_code == 0, r
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert got == {"unix": "ok ok", "inet": "ok ok", "netlink": "ok",
                   "vsock": "EAFNOSUPPORT EAFNOSUPPORT", "alg": "EAFNOSUPPORT"}


def test_write_file_creates_the_file_in_the_directory_it_checked(sandbox, monkeypatch):
    """A directory swapped for a link to /etc once write_file has checked that the sandbox
    user may write in it: the file is still made in the directory checked, never in /etc."""
    from codedojo.sandbox.local import LocalSandbox

    sandbox.exec("mkdir /workspace/d")
    check = LocalSandbox._check_writable
    swapped = []

    def check_then_swap(dir_fd, path, name=None):
        check(dir_fd, path, name)
        if path == "/workspace/d/ld.so.preload" and not swapped:  # as a racing command would
            swapped.append(sandbox.exec("mv /workspace/d /workspace/d2 && ln -s /etc /workspace/d"))

    monkeypatch.setattr(LocalSandbox, "_check_writable", staticmethod(check_then_swap))
    sandbox.write_file("/workspace/d/ld.so.preload", "/tmp/evil.so\n")
    assert swapped[0].exit_code == 0
    assert sandbox.exec("test -e /etc/ld.so.preload").exit_code == 1
    assert sandbox.read_file("/workspace/d2/ld.so.preload") == b"/tmp/evil.so\n"


def test_changes_never_follows_a_link_of_the_sandbox_to_the_host(provider, project, tmp_path):
    """A directory of a snapshot's layer replaced by a link to a host directory: what that
    host directory holds is no concern of the sandbox's, and is never looked at."""
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret").write_text("TOP-SECRET")
    sb = provider.create(SandboxSpec(image=project, limits=Limits(disk_mb=16)))
    try:
        sb.exec("mkdir /workspace/d && echo x > /workspace/d/secret")
        (fork,) = sb.fork(1)
        try:
            fork.exec(f"rm -r /workspace/d && ln -s {host} /workspace/d")
            assert [(c.path, c.kind) for c in fork.changes()] == [("/workspace/d", "added")]
        finally:
            fork.destroy()
    finally:
        sb.destroy()


def test_changes_reads_the_writable_layer_of_a_frozen_sandbox(sandbox, monkeypatch):
    """Nothing in the sandbox runs while changes() reads its writable layer (a command
    swapping its files meanwhile could otherwise lead the host's reads elsewhere)."""
    from codedojo.sandbox.images import LayerStack

    sandbox.exec("(while true; do echo x >> busy.log; done) >/dev/null 2>&1 &")
    sandbox.write_file("state.txt", "s")
    lookup = LayerStack.lookup
    frozen = []

    def watched(self, rel):
        frozen.append(sandbox.cgroup._frozen())
        return lookup(self, rel)

    monkeypatch.setattr(LayerStack, "lookup", watched)
    assert "/workspace/state.txt" in [c.path for c in sandbox.changes()]
    assert frozen and all(frozen)
    monkeypatch.undo()
    assert sandbox.exec("echo alive").stdout == "alive\n"  # thawed


_SWAPPER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
  char a[64], b[64];
  for (;;) {
    for (int i = 0; i < 8; i++) {  /* a file and a FIFO, a directory and a link to the host */
      snprintf(a, sizeof a, "/workspace/f%d", i);
      snprintf(b, sizeof b, "/workspace/f%d.fifo", i);
      syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, 2 /* RENAME_EXCHANGE */);
    }
    syscall(SYS_renameat2, AT_FDCWD, "/workspace/d", AT_FDCWD, "/workspace/s", 2);
  }
}
"""


def test_changes_stays_in_the_layer_of_a_sandbox_swapping_its_files(provider, tmp_path,
                                                                     monkeypatch):
    """Even unfrozen (as where the cgroup has no freezer), changes() walks a writable layer
    that a command changes as it is read without following a link out of it, blocking on a
    FIFO or failing on an entry gone meanwhile."""
    from codedojo.sandbox.cgroups import Cgroup

    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}").write_text("orig\n")
    image = provider.images.from_directory(str(src)).id
    host = tmp_path / "host"
    (host / "sub").mkdir(parents=True)
    (host / "HOST-ONLY").write_text("x")
    os.mkfifo(host / "f0")
    monkeypatch.setattr(Cgroup, "freeze", lambda self, frozen, timeout=None: None)
    sb = provider.create(SandboxSpec(image=image, limits=Limits(disk_mb=16)))
    upper = os.path.join(sb._rw, "upper", "workspace")
    try:
        sb.write_file("/tmp/swapper.c", _SWAPPER)
        r = sb.exec("cd /workspace && for i in $(seq 0 7); do echo same > f$i; mkfifo f$i.fifo; "
                    f"done; mkdir d && ln -s {host} s && gcc -O2 -o /tmp/swapper /tmp/swapper.c "
                    "&& (/tmp/swapper >/dev/null 2>&1 &) && echo started")
        assert r.stdout == "started\n", r
        def call(out: list) -> None:
            try:
                out.append(sb.changes())
            except Exception as e:
                out.append(e)

        for _ in range(100):
            got: list = []
            t = threading.Thread(target=call, args=(got,), daemon=True)
            t.start()
            t.join(60)
            if t.is_alive():  # blocked on a FIFO: set it free, then fail
                for name in os.listdir(upper):
                    try:
                        os.close(os.open(os.path.join(upper, name), os.O_WRONLY | os.O_NONBLOCK))
                    except OSError:
                        pass
                t.join(10)
                pytest.fail("changes() blocked on a FIFO of the sandbox's")
            assert isinstance(got[0], list), got[0]
            paths = {c.path for c in got[0]}
            assert all(p.count("/") == 2 for p in paths), paths  # nothing below d/ or s/
    finally:
        sb.destroy()


def _bytes_read() -> int:
    """What this process has read so far (rchar: bytes returned by read calls, holes too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_sparse_file_costs_a_snapshot_and_changes_its_data_not_its_size(provider, project):
    """A `truncate -s` is free in the sandbox; hashing or comparing its holes byte by byte
    would cost the host minutes (hours for the terabytes of a `truncate -s 15T`)."""
    sb = provider.create(SandboxSpec(image=project, limits=Limits(disk_mb=16)))
    try:
        sb.exec("truncate -s 4G huge && printf x | dd of=huge bs=1 seek=4096 conv=notrunc "
                "2>/dev/null")
        before = _bytes_read()
        snap = sb.snapshot()
        assert _bytes_read() - before < 64 << 20
        # a sandbox of that snapshot: the file touched is compared with the image's
        other = provider.create(SandboxSpec(image=snap, limits=Limits(disk_mb=16)))
        try:
            other.exec("touch huge")
            before = _bytes_read()
            assert other.changes() == []
            assert _bytes_read() - before < 64 << 20
            other.exec("printf y | dd of=huge bs=1 seek=3000000000 conv=notrunc 2>/dev/null")
            assert [(c.path, c.kind) for c in other.changes()] == [("/workspace/huge",
                                                                      "modified")]
        finally:
            other.destroy()
    finally:
        sb.destroy()


def test_deep_and_long_trees_are_snapshotted_and_compared(provider, project):
    """A tree 1000 levels deep, or a path of 4035 bytes, is fine in the sandbox, and so for
    changes(), a snapshot, a fork and the removal of its layer (no recursion per level, no
    host path past PATH_MAX); a path past what a sandbox path may be is a clear error."""
    sb = provider.create(SandboxSpec(image=project, limits=Limits(disk_mb=32)))
    deep = "cd /workspace && for i in $(seq 1000); do cd d; done"
    long = "cd /workspace && for i in $(seq 16); do cd $(printf 'x%.0s' $(seq 250)); done"
    try:
        sb.exec("cd /workspace && for i in $(seq 1000); do mkdir d && cd d; done && echo deep > f")
        sb.exec(long.replace("cd $(", "mkdir $(printf 'x%.0s' $(seq 250)) && cd $(") +
                " && echo long > f")
        got = [c.path for c in sb.changes()]
        assert got == ["/workspace" + "/d" * 1000 + "/f", "/workspace" + ("/" + "x" * 250) * 16
                       + "/f"]
        snap = sb.snapshot()
        (fork,) = sb.fork(1, snap)
        try:
            assert fork.exec(f"{deep} && cat f").stdout == "deep\n"
            assert fork.exec(f"{long} && cat f").stdout == "long\n"
            assert [c.path for c in fork.changes()] == got
        finally:
            fork.destroy()
        store = provider.images
        (layer,) = set(store.resolve(snap).layers) - set(sb.image.layers)
        store.remove(snap)
        old = time.time() - 7200
        os.utime(store.layer_path(layer), (old, old))
        assert layer in store.prune()
        assert not os.path.exists(store.layer_path(layer))
        # one level more than a path in the sandbox may have
        sb.exec(f"{long} && mkdir $(printf 'y%.0s' $(seq 250)) && cd y* && echo x > g")
        tmp = os.path.join(store.root, "tmp")
        left = set(os.listdir(tmp))
        for call in (sb.changes, sb.snapshot):
            with pytest.raises(SandboxError, match="bytes long, past the 4095 that a sandbox's "
                                                   "path may have"):
                call()
        assert set(os.listdir(tmp)) <= left  # the snapshot begun is removed
        assert sb.exec("echo alive").stdout == "alive\n"
    finally:
        sb.destroy()


def test_host_file_calls_need_every_directory_on_the_way_searchable(provider, project,
                                                                    tmp_path):
    """Root's 0700 /root holds a readable file and a directory of the sandbox user's: neither
    is reached by a command, so neither is by the host-side calls (a link to them included),
    nor in the image by read_original; nor is anything below /proc (init's environment)."""
    (tmp_path / "secret.txt").write_text("hidden answer\n")
    hidden = provider.images.from_directory(str(tmp_path), dest="/root/hidden", parent=project,
                                            owner=(0, 0)).id
    image = provider.images.from_directory(str(tmp_path), dest="/root/udir", parent=hidden).id
    sb = provider.create(SandboxSpec(image=image, limits=Limits(disk_mb=16)))
    try:
        r = sb.exec("stat -c %a /root; cat /root/hidden/secret.txt; echo x > /root/udir/new")
        assert r.stdout == "700\n" and r.stderr.count("Permission denied") == 2, r
        sb.exec("ln -s /root/hidden/secret.txt link && ln -s /root/udir udir")
        denied = "permission denied .*may not search /root"
        for path in ("/root/hidden/secret.txt", "link"):
            with pytest.raises(SandboxError, match=denied):
                sb.read_file(path)
        with pytest.raises(SandboxError, match=denied):
            sb.list_dir("/root/hidden")
        with pytest.raises(SandboxError, match=denied):
            sb.stat("/root/hidden/secret.txt")
        with pytest.raises(SandboxError, match=denied + " in the image"):
            sb.read_original("/root/hidden/secret.txt")
        for path in ("/root/udir/new.txt", "udir/new.txt"):
            with pytest.raises(SandboxError, match=denied):
                sb.write_file(path, "by the host")
        with pytest.raises(SandboxError, match=denied):
            sb.remove("/root/udir/secret.txt")
        with pytest.raises(SandboxError, match="kernel file system"):
            sb.stat("/proc/1/environ")
        assert sb.stat("link").kind == "symlink"  # (a link of the user's own, in /workspace)
        sb.remove("udir")  # the link, not what it leads to
        assert sb.exec("test -e udir").exit_code == 1
        assert os.path.exists(os.path.join(sb._mnt, "root/udir/secret.txt"))
    finally:
        sb.destroy()


def test_filling_the_disk_is_enospc_and_leaves_the_processes_their_memory(provider, project):
    """The disk (a tmpfs) is charged to the sandbox's memory cgroup: filled, it is ENOSPC to
    the writer, not an OOM kill, and a command may still use most of ``memory_mb``."""
    limits = Limits(memory_mb=128, disk_mb=64, pids=64)
    sb = provider.create(SandboxSpec(image=project, limits=limits))
    try:
        r = sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=100 2>&1; echo rc=$?")
        assert "No space left" in r.stdout and r.exit_code == 0, r
        r = sb.exec(["python3", "-c", "x = bytearray(96 << 20); print('kept', len(x) >> 20)"])
        assert (r.exit_code, r.stdout) == (0, "kept 96\n"), r
        assert sb.cgroup.memory_events().get("oom_kill", 0) == 0
    finally:
        sb.destroy()
