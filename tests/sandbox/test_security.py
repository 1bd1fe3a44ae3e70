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
