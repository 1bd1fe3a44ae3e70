"""The local sandbox kind: overlayfs over image layers, Linux namespaces, cgroups, a C init.

Anatomy of one sandbox (`<root>/sandboxes/<id>/`):

    rw/      a tmpfs of `Limits.disk_mb` holding overlay's upper/ and work/ (the disk cap:
             a full tmpfs is ENOSPC inside, and nothing else fills up). Its pages are RAM,
             charged to the sandbox's memory cgroup, whose limit is `memory_mb + disk_mb`,
             so a full disk leaves the processes their `memory_mb`
    root/    the overlay mount: lowerdir = image layers (top first), upperdir = rw/upper
    netns    the network namespace, bind-mounted so it outlives a restore
    state.json  what `gc` needs to clean up after a crash (pids, cgroups, owner)

The init helper (agent.c) joins the sandbox's cgroups, creates the netns (only `lo`), unshares
mount/pid/ipc/uts, binds the host's /usr read-only, mounts /proc and a minimal /dev, pivots into
root/ and forks commands on request over a unix socket, as uid 1000 with no capabilities,
under a seccomp filter (no keyrings, user namespaces, bpf or io_uring: see agent.c) and with
`Limits.open_files` as their RLIMIT_NOFILE (not this process's, raised for many sandboxes).
That makes create one overlay mount plus one small process, and exec one connect plus two
forks.

Files are read and written by the host, not by commands: paths are walked one name at a time
from `/proc/<init>/root` (`LocalSandbox._walk`), links followed by the walk and never by the
kernel, so they are resolved exactly as the sandbox sees them and a symlink or `..` can never
leave it. The host acts as the sandbox user would: every directory on the way must be one the
user may search, files it creates belong to uid 1000, and it refuses to read or write where
uid 1000 could not (`read_original` too, in the image's layers). Where
the host reads the writable layer itself (`changes`, `snapshot`), the sandbox is frozen and
the layer is walked directory fd by directory fd, never following a link (`walk_tree`).

Snapshots copy the upper layer (only what changed since the sandbox started) into a new
content-addressed layer while the cgroup is frozen; fork and restore mount a fresh upper over
[snapshot layer, *image layers]. Only the filesystem is snapshotted: `criu check` fails on this
project's kernel, so running processes are not (restore kills them); see `CRIU_AVAILABLE`.
A snapshot stays in the store until `images.remove(id)` (refused while a sandbox runs on it:
a sandbox's `source` is the image or snapshot its layers come from, so `fork(n)` without a
snapshot names the one it took in its forks' `source`); `gc` then deletes the layers no image
names (`ImageStore.prune`). An RL loop that snapshots per step removes each snapshot once its
forks are destroyed, or the store only grows; a named image (a task's) is kept, and so is a
snapshot of a sandbox that changed nothing, which is its image.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import posixpath
import re
import resource
import select
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

from codedojo.sandbox.agent import agent_binary
from codedojo.sandbox.base import (
    OPEN_FILES,
    WORKSPACE,
    Change,
    EgressBinding,
    ExecResult,
    FileInfo,
    FileTooLarge,
    Limits,
    NotFound,
    SandboxError,
    SandboxSpec,
    cut_line,
    seconds,
)
from codedojo.sandbox.cgroups import Cgroup, CgroupManager
from codedojo.sandbox.images import (
    SANDBOX_GID,
    SANDBOX_HOME,
    SANDBOX_UID,
    Image,
    ImageStore,
    LayerStack,
    copy_layer_tree,
    data_extents,
    remove_tree,
    walk_tree,
)
from codedojo.sandbox.syscalls import (
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    mount,
    mount_overlay,
    open_beneath,
    umount,
)

DEFAULT_ROOT = "/var/lib/codedojo/sandbox"


def store_root(root: str | None = None) -> str:
    """The store a provider of ``root`` uses: it, or $CODEDOJO_SANDBOX_ROOT, or
    `DEFAULT_ROOT`."""
    return root or os.environ.get("CODEDOJO_SANDBOX_ROOT") or DEFAULT_ROOT


def missing_from_store(root: str) -> str | None:
    """What a store at ``root`` lacks of what a provider made it with (a folder's path), or
    None: a mistyped root is told apart before a provider makes a store there."""
    for d in ("sandboxes", "layers", "images"):
        if not os.path.isdir(os.path.join(root, d)):
            return os.path.join(root, d)
    return None
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The kernel's own file systems, whose files the host-side file calls never serve
_KERNEL_FS = {"proc", "sysfs", "devtmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "debugfs",
              "tracefs", "securityfs", "bpf", "binfmt_misc", "configfs", "pstore", "hugetlbfs",
              "fusectl", "autofs"}
# After a command exits, how long to keep reading output that a background child still holds.
EXIT_GRACE_S = 0.05

log = logging.getLogger(__name__)


def criu_available() -> bool:
    """True when `criu check` passes, i.e. process trees could be checkpointed here."""
    exe = shutil.which("criu")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "check"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of `pid`, to tell a live process from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


_MOUNTINFO_ESCAPE = re.compile(rb"\\([0-7]{3})")


def _mount_points() -> list[str]:
    """Every mount point of this process's mount table, as a path: /proc/self/mountinfo
    writes a space, tab, newline or backslash in one as an octal escape (\\040 \\011 \\012
    \\134), which is undone here."""
    with open("/proc/self/mountinfo", "rb") as f:
        return [os.fsdecode(_MOUNTINFO_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]),
                                                  line.split()[4])) for line in f]


def _mounts_under(prefix: str) -> list[str]:
    """The mount points at ``prefix`` or below it."""
    below = prefix.rstrip("/") + "/"
    return [m for m in _mount_points() if m == prefix or m.startswith(below)]


def _umount_if_mounted(target: str) -> None:
    """Detach the mount at ``target``; nothing mounted there (EINVAL) or no such path is no
    error, any other failure is raised."""
    try:
        umount(target, MNT_DETACH)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOENT):
            raise


_nofile_raised = False


def _raise_nofile_limit() -> None:
    """Raise the soft RLIMIT_NOFILE to the hard limit, once per process. A live sandbox holds
    two file descriptors and a running command five, so the usual soft limit (1024) runs out
    at a few hundred sandboxes, long before memory does; no fd here is ever passed to
    select(), whose 1024 bound is why that soft limit exists. Commands do not inherit it:
    they run with `Limits.open_files` (set by agent.c)."""
    global _nofile_raised
    if _nofile_raised:
        return
    _nofile_raised = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class OutOfFds(OSError):
    """EMFILE: this process's fd table is full; the message says so, and what it stopped."""


def _out_of_fds(what: str) -> OutOfFds:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return OutOfFds(errno.EMFILE, f"the host is out of file descriptors (this process's "
                                  f"RLIMIT_NOFILE is {soft}): {what}")


@contextlib.contextmanager
def _fd_exhaustion_named(what: str):
    """A full fd table (EMFILE) raised in the block says so, and what it stopped (one named
    already, deeper in, is left as it is)."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.EMFILE or isinstance(e, OutOfFds):
            raise
        raise _out_of_fds(what) from e


MS_SHARED = 1 << 20
POOL_REFILL_DELAY_S = 0.03


def _ensure_tmpfs(path: str) -> None:
    """Sandbox directories (mount points, netns file, state.json) live on one tmpfs per store:
    creating and deleting them costs no disk journal, they survive a crash of the service (for
    gc) and vanish at reboot together with everything they describe."""
    if path in _mount_points():
        return
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=700,size=64m")


def _close_at_exit(ref: weakref.ref) -> None:
    provider = ref()
    if provider is not None:
        with contextlib.suppress(Exception):
            provider.close()


def _hard_nofile() -> int:
    """This process's hard RLIMIT_NOFILE (at most 2^20), which init inherits and can lower
    only (without CAP_SYS_RESOURCE, as in a container)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)


def open_files(limits: Limits) -> int:
    """Every command's RLIMIT_NOFILE: ``limits.open_files``, or where None, `OPEN_FILES` or
    this host's hard limit where that is lower."""
    return min(OPEN_FILES, _hard_nofile()) if limits.open_files is None else limits.open_files


def validate_limits(limits: Limits) -> None:
    # upper bounds: what the kernel takes (pid_max; a memory limit in bytes under 2^63, the
    # two summed included; open files, `_hard_nofile`); open files: past the shell's own fds
    for name, low, high in (("memory_mb", 32, 1 << 30), ("pids", 8, 1 << 22),
                            ("disk_mb", 1, 1 << 30), ("max_output_bytes", 1, 1 << 30),
                            ("open_files", max(LocalShell.MARK_FDS) + 1, _hard_nofile())):
        v = getattr(limits, name)
        if name == "open_files" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise SandboxError(f"limits.{name}: must be an integer in [{low}, {high}], "
                               f"got {v!r}")
    if not (isinstance(limits.cpus, int | float) and 0 < limits.cpus <= 4096):
        raise SandboxError(f"limits.cpus: must be in (0, 4096], got {limits.cpus!r}")
    seconds(limits.exec_timeout_s, "limits.exec_timeout_s")


def _memory_cap_mb(limits: Limits) -> int:
    """The limit of a sandbox's memory cgroup: ``memory_mb`` for its processes and
    ``disk_mb`` beside it, since its disk is a tmpfs whose pages are charged to the cgroup of
    the process that writes them (theirs; a file the host writes is the host's). A full disk
    is then ENOSPC, never an OOM kill; a fork's or restore's disk is a fresh tmpfs (the old one
    unmounted, its pages given back), and snapshot layers are files of the store."""
    return limits.memory_mb + limits.disk_mb


READ, SEARCH = 0o4, 0o1  # a permission's bit in one class of a mode (`_user_may`)


def _user_may(st: os.stat_result, want: int) -> bool:
    """Whether the sandbox user (uid `SANDBOX_UID`, in group `SANDBOX_GID` alone: agent.c
    drops the others) has the permissions ``want`` (`READ`, `SEARCH`, or both) on a file of
    ``st``: by the owner's bits of its mode if the user owns it, else by the group's if it is
    the user's group, else by the others' (as the kernel decides, ACLs aside)."""
    if st.st_uid == SANDBOX_UID:
        bits = st.st_mode >> 6
    elif st.st_gid == SANDBOX_GID:
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bits & want == want


def sandbox_path(path: str, field: str = "path") -> str:
    """Normalise a path inside the sandbox: relative paths are below /workspace and may not
    climb out of it; absolute paths may not climb above /. Raises SandboxError otherwise."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"{field}: expected a non-empty path without NUL bytes, got {path!r}")
    parts: list[str] = [] if path.startswith("/") else WORKSPACE.strip("/").split("/")
    floor = len(parts)
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if len(parts) <= floor:
                raise SandboxError(f"{field}: {path!r} escapes the sandbox")
            parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _utf8(text: str, field: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: no bytes stand for it (the value not shown:
        raise SandboxError(f"{field}: not text that UTF-8 can carry (a lone surrogate)"  # a secret?
                           ) from None


def validate_env(env: Mapping[str, str], field: str) -> Mapping[str, str]:
    """``env`` when every variable can reach a command: a name that is a non-empty string
    without '=' or NUL, a value that is a string without NUL, both UTF-8 text. Raises
    SandboxError naming the first one that cannot (never its value: it may be a secret)."""
    if not isinstance(env, Mapping):
        raise SandboxError(f"{field}: expected a mapping of names to values, got "
                           f"{type(env).__name__}")
    for k, v in env.items():
        if (not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str)
                or "\0" in v):
            raise SandboxError(f"{field}: invalid variable {k!r}: a name is a non-empty string "
                               "without '=' or NUL, a value a string without NUL")
        _utf8(f"{k}={v}", f"{field} {k!r}")
    return env


class _Process:
    """One command started by the sandbox's init: its pipes and its control connection."""

    def __init__(self, address: bytes, argv: Sequence[str], env: Mapping[str, str], cwd: str):
        fields = [_utf8(cwd, "cwd"), str(len(argv)).encode(),
                  *(_utf8(a, "command") for a in argv), str(len(env)).encode(),
                  *(_utf8(f"{k}={v}", f"env {k!r}") for k, v in env.items())]
        payload = b"\0".join(fields) + b"\0"
        with _fd_exhaustion_named("no command can be started"):
            self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.conn.connect(address)
            self.conn.sendall(struct.pack("=I", len(payload)) + payload)
            msg, fds, flags, _ = socket.recv_fds(self.conn, 256, 3)
        except OSError as e:
            self.conn.close()
            raise SandboxError(f"sandbox is not running ({e.strerror or e})") from None
        if msg.startswith(b"F ") and (len(fds) != 3 or flags & socket.MSG_CTRUNC):
            # The command started, but the kernel dropped the pipes init sent with it: this
            # process's fd table had no room for them. Closing the connection kills it.
            for fd in fds:
                os.close(fd)
            self.conn.close()
            raise _out_of_fds("the command's pipes could not be received, so it was killed")
        if not msg.startswith(b"F ") or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            self.conn.close()
            raise SandboxError(f"command: {msg[2:].decode(errors='replace') or 'rejected'}")
        self.pid = int(msg[2:])
        self.stdin, self.stdout, self.stderr = fds
        for fd in fds:
            os.set_blocking(fd, False)
        self.status: int | None = None
        self._ctl = b""

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(b"K")

    def read_status(self) -> bool:
        """Consume control bytes; True once the exit status has arrived (or the link died)."""
        try:
            data = self.conn.recv(64)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            if self.status is None:
                self.status = signal.SIGKILL  # the link died with init: report a kill
            return True
        self._ctl += data
        if self._ctl.startswith(b"X ") and self._ctl[2:].strip().lstrip(b"-").isdigit():
            self.status = int(self._ctl[2:])
            return True
        return False

    def close(self) -> None:
        for fd in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.conn.close()


def _collect(proc: _Process, stdin: bytes | None, deadline: float, cap: int,
             stop: tuple[bytes, bytes] | None = None) -> tuple[bytes, bytes, bool, bool]:
    """Pump stdin/stdout/stderr/control until the process exits (or `stop` markers appear on
    both streams, for the shell). Returns (stdout, stderr, timed_out, truncated). No more than
    ``cap`` bytes of a stream are kept, its start and its end (`_Kept`); with ``stop``, those of
    the stream before the marker, then the marker and the status after it, which is looked for
    in each read and the few bytes before it, never in all of a command's output."""
    with _fd_exhaustion_named("the command's output cannot be read"):
        sel = selectors.DefaultSelector()
    streams = (proc.stdout, proc.stderr)
    shell = {fd: _MarkerScan(m, cap) for m, fd in zip(stop, streams, strict=True)} if stop else {}
    bufs = {} if shell else {fd: _Kept(cap) for fd in streams}
    timed_out = False
    pending = memoryview(stdin) if stdin else None
    if pending is not None:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    elif stop is None:
        os.close(proc.stdin)
        proc.stdin = -1
    open_streams = {proc.stdout, proc.stderr}
    for fd in open_streams:
        sel.register(fd, selectors.EVENT_READ)
    proc.conn.setblocking(False)
    sel.register(proc.conn, selectors.EVENT_READ)
    exited_at: float | None = None
    try:
        while True:
            if shell and (all(scan.found for scan in shell.values()) or not open_streams):
                break
            if exited_at is not None and (not open_streams or time.monotonic() - exited_at > EXIT_GRACE_S):
                break
            now = time.monotonic()
            if now >= deadline and timed_out:  # the kill did not end it either: give up on it
                break
            if now >= deadline:
                timed_out = True
                proc.kill()
                deadline = now + 5.0  # the kill is synchronous in init; this is a safety net
            wait = max(0.0, deadline - now)
            if exited_at is not None:
                wait = min(wait, EXIT_GRACE_S)
            for key, _ in sel.select(wait):
                fd = key.fileobj
                if fd is proc.conn:
                    if proc.read_status():
                        sel.unregister(proc.conn)
                        exited_at = time.monotonic()
                elif fd == proc.stdin:
                    try:
                        n = os.write(proc.stdin, pending[:65536])  # type: ignore[index]
                        pending = pending[n:]  # type: ignore[index]
                    except (BrokenPipeError, OSError):
                        pending = None
                    if not pending:
                        sel.unregister(proc.stdin)
                        if stop is None:
                            os.close(proc.stdin)
                            proc.stdin = -1
                else:
                    try:
                        data = os.read(fd, 65536)  # type: ignore[arg-type]
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(fd)
                        open_streams.discard(fd)  # type: ignore[arg-type]
                        continue
                    if shell:
                        shell[fd].feed(data)  # type: ignore[index]
                    else:
                        bufs[fd].add(data)  # type: ignore[index]
    finally:
        sel.close()
    if shell:
        out, err = shell[proc.stdout].output(), shell[proc.stderr].output()
        kept = [scan.kept for scan in shell.values()]
    else:
        out, err = bufs[proc.stdout].output(), bufs[proc.stderr].output()
        kept = list(bufs.values())
    return out, err, timed_out, any(k.cut for k in kept)


def _files_below(stack: LayerStack, rel: str) -> list[str]:
    """Every entry under directory ``rel`` of a layer stack that is not a directory itself."""
    out: list[str] = []
    todo = [rel]  # (no recursion: a tree may be deeper than Python's stack)
    while todo:
        d = todo.pop()
        for name in stack.listdir(d):
            p = posixpath.join(d, name)
            found = stack.lookup(p)
            if found is not None and stat.S_ISDIR(found[1].st_mode):
                todo.append(p)
            elif found is not None:
                out.append(p)
    return sorted(out)


class _Kept:
    """A stream's bytes, ``cap`` of them at most: past that, its first half and its last (the
    end of a long test run is where its summary is), with a line between them that says how
    many were cut."""

    def __init__(self, cap: int) -> None:
        self.cap, self.head, self.tail, self.total = cap, bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > 2 * self.cap:  # (trimmed now and then, not at every read)
            del self.tail[: len(self.tail) - self.cap]

    @property
    def cut(self) -> bool:
        return self.total > self.cap

    def output(self) -> bytes:
        if not self.cut:
            return bytes(self.head + self.tail)
        keep = self.cap - len(self.head)
        return (bytes(self.head) + f"\n{cut_line(self.total - self.cap)}\n".encode()
                + bytes(self.tail[len(self.tail) - keep:]))


class _MarkerScan:
    """One stream of a shell command: its bytes (`_Kept`), and the marker that ends it with
    the status after it, found in each read together with the bytes before it that could hold
    the marker's start (kept back until it is known they do not). What comes after the status
    was written once the command had ended (a background process's output): it is dropped."""

    AFTER = 16  # bytes kept after the marker: the status ("%d\n") and no more

    def __init__(self, marker: bytes, cap: int) -> None:
        self.marker = marker
        self.kept = _Kept(cap)  # the stream before the marker
        self.window = b""  # its last len(marker) - 1 bytes, before the marker is found
        self.found: bytearray | None = None  # the marker and the few bytes after it

    def feed(self, data: bytes) -> None:
        if self.found is not None:
            self.found += data[: len(self.marker) + self.AFTER - len(self.found)]
            return
        scan = self.window + data
        i = scan.find(self.marker)
        if i >= 0:
            self.kept.add(scan[:i])
            self.window, self.found = b"", bytearray(scan[i:i + len(self.marker) + self.AFTER])
            return
        cut = max(0, len(scan) - (len(self.marker) - 1))
        self.kept.add(scan[:cut])
        self.window = scan[cut:]

    def output(self) -> bytes:
        if self.found is None:  # the stream ended without it: all it had
            self.kept.add(self.window)
            self.window = b""
            return self.kept.output()
        return self.kept.output() + bytes(self.found)


class LocalShell:
    """A bash process whose cwd and exported variables persist between `run` calls.

    Each command is read verbatim by `read -N <bytes>` and run by `eval` (so quoting and syntax
    errors cannot desynchronise the stream; a syntax error is exit status 2) with stdin from
    /dev/null, then a random marker and the status are printed on stdout and the marker on
    stderr: on the shell's own pipes, which it keeps on fds `MARK_FDS` from its start, so a
    command that moves its stdout or stderr (`exec 2>&1`, `exec >/dev/null`) does not move
    them. A timeout kills the shell (its state is lost) and the next call starts a fresh one
    in /workspace. A shell used again after `close` (or a restore, which closes every shell)
    starts a fresh one too, and is the sandbox's again: `destroy` closes it. `exited` says
    whether the last `run` ended the shell (an `exit`, `set -e`, a kill or a timeout)."""

    MARK_FDS = (198, 199)  # high, so that no command opens them by chance

    def __init__(self, sandbox: LocalSandbox):
        self.sandbox = sandbox
        self._proc: _Process | None = None
        self._lock = threading.Lock()
        self._marker = f"\x1e__codedojo_{uuid.uuid4().hex}__".encode()
        self.exited = False  # the last `run` ended the shell: the next starts a fresh one

    def _start(self) -> tuple[_Process, bytes]:
        """The running shell, and what it must read before a command: the copies of its stdout
        and stderr when it is new."""
        if self._proc is not None:
            return self._proc, b""
        if self not in self.sandbox._shells:  # (used again after a close or a restore)
            self.sandbox._shells.append(self)  # so that destroy closes what starts below
        self.sandbox._check_alive()  # after joining: a destroy begun before is seen here
        env = self.sandbox._env(None)
        self._proc = _Process(self.sandbox._address, ["/bin/bash", "--noprofile", "--norc"],
                              env, WORKSPACE)
        out, err = self.MARK_FDS
        return self._proc, f"exec {out}>&1 {err}>&2\n".encode()

    def run(self, command: str, timeout: float | None = None) -> ExecResult:
        if not isinstance(command, str) or "\0" in command:
            raise SandboxError("command: the shell takes one string without NUL bytes")
        t0 = time.monotonic()
        limits = self.sandbox.spec.limits
        timeout = limits.exec_timeout_s if timeout is None else seconds(timeout, "timeout")
        with self._lock:
            payload = _utf8(command, "command")
            proc, setup = self._start()
            self.exited = False
            m, (out_fd, err_fd) = self._marker.decode(), self.MARK_FDS
            # `read -N` (bytes, with LC_ALL=C) takes exactly the command off stdin, so no quoting
            # can desynchronise the stream and no helper process is spawned per call.
            script = (setup + f"LC_ALL=C IFS= read -r -N {len(payload)} __cdj_cmd\n".encode()
                      + payload + (f"\neval \"$__cdj_cmd\" </dev/null; __cdj=$?; "
                                   f"printf '%s%d\\n' '{m}' \"$__cdj\" >&{out_fd}; "
                                   f"printf '%s' '{m}' >&{err_fd}\n").encode())
            try:
                os.set_blocking(proc.stdin, True)
                view = memoryview(script)
                while view:
                    view = view[os.write(proc.stdin, view):]
                os.set_blocking(proc.stdin, False)
            except OSError:
                self._drop()
                return self.run(command, timeout) if time.monotonic() - t0 < 1 else ExecResult(
                    137, "", "shell died", duration_s=time.monotonic() - t0)
            try:
                out, err, timed_out, truncated = _collect(
                    proc, None, t0 + timeout, limits.max_output_bytes,
                    stop=(self._marker, self._marker))
            except BaseException:
                self._drop()  # where its streams stand is unknown: a fresh shell next time
                raise
            code: int
            if self._marker in out and self._marker in err:
                out, _, tail = out.partition(self._marker)
                err = err.partition(self._marker)[0]
                code = int(tail.split(b"\n", 1)[0] or b"0")
            else:  # the shell exited (`exit`, a kill or a timeout): its state is gone
                _await_status(proc)  # its pipes may close before init reports how it ended
                code = _exit_code(proc.status) if proc.status is not None else 137
                self._drop()
                self.exited = True
            return ExecResult(code, out.decode(errors="replace"), err.decode(errors="replace"),
                              timed_out=timed_out, truncated=truncated, duration_s=time.monotonic() - t0)

    def _drop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.close()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._drop()
        with contextlib.suppress(ValueError):
            self.sandbox._shells.remove(self)


def _await_status(proc: _Process, timeout: float = 5.0) -> None:
    """Wait (up to ``timeout``) for init's report of how a command ended."""
    if proc.status is not None:
        return
    proc.conn.setblocking(True)
    proc.conn.settimeout(timeout)
    with contextlib.suppress(OSError):
        while not proc.read_status():
            pass


class _InitGone(SandboxError):
    """A pooled sandbox's init was found dead as it was claimed (the host's OOM killer, an
    admin's kill): the create goes on without it."""


class _Root(NamedTuple):
    """The sandbox's root as one file call holds it (`LocalSandbox._root`)."""

    fd: int  # an O_PATH fd of the root, the call's own copy
    kernel_devs: set[int]  # the devices of its kernel file systems (`_kernel_devices`)


class LocalSandbox:
    """One sandbox (see the module docstring). Implements `codedojo.sandbox.base.Sandbox`."""

    def __init__(self, provider: LocalProvider, sandbox_id: str, spec: SandboxSpec, image: Image):
        self.provider = provider
        self.id = sandbox_id
        self.spec = spec
        self.image = image  # what the sandbox was created from (changes() compares to it)
        self.lowers: tuple[str, ...] = image.layers  # the current lower stack (restore moves it)
        # The image whose layers `lowers` are: `image` for a create, the snapshot for a fork or
        # after a restore (`ImageStore.remove` refuses it while the sandbox lives).
        self.source = image.id
        self.dir = os.path.join(provider.root, "sandboxes", sandbox_id)
        self.binding = EgressBinding()
        self._address = b"\0codedojo-" + uuid.uuid4().hex.encode()
        self._listener: socket.socket | None = None
        self._waiter: subprocess.Popen | None = None
        self.init_pid = 0
        self._init_fd = -1  # a pidfd of init
        self._root_fd = -1
        self._kernel_devs: set[int] | None = None  # `_kernel_devices`, read once
        self.cgroup: Cgroup | None = None
        self._shells: list[LocalShell] = []
        self._lock = threading.RLock()
        self._self_bind = False  # its directory is bound on itself (a pooled sandbox's is)
        self.destroyed = False

    # ---- lifecycle ----

    @property
    def _rw(self) -> str:
        return os.path.join(self.dir, "rw")

    @property
    def _mnt(self) -> str:
        return os.path.join(self.dir, "root")

    def _mount_fs(self) -> None:
        limits = self.spec.limits
        mount("tmpfs", self._rw, "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits.disk_mb}m,mode=755")
        os.mkdir(os.path.join(self._rw, "upper"), 0o755)
        os.mkdir(os.path.join(self._rw, "work"), 0o755)
        lower = ":".join(self.provider.images.layer_path(x) for x in self.lowers)
        # redirect_dir/metacopy off: a renamed or chmod-ed lower entry is copied up whole, so
        # the upper layer alone describes the change and can be frozen into a layer by copying.
        opts = (f"lowerdir={lower},upperdir={self._rw}/upper,workdir={self._rw}/work,"
                "redirect_dir=off,metacopy=off,index=off")
        if len(opts) < 4000:
            mount("overlay", self._mnt, "overlay", 0, opts)
            return
        try:  # a deep stack (forks of forks): one fsconfig call per layer
            mount_overlay(self._mnt, [self.provider.images.layer_path(x) for x in self.lowers],
                          f"{self._rw}/upper", f"{self._rw}/work",
                          {"redirect_dir": "off", "metacopy": "off", "index": "off"})
        except OSError as e:
            raise SandboxError(f"image: a stack of {len(self.lowers)} layers cannot be mounted: {e}") from None

    def _start_init(self, new_netns: bool, wait_go: bool = False) -> None:
        """Start the init helper. With wait_go (a pooled sandbox) it stops after entering the
        namespaces and cgroups and waits for `_go`; otherwise it is ready on return."""
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._address)
        self._listener.listen(64)
        fd = self._listener.fileno()
        args = [self.provider.agent, "--root", self._mnt, "--sock-fd", str(fd),
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--hostname", "sandbox",
                "--nofile", str(open_files(self.spec.limits)),
                "--netns-new" if new_netns else "--netns-join", os.path.join(self.dir, "netns")]
        assert self.cgroup is not None
        for f in self.cgroup.procs_files:
            args += ["--cgroup", f]
        if wait_go:
            args += ["--wait-go", "1"]
        else:
            for d in self.image.binds:
                args += ["--bind", f"/{d}:/{d}"]
        # init's own environment is the only one it keeps (commands get theirs with each
        # request): nothing of the host's (API keys) for /proc/1/environ to show
        self._waiter = subprocess.Popen(args, pass_fds=(fd,), env={"PATH": "/usr/bin:/bin"},
                                        stdin=subprocess.PIPE if wait_go else subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._listener.close()  # init holds its own copy; ours would keep the address alive
        self._listener = None
        self._await("W" if wait_go else "R")

    def _await(self, ready_line: str) -> None:
        assert self._waiter is not None and self._waiter.stdout is not None
        ready = False
        error = ""
        for raw in self._waiter.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("P "):
                self.init_pid = int(line[2:])
                with contextlib.suppress(OSError):  # (gone already: nothing to signal later)
                    self._init_fd = os.pidfd_open(self.init_pid)
            elif line == ready_line:
                ready = True
            elif line.startswith("E "):
                error = line[2:]
            if ready and self.init_pid:
                break
        if not ready or not self.init_pid:
            self._waiter.stdout.close()
            self._waiter.wait()
            raise SandboxError(f"sandbox {self.id} failed to start: {error or 'init exited'}")
        if ready_line == "R":
            self._waiter.stdout.close()
            self._root_fd = os.open(f"/proc/{self.init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self._kernel_devs = None  # a new init: its mount table is read again

    def _go(self) -> None:
        """Finish a pooled sandbox: its filesystem is mounted; tell init to enter it."""
        assert self._waiter is not None and self._waiter.stdin is not None
        binds = " ".join(f"/{d}:/{d}" for d in self.image.binds)
        self._waiter.stdin.write(f"G {open_files(self.spec.limits)} {binds}\n".encode())
        self._waiter.stdin.close()
        self._await("R")

    def _write_state(self) -> None:
        assert self.cgroup is not None
        state = {"id": self.id, "owner_pid": os.getpid(), "owner_start": _proc_start(os.getpid()),
                 "init_pid": self.init_pid, "init_start": _proc_start(self.init_pid) if self.init_pid else None,
                 "cgroups": self.cgroup.dirs, "cgroup_v2": self.cgroup.v2, "image": self.image.id,
                 "lowers": list(self.lowers)}
        tmp = os.path.join(self.dir, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.rename(tmp, os.path.join(self.dir, "state.json"))

    def _prepare(self, limits: Limits) -> None:
        os.makedirs(self._rw)
        os.mkdir(self._mnt)
        open(os.path.join(self.dir, "netns"), "w").close()
        self.cgroup = self.provider.cgroups.create(self.provider.cgroup_name(self.id),
                                                    _memory_cap_mb(limits), limits.pids,
                                                    limits.cpus)
        self._write_state()

    def _start(self) -> None:
        """Create directories, mounts, cgroups and the init (create without the pool)."""
        try:
            self._prepare(self.spec.limits)
            self._mount_fs()
            self._start_init(new_netns=True)
            self._finish_start()
        except BaseException:
            self._teardown(keep_dir=False)
            raise

    def _start_blank(self) -> None:
        """A pooled sandbox: namespaces, cgroups and init exist; no filesystem yet. Its
        directory is a shared bind mount so the filesystem mounted at claim propagates in."""
        try:
            self._prepare(self.spec.limits)
            mount(self.dir, self.dir, None, MS_BIND)
            self._self_bind = True
            mount("none", self.dir, None, MS_SHARED)
            self._start_init(new_netns=True, wait_go=True)
            self._write_state()
        except BaseException:
            self._teardown(keep_dir=False)
            raise

    def _claim(self, spec: SandboxSpec, image: Image, origin: Image) -> None:
        """Turn a pooled sandbox into the one asked for: limits, filesystem, go. Raises
        `_InitGone` when its init was found dead (killed while it waited in the pool)."""
        self.spec, self.image, self.lowers, self.source = spec, origin, image.layers, image.id
        try:
            assert self.cgroup is not None
            limits = spec.limits
            self.provider.cgroups.set_limits(self.cgroup, _memory_cap_mb(limits), limits.pids,
                                             limits.cpus)
            self._mount_fs()
            self._go()
            # state.json from the blank already names the init, cgroups and owner (all gc needs)
            self._attach_egress()
        except BaseException as e:
            gone = not self._init_alive()  # (asked before the teardown, which kills it)
            self._teardown(keep_dir=False)
            if gone and isinstance(e, Exception):
                raise _InitGone(f"sandbox {self.id}: its init was gone") from e
            raise

    def _init_alive(self) -> bool:
        """Whether init runs still: its pidfd turns readable when it exits."""
        if self._init_fd < 0:
            return self._waiter is not None and self._waiter.poll() is None
        poll = select.poll()
        poll.register(self._init_fd, select.POLLIN)
        return not poll.poll(0)

    def _finish_start(self) -> None:
        self._write_state()
        self._attach_egress()

    def _attach_egress(self) -> None:
        """Join the egress proxy and place its files (CA, resolver); should its variables or
        files fail, the attachment is undone (its address, rules and log would outlive the
        sandbox)."""
        if self.spec.egress is None:
            return
        binding = self.spec.egress.attach(self.id, self.init_pid)
        try:
            # its variables checked once, here (as the spec's are at create), and kept as
            # checked: a bad one refuses the sandbox rather than every command
            self.binding = dataclasses.replace(
                binding, env=dict(validate_env(binding.env, "egress env")))
            self._place_binding_files()
        except BaseException:
            with contextlib.suppress(Exception):
                self.spec.egress.detach(self.id)
            self.binding = EgressBinding()
            raise

    def _place_binding_files(self) -> None:
        for path, data in self.binding.files.items():
            self._write_as_root(sandbox_path(path), data)

    def _stop_processes(self) -> None:
        # init first: a shell running a command holds its lock until the command ends, which
        # init's end brings about at once (and not at the command's time limit)
        if self._root_fd >= 0:
            os.close(self._root_fd)  # it pins the sandbox's mount tree
            self._root_fd = -1
        if self._init_fd >= 0:  # through the pidfd: never a later process given its pid
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)  # pid 1: its whole pid ns
            os.close(self._init_fd)
            self._init_fd = -1
        try:
            if self.cgroup is not None:
                self.cgroup.kill()  # anything that got out of the pid ns the cgroup still holds
        finally:
            if self._waiter is not None:
                for pipe in (self._waiter.stdin, self._waiter.stdout):
                    if pipe is not None:
                        with contextlib.suppress(OSError):
                            pipe.close()
                self._waiter.wait()
                self._waiter = None
            self.init_pid = 0
            for sh in list(self._shells):
                sh.close()

    def _unmount_fs(self) -> None:
        """Detach the overlay and the tmpfs under it (both tried; the first failure raised)."""
        failed: list[OSError] = []
        for target in (self._mnt, self._rw):
            try:
                _umount_if_mounted(target)
            except OSError as e:
                failed.append(e)
        if failed:
            raise failed[0]

    def _teardown(self, keep_dir: bool) -> list[Exception]:
        """Undo what the start made: processes, mounts, cgroups, the directory. Each step is
        tried whatever became of the others (the directory only once nothing is mounted in
        it: it is never removed through a mount). What is left puts the id where `gc` finds
        it, and is logged; returns the failures, first first."""
        failed: list[tuple[str, Exception]] = []

        def attempt(what: str, step: Callable[[], object]) -> bool:
            try:
                step()
                return True
            except Exception as e:
                failed.append((what, e))
                return False

        attempt("processes", self._stop_processes)
        unmounted = attempt("mounts", self._unmount_fs)
        unmounted &= attempt("netns", lambda: _umount_if_mounted(os.path.join(self.dir, "netns")))
        if self._self_bind:  # a pooled sandbox's shared self-bind
            self._self_bind = not attempt("self-bind", lambda: _umount_if_mounted(self.dir))
            unmounted &= not self._self_bind
        if self.cgroup is not None:
            attempt("cgroups", self.cgroup.remove)
        if not keep_dir and unmounted:
            attempt("directory", lambda: shutil.rmtree(self.dir) if os.path.lexists(self.dir)
                    else None)
        if failed or (not keep_dir and os.path.lexists(self.dir)):
            self.provider._unfinished.add(self.id)
            left = "; ".join(f"{what}: {e}" for what, e in failed) or "the directory"
            log.warning("sandbox %s: teardown left %s; the provider's gc() removes what is left",
                        self.id, left)
        return [e for _, e in failed]

    def destroy(self) -> None:
        """Kill every process, unmount, remove cgroups and directories; idempotent."""
        with self._lock:
            if self.destroyed:
                return
            self.destroyed = True
            try:
                failed = self._teardown(keep_dir=False)  # (what is left is gc's)
                if failed:
                    raise failed[0]
            finally:
                if self.spec.egress is not None:
                    with contextlib.suppress(Exception):
                        self.spec.egress.detach(self.id)
                self.provider._forget(self.id)

    def _check_alive(self) -> None:
        if self.destroyed:
            raise NotFound(f"sandbox {self.id} was destroyed")

    # ---- exec ----

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        """A command's variables: the defaults, the spec's and the egress binding's (each
        checked once, at create and at attach), then the call's own ``extra``, checked here."""
        env = {"PATH": BASE_PATH, "HOME": SANDBOX_HOME, "USER": "user", "LOGNAME": "user",
               "LANG": "C.UTF-8", "SHELL": "/bin/bash", "TMPDIR": "/tmp",
               **self.spec.env, **self.binding.env}
        if extra is not None:
            env.update(validate_env(extra, "env"))
        return env

    def exec(self, command: str | Sequence[str], *, stdin: bytes | str | None = None,
             timeout: float | None = None, env: Mapping[str, str] | None = None,
             cwd: str | None = None) -> ExecResult:
        self._check_alive()
        if isinstance(command, str):
            if not command.strip():
                raise SandboxError("command: empty")
            argv = ["/bin/sh", "-c", command]
        elif isinstance(command, Sequence) and command and all(isinstance(a, str) for a in command):
            argv = list(command)
        else:
            raise SandboxError(f"command: expected a string or a non-empty list of strings, got {command!r}")
        if any("\0" in a for a in argv):
            raise SandboxError("command: NUL byte in an argument")
        limits = self.spec.limits
        timeout = limits.exec_timeout_s if timeout is None else seconds(timeout, "timeout")
        data = _utf8(stdin, "stdin") if isinstance(stdin, str) else stdin
        t0 = time.monotonic()
        proc = _Process(self._address, argv, self._env(env), sandbox_path(cwd or WORKSPACE, "cwd"))
        try:
            out, err, timed_out, truncated = _collect(proc, data, t0 + timeout, limits.max_output_bytes)
            _await_status(proc)
        finally:
            proc.close()
        code = _exit_code(proc.status) if proc.status is not None else 137
        return ExecResult(code, out.decode(errors="replace"), err.decode(errors="replace"),
                          timed_out=timed_out, truncated=truncated, duration_s=time.monotonic() - t0)

    def shell(self) -> LocalShell:
        self._check_alive()
        sh = LocalShell(self)
        self._shells.append(sh)
        return sh

    # ---- files (host side, resolved inside the sandbox root) ----

    @contextlib.contextmanager
    def _root(self) -> Iterator[_Root]:
        """The root one file call resolves its paths in: a copy of the root's fd and the
        devices of init's kernel file systems, both taken under the lock. A restore or destroy
        closes the sandbox's own fd and replaces init (that fd's number, or init's pid, may
        then name something else): with its own copy, a call waits for a restore under way or
        finishes in the tree it began in, and one after a destroy is refused (`NotFound`)."""
        with self._lock:
            self._check_alive()
            if self._root_fd < 0:
                raise SandboxError(f"sandbox {self.id} is not running")
            try:
                devs = self._kernel_devices()
            except OSError as e:  # (init gone, or no fd left to read its mount table)
                raise SandboxError(f"sandbox {self.id}: its mount table cannot be read "
                                   f"({e.strerror or e})") from None
            root = _Root(os.dup(self._root_fd), devs)
        try:
            yield root
        finally:
            os.close(root.fd)

    def _open(self, root: _Root, path: str, flags: int) -> int:
        """``path`` opened with ``flags`` where `_walk` leads, the last link followed too."""
        pfd, name = self._walk(root, path, follow=True)
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        except OSError as e:
            raise SandboxError(f"path: {path}: {e.strerror}") from None
        finally:
            os.close(pfd)

    def _walk(self, root: _Root, path: str, *, follow: bool = False, create: bool = False,
              as_root: bool = False) -> tuple[int, str]:
        """Where ``path`` leads as the sandbox user reaches it: an O_PATH fd of the directory
        holding its last entry (the caller's to close) and that entry's name, or "." where it
        ends at a directory walked (the root). The kernel's walk, one name at a time from the
        root, each directory looked in first checked (`_check_searchable`: one of the
        sandbox's own file systems, searchable by the user); a link is followed where it is
        found (an absolute one from the root, and `..` never above it), a last one only with
        ``follow``. The kernel follows no link itself, so nothing leads out of the root, and
        one fd is held at a time (a path may be thousands of directories deep). With
        ``create``, a directory missing on the way is made: as the user, who must be allowed
        to, or ``as_root`` for files the host places (the egress CA), which skips the user's
        checks."""
        todo = [n for n in reversed(path.split("/")) if n not in ("", ".")]  # the next last
        where: list[str] = []  # the names from the root to ``fd``, for `..` and messages
        fd = os.dup(root.fd)
        try:
            st, hops = os.fstat(fd), 0
            while todo:
                name = todo.pop()
                self._check_searchable(root, st, where, path, as_root)
                if name == "..":
                    if where:
                        parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC,
                                         dir_fd=fd)
                        os.close(fd)
                        fd, st = parent, os.fstat(parent)
                        where.pop()
                    continue
                if not todo and not follow:
                    return fd, name
                try:
                    entry = open_beneath(fd, name, os.O_PATH | os.O_NOFOLLOW)
                except FileNotFoundError:
                    if not todo:
                        return fd, name
                    if not create:
                        raise
                    self._make_dir(fd, name, "/" + "/".join([*where, name]), as_root)
                    entry = open_beneath(fd, name, os.O_PATH | os.O_NOFOLLOW)
                est = os.fstat(entry)
                if stat.S_ISLNK(est.st_mode):
                    os.close(entry)
                    hops += 1
                    if hops > 40:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                    target = os.readlink(name, dir_fd=fd)
                    if target.startswith("/"):
                        os.close(fd)
                        fd = os.dup(root.fd)
                        st = os.fstat(fd)
                        where.clear()
                    todo += [n for n in reversed(target.split("/")) if n not in ("", ".")]
                    continue
                if not todo:
                    os.close(entry)
                    return fd, name
                if not stat.S_ISDIR(est.st_mode):
                    os.close(entry)
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
                os.close(fd)
                fd, st = entry, est
                where.append(name)
            return fd, "."
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError):
                raise SandboxError(f"path: {path}: {e.strerror}") from None
            raise

    @staticmethod
    def _check_searchable(root: _Root, st: os.stat_result, where: list[str], path: str,
                          as_root: bool) -> None:
        """That `_walk` may look up a name in directory ``st`` (at ``where``) on the way to
        ``path``: one of the sandbox's own file systems (not its kernel's), and (unless
        ``as_root``) one the sandbox user may search."""
        if st.st_dev in root.kernel_devs:
            raise SandboxError(f"path: {path}: a kernel file system's (/proc, /sys, /dev); "
                               "read or write it with a command")
        if not as_root and not _user_may(st, SEARCH):
            raise SandboxError(f"path: {path}: permission denied (the sandbox user may not "
                               f"search /{'/'.join(where)})")

    def _make_dir(self, dir_fd: int, name: str, path: str, as_root: bool) -> None:
        """Make directory ``name`` of ``dir_fd`` (``path``): as the sandbox user, who must be
        allowed to, or as root. One made meanwhile is no error."""
        if not as_root:
            self._check_writable(dir_fd, path)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=dir_fd)
            if not as_root:
                os.chown(name, SANDBOX_UID, SANDBOX_GID, dir_fd=dir_fd, follow_symlinks=False)

    @staticmethod
    def _check_writable(dir_fd: int, path: str, name: str | None = None) -> None:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if name else os.fstat(dir_fd)
        if st.st_uid == SANDBOX_UID or st.st_mode & 0o002 or (st.st_gid == SANDBOX_GID and st.st_mode & 0o020):
            return
        raise SandboxError(f"path: {path}: permission denied (not writable by the sandbox user)")

    def _kernel_devices(self) -> set[int]:
        """The devices of the sandbox's kernel file systems (/proc, /sys, /dev and the like),
        from its init's mount table: the host-side file calls serve none of them. Their files
        are the host kernel's (a sysctl written through /proc/sys is written for the host), or
        never end (/dev/zero)."""
        if self._kernel_devs is None:
            devs = set()
            with open(f"/proc/{self.init_pid}/mountinfo") as f:
                for line in f:
                    fields, _, rest = line.partition(" - ")
                    parts = fields.split()
                    major, minor = parts[2].split(":")
                    where, fstype = parts[4], rest.split()[0]
                    if fstype in _KERNEL_FS or where.startswith(("/proc", "/sys", "/dev")):
                        devs.add(os.makedev(int(major), int(minor)))
            self._kernel_devs = devs
        return self._kernel_devs

    @staticmethod
    def _served(root: _Root, fd: int, path: str) -> os.stat_result:
        """``fd``'s stat, when it is a file the host-side calls serve: on the sandbox's own
        file systems, not its kernel's (reached through a symlink or named outright)."""
        st = os.fstat(fd)
        if st.st_dev in root.kernel_devs:
            raise SandboxError(f"path: {path}: a kernel file system's (/proc, /sys, /dev); "
                               "read or write it with a command")
        return st

    @staticmethod
    def _check_readable(st: os.stat_result, path: str) -> None:
        if _user_may(st, READ):
            return
        raise SandboxError(f"path: {path}: permission denied (not readable by the sandbox user)")

    @staticmethod
    def _check_max_bytes(max_bytes: int | None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(
                max_bytes, int) or max_bytes < 0):
            raise SandboxError(f"max_bytes: a count of bytes >= 0 expected, got {max_bytes!r}")

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        p = sandbox_path(path)
        self._check_max_bytes(max_bytes)
        with self._root() as root:
            fd = self._open(root, p, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens, refused below
            try:
                st = self._served(root, fd, p)
                if stat.S_ISDIR(st.st_mode):
                    raise SandboxError(f"path: {p} is a directory")
                if not stat.S_ISREG(st.st_mode):
                    raise SandboxError(f"path: {p} is not a regular file")
                self._check_readable(st, p)
                return self._read_all(fd, p, max_bytes)
            finally:
                os.close(fd)

    def _read_all(self, fd: int, p: str, max_bytes: int | None = None) -> bytes:
        """A regular file's bytes; refused past ``max_bytes``, as it stands or as it grows
        while read, and where more of it is holes than the sandbox's disk holds. Holes read as
        zeros: a `truncate -s 1T` (on the writable layer, or in a snapshot's layer, which keeps
        them), read whole, would take the host's memory. A file of the image may be bigger
        than that disk, with the bytes to show for it."""
        st = os.fstat(fd)
        size, disk = st.st_size, self.spec.limits.disk_mb
        if size - st.st_blocks * 512 > disk << 20:
            raise SandboxError(f"path: {p} holds {size} bytes, more than the sandbox's disk "
                               f"({disk} MB) of them in holes: read it with a command")
        if max_bytes is not None and size > max_bytes:
            raise FileTooLarge(p, size, max_bytes)
        chunks, read = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            read += len(chunk)
            if max_bytes is not None and read > max_bytes:
                raise FileTooLarge(p, read, max_bytes)
        return b"".join(chunks)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        p = sandbox_path(path)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, bytes | bytearray):
            raise SandboxError(f"data: expected bytes or str, got {type(data).__name__}")
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise SandboxError(f"mode: invalid file mode {mode!r}")
        with self._root() as root:  # never setuid/setgid: the host writes as root
            self._write(root, p, data, mode & 0o777)

    def _write(self, root: _Root, p: str, data: bytes | bytearray, mode: int) -> None:
        # a link is written where it points, with the checks of that place (as the sandbox
        # user writing through it would be); one put there since the walk is refused below
        pfd, name = self._walk(root, p, follow=True, create=True)
        try:
            try:
                existing = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                existing = None
            if existing is not None and stat.S_ISDIR(existing.st_mode):
                raise SandboxError(f"path: {p} is a directory")
            if existing is not None and not stat.S_ISREG(existing.st_mode):
                raise SandboxError(f"path: {p} is not a regular file")
            if existing is None:
                self._check_writable(pfd, p)
            else:
                self._check_writable(pfd, p, name)
            # in the directory checked (``p`` resolved again could lead elsewhere by now), no
            # following a symlink put there since, and no blocking on a FIFO
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, mode, dir_fd=pfd)
            created = False
            try:
                st = self._served(root, fd, p)
                if not stat.S_ISREG(st.st_mode):
                    raise SandboxError(f"path: {p} is not a regular file")
                created = existing is None and st.st_uid == 0 and st.st_size == 0
                if not created:  # the file opened: the one checked, or one the sandbox's
                    self._check_writable(fd, p)
                if created:  # (first: a file that then does not fit is the user's, and goes)
                    os.fchown(fd, SANDBOX_UID, SANDBOX_GID)
                if data:  # the room first (a sparse file has its size, not its room): a
                    os.posix_fallocate(fd, 0, len(data))  # write that does not fit leaves it
                if created or st.st_uid == SANDBOX_UID:
                    os.fchmod(fd, mode)
                view, at = memoryview(data), 0
                while at < len(view):  # over the old bytes, in the room they and the
                    at += os.pwrite(fd, view[at:], at)  # allocation hold; then cut
                os.ftruncate(fd, len(data))
            except OSError as e:
                if created:  # (what this call made, it takes back)
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=pfd)
                if e.errno == errno.ENOSPC:
                    raise SandboxError(f"path: {p}: the sandbox's disk limit "
                                       f"({self.spec.limits.disk_mb} MB) is exceeded") from None
                raise SandboxError(f"path: {p}: {e.strerror}") from None
            finally:
                os.close(fd)
        except OSError as e:
            raise SandboxError(f"path: {p}: {e.strerror}") from None
        finally:
            os.close(pfd)

    def _write_as_root(self, path: str, data: bytes) -> None:
        """Place a file (the egress CA) owned by root, readable by all; parents are created.
        What is there already and is not a regular file (a resolv.conf that links to a file of
        the host's systemd) is replaced, never followed."""
        with self._root() as root:
            pfd, name = self._walk(root, path, create=True, as_root=True)
            try:
                with contextlib.suppress(FileNotFoundError):
                    if not stat.S_ISREG(os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=pfd)
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=pfd)
            except OSError as e:
                raise SandboxError(f"path: {path}: {e.strerror}") from None
            finally:
                os.close(pfd)
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o644)
            view = memoryview(bytes(data))
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        """Remove a file, a link (never what it leads to) or a directory with all it holds, as
        the sandbox user could (`rm -rf`): refused at the first entry it could not remove, and
        what came before that is gone."""
        p = sandbox_path(path)
        if p == "/":
            raise SandboxError(f"path: {p!r} names the root")
        with self._root() as root:
            pfd, name = self._walk(root, p)
            try:
                try:
                    os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise SandboxError(f"path: {p}: no such file or directory") from None
                self._remove(pfd, name, p)
            except OSError as e:
                raise SandboxError(f"path: {p}: {e.strerror}") from None
            except RecursionError:
                raise SandboxError(f"path: {p}: nested too deep to remove here; remove it "
                                   "with a command") from None
            finally:
                os.close(pfd)

    def _remove(self, dir_fd: int, name: str, path: str) -> None:
        """Remove entry ``name`` of directory ``dir_fd`` (``path``), and first all it holds
        should it be a directory; each entry only where the sandbox user may remove it: its
        directory writable by the user, and when that is sticky (/tmp), the entry or the
        directory the user's."""
        self._check_writable(dir_fd, path)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        d = os.fstat(dir_fd)
        if d.st_mode & stat.S_ISVTX and SANDBOX_UID not in (d.st_uid, st.st_uid):
            raise SandboxError(f"path: {path}: permission denied (another user's, in a sticky "
                               "directory)")
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            return
        if not _user_may(st, READ | SEARCH):  # (to list what it holds, as `rm -rf` must;
            try:  # one that holds nothing goes, as there)
                os.rmdir(name, dir_fd=dir_fd)
                return
            except OSError:
                raise SandboxError(f"path: {path}: permission denied (the sandbox user may "
                                   "not list it)") from None
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
        try:
            for entry in os.listdir(fd):
                self._remove(fd, entry, posixpath.join(path, entry))
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=dir_fd)

    @staticmethod
    def _info(path: str, st: os.stat_result) -> FileInfo:
        m = st.st_mode
        kind = ("dir" if stat.S_ISDIR(m) else "file" if stat.S_ISREG(m)
                else "symlink" if stat.S_ISLNK(m) else "other")
        return FileInfo(path, kind, st.st_size, stat.S_IMODE(m), st.st_mtime)  # type: ignore[arg-type]

    def stat(self, path: str) -> FileInfo:
        p = sandbox_path(path)
        with self._root() as root:
            if p == "/":
                return self._info(p, os.fstat(root.fd))
            pfd, name = self._walk(root, p)
            try:
                return self._info(p, os.stat(name, dir_fd=pfd, follow_symlinks=False))
            except OSError as e:
                raise SandboxError(f"path: {p}: {e.strerror}") from None
            finally:
                os.close(pfd)

    def list_dir(self, path: str = WORKSPACE) -> list[FileInfo]:
        p = sandbox_path(path)
        with self._root() as root:
            fd = self._open(root, p, os.O_RDONLY | os.O_DIRECTORY)
            try:
                st = self._served(root, fd, p)
                self._check_readable(st, p)
                if not _user_may(st, SEARCH):  # (its entries' sizes and modes are asked for)
                    raise SandboxError(f"path: {p}: permission denied (not searchable by the "
                                       "sandbox user)")
                out = []
                for name in sorted(os.listdir(fd)):
                    with contextlib.suppress(FileNotFoundError):
                        out.append(self._info(os.path.join(p, name),
                                              os.stat(name, dir_fd=fd, follow_symlinks=False)))
                return out
            finally:
                os.close(fd)

    # ---- snapshot / fork / restore ----

    def _own_snapshot(self, snapshot: str) -> Image:
        """A snapshot of this sandbox's image (its layers over the image's): `changes` and
        `read_original` compare with that image, and would say nothing true of another."""
        image = self.provider.images.resolve(snapshot)
        n = len(self.image.layers)
        if image.base != self.image.base or tuple(image.layers[len(image.layers) - n:]) != \
                tuple(self.image.layers):
            raise SandboxError(f"snapshot: {snapshot!r} is not a snapshot of this sandbox's "
                               f"image {self.image.id!r}")
        return image

    def _snapshot_layers(self) -> list[str]:
        return list(self.lowers[: len(self.lowers) - len(self.image.layers)])

    def read_original(self, path: str, max_bytes: int | None = None) -> bytes:
        """The file's bytes as the image the sandbox was created from has them (what `changes`
        compares with): read from the image's layers, within the layer that holds it, where
        the sandbox user could have read it there (each directory on the way searchable, the
        file readable); refused past ``max_bytes`` (`FileTooLarge`) before it is read."""
        self._check_alive()
        p = sandbox_path(path)
        self._check_max_bytes(max_bytes)
        rel = p.lstrip("/")
        store = self.provider.images
        with LayerStack([store.layer_path(x) for x in self.image.layers]) as stack:
            # (the path as written, as `changes` names it: no link on it)
            parts = rel.split("/")
            for i in range(1, len(parts)):  # (the root: the writable layer's, 0755)
                d = stack.lookup("/".join(parts[:i]))
                if d is not None and stat.S_ISDIR(d[1].st_mode) and not _user_may(d[1], SEARCH):
                    raise SandboxError(f"path: {p}: permission denied (the sandbox user may not "
                                       f"search /{'/'.join(parts[:i])} in the image)")
            found = stack.lookup(rel)
            if found is None:
                raise SandboxError(f"path: {p}: not in the sandbox's image (as written: a link "
                                   "on the way is not followed)")
            top, st = found
            if stat.S_ISREG(st.st_mode):
                self._check_readable(st, p)
            fd = stack.open(top, rel, st) if stat.S_ISREG(st.st_mode) else None
        if fd is None:
            raise SandboxError(f"path: {p} is not a regular file in the sandbox's image")
        try:
            return self._read_all(fd, p, max_bytes)
        finally:
            os.close(fd)

    def changes(self) -> list[Change]:
        """Paths under /workspace that differ from the image the sandbox was created from:
        compares the current stack (upper + snapshot layers) with the image's stack. The
        sandbox's tasks are frozen meanwhile, as for a snapshot, and its writable layer is read
        as `walk_tree` reads it: nothing a command puts there (a link, a FIFO) leads the host
        elsewhere or stops it."""
        with self._lock:
            self._check_alive()
            assert self.cgroup is not None
            store = self.provider.images
            upper = os.path.join(self._rw, "upper")
            try:
                self.cgroup.freeze(True)  # (and thawed below, should the freeze time out)
                with LayerStack([upper, *(store.layer_path(x) for x in self.lowers)]) as now, \
                        LayerStack([store.layer_path(x) for x in self.image.layers]) as then:
                    return self._changes(now, then)
            finally:
                self.cgroup.freeze(False)

    def _changes(self, now: LayerStack, then: LayerStack) -> list[Change]:
        """`changes`, between the stacks of the sandbox (``now``) and of its image."""
        store = self.provider.images
        changed_layers = [now.dirs[0], *(store.layer_path(x) for x in self._snapshot_layers())]
        ws = WORKSPACE.strip("/")
        candidates: set[str] = set()
        for top in changed_layers:
            for rel_dir, _, entries in walk_tree(top, under=ws):
                candidates.update(posixpath.join(rel_dir, n) for n, _ in entries)
                if rel_dir != ws:
                    # an opaque directory hides everything the image had below it
                    candidates.update(posixpath.join(rel_dir, n) for n in then.listdir(rel_dir))
        out: list[Change] = []
        for rel in sorted(candidates):
            a, b = then.lookup(rel), now.lookup(rel)
            sa = a[1] if a else None
            sb = b[1] if b else None
            if sa is not None and stat.S_ISDIR(sa.st_mode):
                if sb is not None and stat.S_ISDIR(sb.st_mode):
                    continue
                # an image directory removed, or replaced by a file or a link: what it held
                # is gone too (a whiteout hides the image's entries, which no walk above sees)
                gone = _files_below(then, rel)
                out += [Change("/" + f, "deleted") for f in gone] or [Change("/" + rel, "deleted")]
                if sb is not None:
                    out.append(Change("/" + rel, "added"))
                continue
            if sa is None and sb is not None and stat.S_ISDIR(sb.st_mode):
                if not now.listdir(rel):
                    out.append(Change("/" + rel, "added"))  # an empty new directory
                continue
            if sa is None and sb is None:
                continue
            if sb is None:
                out.append(Change("/" + rel, "deleted"))
            elif sa is None:
                out.append(Change("/" + rel, "added"))
            elif not _same_entry(rel, then, a, now, b):  # type: ignore[arg-type]
                out.append(Change("/" + rel, "modified"))
        return sorted(set(out), key=lambda c: c.path)

    def snapshot(self) -> str:
        """Freeze the writable layer (cgroup frozen while it is copied) into a new layer; the
        snapshot is an image [that layer, *current lowers]. Returns its id."""
        with self._lock:
            self._check_alive()
            store = self.provider.images
            upper = os.path.join(self._rw, "upper")
            if not os.listdir(upper):
                return store.put_image(self.lowers, self.image.base, meta={"kind": "snapshot", "of": self.id}).id
            assert self.cgroup is not None
            with store.build_dir() as tmp:
                try:
                    self.cgroup.freeze(True)  # (and thawed below, should the freeze time out)
                    copy_layer_tree(upper, tmp)
                finally:
                    self.cgroup.freeze(False)
                layer = store.commit_layer(tmp)
            # overlayfs refuses the same directory twice in one stack (ELOOP). The same content
            # on top of itself changes nothing; deeper in the stack it needs its own copy.
            if self.lowers and layer == self.lowers[0]:
                layers = list(self.lowers)
            elif layer in self.lowers:
                layers = [store.copy_layer(layer, salt=",".join(self.lowers)), *self.lowers]
            else:
                layers = [layer, *self.lowers]
            return store.put_image(layers, self.image.base, meta={"kind": "snapshot", "of": self.id}).id

    def fork(self, n: int = 1, snapshot: str | None = None) -> list[LocalSandbox]:
        """N sandboxes from ``snapshot``, or from one taken now; should one of them fail to
        start, those made are destroyed, and so is a snapshot taken here that no other
        image was (nothing else can know its id)."""
        if not isinstance(n, int) or n < 1:
            raise SandboxError(f"n: must be a positive integer, got {n!r}")
        since = time.time()
        snap = snapshot or self.snapshot()
        image = self._own_snapshot(snap)
        spec = dataclasses.replace(self.spec, image=image.id)
        out: list[LocalSandbox] = []
        try:
            for _ in range(n):
                out.append(self.provider._create(spec, image, origin=self.image))
        except BaseException:
            for sb in out:
                sb.destroy()
            if snapshot is None and self._made_since(snap, since):
                with contextlib.suppress(SandboxError, OSError):  # (kept if named or in use)
                    self.provider.images.remove(snap)
            raise
        return out

    def _made_since(self, snapshot: str, since: float) -> bool:
        """Whether ``snapshot`` is an image this sandbox's `snapshot` wrote at ``since`` or
        later: the same layers snapshotted before are that image again, which its taker
        may still hold."""
        try:
            with open(self.provider.images._image_file(snapshot)) as f:
                doc = json.load(f)
        except (OSError, ValueError, SandboxError):
            return False
        return doc.get("of") == self.id and doc.get("created", 0) >= since

    def restore(self, snapshot: str) -> None:
        """Kill every process, then mount a fresh writable layer over the snapshot's layers
        (same id, same network namespace, so an egress attachment stays valid)."""
        with self._lock:
            self._check_alive()
            image = self._own_snapshot(snapshot)
            self._stop_processes()
            self._shells.clear()
            self.lowers, self.source = image.layers, image.id
            try:
                self._unmount_fs()
                self._mount_fs()
                self._start_init(new_netns=False)
                self._write_state()
                self._place_binding_files()  # the attachment stays: the same network namespace
            except BaseException:
                self.destroy()  # detaches it
                raise


def _same_entry(rel: str, then: LayerStack, a: tuple[str, os.stat_result], now: LayerStack,
                b: tuple[str, os.stat_result]) -> bool:
    """Whether entry ``rel`` is the same in the image (``a``, as `LayerStack.lookup` found it
    in ``then``) and now (``b``, in ``now``): type, mode, link target, bytes. An entry that
    changed as it was looked at is not."""
    (top_a, sa), (top_b, sb) = a, b
    if stat.S_IFMT(sa.st_mode) != stat.S_IFMT(sb.st_mode) or stat.S_IMODE(sa.st_mode) != stat.S_IMODE(sb.st_mode):
        return False
    if stat.S_ISLNK(sa.st_mode):
        target = then.readlink(top_a, rel)
        return target is not None and target == now.readlink(top_b, rel)
    if stat.S_ISREG(sa.st_mode):
        if sa.st_size != sb.st_size:
            return False
        if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):  # one file of one layer
            return True
        fa = then.open(top_a, rel, sa)
        fb = None
        try:
            fb = now.open(top_b, rel, sb) if fa is not None else None
            return fb is not None and _same_bytes(fa, fb, sa.st_size)  # type: ignore[arg-type]
        finally:
            for fd in (fa, fb):
                if fd is not None:
                    os.close(fd)
    return True


def _same_bytes(fa: int, fb: int, size: int) -> bool:
    """Whether two files of ``size`` bytes hold the same bytes, read where either holds data:
    where both have holes, both read as zeros (a sparse file costs its data, not its size)."""
    pos = 0  # compared up to here
    for start, end in sorted([*data_extents(fa, size), *data_extents(fb, size)]):
        start = max(start, pos)
        while start < end:
            n = min(1 << 20, end - start)
            x, y = os.pread(fa, n, start), os.pread(fb, n, start)
            if x != y:
                return False
            if not x:
                break
            start += len(x)
        pos = max(pos, end)
    return True


class LocalProvider:
    """Creates and tracks local sandboxes; `images` builds what they run.

    >>> provider = LocalProvider(root="/tmp/store")
    >>> image = provider.images.from_directory("myrepo", name="myrepo")
    >>> sb = provider.create(SandboxSpec(image="myrepo"))
    """

    def __init__(self, root: str | None = None, *, pool_size: int = 4):
        # its real path: the mount table names layers by it, whatever link a caller took to it
        # (`ImageStore.prune` keeps what any process has mounted)
        self.root = os.path.realpath(store_root(root))
        _raise_nofile_limit()
        self.sandboxes_dir = os.path.join(self.root, "sandboxes")
        os.makedirs(self.sandboxes_dir, exist_ok=True)
        _ensure_tmpfs(self.sandboxes_dir)
        self.images = ImageStore(self.root, self)
        self.cgroups = CgroupManager()
        self.agent = agent_binary(self.root)
        self._tag = hashlib.sha256(self.root.encode()).hexdigest()[:8]
        self._sandboxes: dict[str, LocalSandbox] = {}
        self._unfinished: set[str] = set()  # destroyed sandboxes whose teardown failed
        self._lock = threading.Lock()
        # The pool: sandboxes whose processes already sit in their namespaces and cgroups.
        # Joining a v1 memory cgroup waits for an RCU grace period (~5-20 ms), the largest
        # cost of a create; pooled sandboxes pay it ahead of time, off the critical path.
        self.pool_size = pool_size
        self._pool: list[LocalSandbox] = []
        self._filling: set[str] = set()  # blanks the pool's thread is starting (not yet pooled)
        self._pool_cv = threading.Condition()
        self._pool_thread: threading.Thread | None = None
        self._closed = False
        self._last_take = 0.0
        # Sandboxes must not outlive the process that made them (pooled ones belong to no
        # caller at all); after a hard crash, `gc` finds what is left.
        atexit.register(_close_at_exit, weakref.ref(self))

    def cgroup_name(self, sandbox_id: str) -> str:
        return f"{self._tag}-{sandbox_id}"

    def create(self, spec: SandboxSpec) -> LocalSandbox:
        if not isinstance(spec, SandboxSpec):
            raise SandboxError("spec: expected a SandboxSpec")
        image = self.images.resolve(spec.image)
        return self._create(spec, image, origin=image)

    def _create(self, spec: SandboxSpec, image: Image, origin: Image) -> LocalSandbox:
        with _fd_exhaustion_named("no sandbox can be started"):
            return self._make(spec, image, origin)

    def _make(self, spec: SandboxSpec, image: Image, origin: Image) -> LocalSandbox:
        validate_limits(spec.limits)
        # Checked here once (every command would fail on a bad one), and kept as checked: a
        # later change to the caller's mapping reaches no command.
        spec = dataclasses.replace(spec, env=dict(validate_env(spec.env, "spec.env")))
        blank = self._take_blank()
        if blank is not None:
            with self._lock:
                self._sandboxes[blank.id] = blank
            try:
                blank._claim(spec, image, origin)
                return blank
            except _InitGone:
                self._forget(blank.id)  # (torn down) and made below instead
            except BaseException:
                self._forget(blank.id)
                raise
        sandbox_id = "sb-" + uuid.uuid4().hex[:12]
        sb = LocalSandbox(self, sandbox_id, spec, origin)
        sb.lowers, sb.source = image.layers, image.id
        with self._lock:
            self._sandboxes[sandbox_id] = sb
        try:
            sb._start()
        except BaseException:
            self._forget(sandbox_id)
            raise
        return sb

    # ---- the pool ----

    def _take_blank(self) -> LocalSandbox | None:
        """A pooled sandbox whose init runs, or None; those whose init died while they
        waited are torn down."""
        if self.pool_size <= 0 or self._closed:
            return None
        dead: list[LocalSandbox] = []
        with self._pool_cv:
            if self._pool_thread is None:
                self._pool_thread = threading.Thread(target=self._fill_pool, name="sandbox-pool", daemon=True)
                self._pool_thread.start()
            blank = None
            while self._pool and blank is None:
                blank = self._pool.pop()
                if not blank._init_alive():
                    dead.append(blank)
                    blank = None
            self._last_take = time.monotonic()
            self._pool_cv.notify_all()
        for b in dead:
            b._teardown(keep_dir=False)
        return blank

    def _fill_pool(self) -> None:
        while True:
            with self._pool_cv:
                while not self._closed and len(self._pool) >= self.pool_size:
                    self._pool_cv.wait()
                if self._closed:
                    return
            # Refill only once creates pause: the filler shares the GIL (and on a small host
            # the CPUs) with the create it would otherwise slow down.
            while time.monotonic() - self._last_take < POOL_REFILL_DELAY_S and not self._closed:
                time.sleep(POOL_REFILL_DELAY_S / 2)
            blank = LocalSandbox(self, "sb-" + uuid.uuid4().hex[:12], SandboxSpec(image=""),
                                 Image("", (), "host"))
            with self._pool_cv:  # (its directory is there before its state: `gc` leaves it)
                self._filling.add(blank.id)
            try:
                blank._start_blank()
            except Exception:
                with self._pool_cv:
                    self._filling.discard(blank.id)
                time.sleep(0.5)  # e.g. out of pids; creates fall back to the direct path
                continue
            with self._pool_cv:
                self._filling.discard(blank.id)
                if self._closed:
                    blank._teardown(keep_dir=False)
                    return
                self._pool.append(blank)

    def drain_pool(self) -> None:
        """Tear down the pooled sandboxes (they are refilled on the next create)."""
        with self._pool_cv:
            pool, self._pool = self._pool, []
            thread, self._pool_thread = self._pool_thread, None
            self._closed = True
            self._pool_cv.notify_all()
        if thread is not None:
            thread.join()
        for blank in pool:
            blank._teardown(keep_dir=False)
        with self._pool_cv:
            self._closed = False

    def get(self, sandbox_id: str) -> LocalSandbox:
        with self._lock:
            sb = self._sandboxes.get(sandbox_id)
        if sb is None:
            raise NotFound(f"sandbox_id: no live sandbox {sandbox_id!r}")
        return sb

    def list(self) -> list[LocalSandbox]:
        with self._lock:
            return list(self._sandboxes.values())

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox_id, None)

    def close(self) -> None:
        """Destroy every sandbox this provider created, and the pool."""
        self.drain_pool()
        for sb in self.list():
            sb.destroy()

    def remove_store(self) -> None:
        """Remove the whole store: `close`, every sandbox in it cleaned up (`gc` of all
        owners), the tmpfs its sandbox directories live on detached, and its files deleted.
        For a store made for one run (a test session, a benchmark): no other process may be
        using it. Deleting the folder alone leaves that tmpfs mounted."""
        self.close()
        self.gc(all_owners=True)
        _umount_if_mounted(self.sandboxes_dir)
        remove_tree(self.root)

    def gc(self, *, all_owners: bool = False) -> list[str]:
        """Clean up sandboxes whose owning process is gone (a crash), and this process's own
        whose teardown left something (a failed `destroy` or create): processes, cgroups,
        mounts, directories. With all_owners, also those of live processes other than this
        one. Then what builds no process runs any more left under the store's tmp/
        (`ImageStore.remove_abandoned_builds`), and layers no image names (`ImageStore.prune`).
        Returns the sandbox ids cleaned."""
        cleaned: list[str] = []
        sdir = os.path.join(self.root, "sandboxes")
        mounts = _mounts_under(sdir)  # (read once: the host's table may be long)
        with self._pool_cv:
            live = set(self._sandboxes) | {b.id for b in self._pool} | self._filling
        for sid in sorted(os.listdir(sdir)):
            if sid in live:
                continue
            d = os.path.join(sdir, sid)
            state: dict = {}
            with contextlib.suppress(OSError, ValueError), open(os.path.join(d, "state.json")) as f:
                state = json.load(f)
            owner = state.get("owner_pid")
            owner_alive = bool(owner) and _proc_start(owner) == state.get("owner_start")
            ours = owner == os.getpid()
            if owner_alive and (ours and sid not in self._unfinished or not ours and not all_owners):
                continue
            init = state.get("init_pid")
            if init and _proc_start(init) == state.get("init_start"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)
            cg = Cgroup(state.get("cgroups") or {}, bool(state.get("cgroup_v2")))
            with contextlib.suppress(OSError, TimeoutError):
                cg.kill()
            mine = [m for m in mounts if m == d or m.startswith(d + "/")]
            for target in sorted(mine, key=len, reverse=True):
                with contextlib.suppress(OSError):
                    umount(target, MNT_DETACH)
            with contextlib.suppress(OSError, TimeoutError):
                cg.remove()
            remove_tree(d)  # (a writable layer still there may be deeper than rmtree goes)
            if os.path.lexists(d):
                continue  # (still this process's to clean, at the next gc)
            self._unfinished.discard(sid)
            cleaned.append(sid)
        # Cgroups of this store that no sandbox directory accounts for.
        for name, cg in self.cgroups.existing().items():
            tag, _, sid = name.partition("-")
            if tag == self._tag and sid not in live and not os.path.isdir(os.path.join(sdir, sid)):
                with contextlib.suppress(OSError, TimeoutError):
                    cg.kill()
                    cg.remove()
                self._unfinished.discard(sid)  # (a teardown that removed all but these)
                if sid not in cleaned:
                    cleaned.append(sid)
        self.images.remove_abandoned_builds()
        try:
            self.images.prune()
        except SandboxError as e:  # (an image file it cannot read: nothing deleted)
            log.warning("gc: %s", e)
        return cleaned
