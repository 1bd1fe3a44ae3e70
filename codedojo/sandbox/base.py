"""The sandbox contract: what every sandbox kind (local namespaces, the service's client) offers.

Paths given to a sandbox are paths inside it; a relative path is relative to `/workspace`.
The sandbox alone decides what a path may touch: a path that escapes its root raises
`SandboxError`, never reaches the host.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

WORKSPACE = "/workspace"


class SandboxError(Exception):
    """A request the sandbox refuses (bad path, missing layer, limit exceeded, unknown id)."""


class NotFound(SandboxError):
    """An unknown or destroyed sandbox, or an unknown shell (the service's 404; its client
    raises it for every 404, an image a route names included)."""


class FileTooLarge(SandboxError):
    """`Sandbox.read_file` of a file longer than the ``max_bytes`` asked for."""

    def __init__(self, path: str, size: int, max_bytes: int) -> None:
        super().__init__(f"path: {path} holds {size} bytes, more than the {max_bytes} asked for")
        self.path, self.size, self.max_bytes = path, size, max_bytes


MAX_SECONDS = 7 * 24 * 3600.0  # a time limit past a week is a mistake (and 1e300 overflows)


def seconds(value: object, field: str) -> float:
    """A time limit: a number of seconds in (0, MAX_SECONDS] (NaN would pass every deadline
    check unnoticed)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not 0 < value <= MAX_SECONDS:
        raise SandboxError(f"{field}: must be a finite number of seconds > 0, at most "
                           f"{MAX_SECONDS:g}, got {value!r}")
    return float(value)



@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False  # a stream past Limits.max_output_bytes: its start and end kept
    duration_s: float = 0.0


@dataclass(frozen=True)
class FileInfo:
    path: str  # inside the sandbox, absolute
    kind: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


OPEN_FILES = 4096  # a command's open files, unless its `Limits` say otherwise


@dataclass(frozen=True)
class Limits:
    """What one sandbox may take of the host.

    Its disk is memory (a tmpfs). What its processes write there is charged to the sandbox's
    memory cgroup, whose limit is therefore ``memory_mb + disk_mb``: a full disk is ENOSPC to
    the writer, and its processes keep ``memory_mb`` beside it. What the host writes for it
    (`write_file`: the agent's file tools) is charged to the host's process, so a sandbox
    holds at most ``memory_mb + 2 * disk_mb`` of the host's RAM."""

    memory_mb: int = 2048  # its processes' at least: up to memory_mb + disk_mb, the disk empty
    pids: int = 512
    cpus: float = 1.0
    disk_mb: int = 2048  # size cap of the writable layer (RAM: see above)
    exec_timeout_s: float = 120.0  # default wall-clock limit of one command
    max_output_bytes: int = 1 << 20  # per stream
    # per process of a command (RLIMIT_NOFILE, soft = hard); None: `OPEN_FILES`, or the
    # host's hard limit where that is lower
    open_files: int | None = None


def cut_line(n: int) -> str:
    """The line a stream past `Limits.max_output_bytes` holds between its start and its end."""
    return f"[... {n} bytes cut by the sandbox ...]"


CUT_LINE = re.compile(r"\[\.\.\. \d+ bytes cut by the sandbox \.\.\.\]")  # `cut_line`'s


@dataclass(frozen=True)
class Change:
    """One path under /workspace that differs from the image (what the agent did)."""

    path: str
    kind: Literal["added", "modified", "deleted"]


@dataclass(frozen=True)
class EgressBinding:
    """What an egress attachment gives a sandbox: variables for every command (proxy, CA bundle)
    and files to place inside it (the proxy's CA certificate)."""

    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, bytes] = field(default_factory=dict)


@runtime_checkable
class EgressAttachment(Protocol):
    """The hook through which the egress proxy becomes a sandbox's only way out.

    The sandbox calls `attach` once its (empty) network namespace exists and before any user
    command runs; `netns_pid` is a process inside that namespace (`/proc/<pid>/ns/net`). It calls
    `detach` when the sandbox is destroyed. Without an attachment a sandbox has no network at all.

    The namespace lives as long as the sandbox: `restore` keeps it (and writes `files` again into
    the fresh writable layer), so `attach` runs once per sandbox; each fork is a new sandbox
    with its own namespace and its own `attach`. `netns_pid` is the sandbox's init, which a
    restore replaces: configure the namespace during `attach` rather than keeping the pid.
    """

    def attach(self, sandbox_id: str, netns_pid: int) -> EgressBinding: ...

    def detach(self, sandbox_id: str) -> None: ...


@dataclass
class SandboxSpec:
    image: str  # image id (content address) or name
    limits: Limits = field(default_factory=Limits)
    env: Mapping[str, str] = field(default_factory=dict)
    egress: EgressAttachment | None = None  # None = no network at all


@runtime_checkable
class Shell(Protocol):
    """A persistent shell: cwd and exported variables survive between calls."""

    # Whether the last `run` ended the shell's process (an `exit`, `set -e` on a failure, a
    # kill, a timeout): the next `run` starts a fresh one in /workspace, without its variables.
    exited: bool

    def run(self, command: str, timeout: float | None = None) -> ExecResult: ...

    def close(self) -> None: ...


class Executor(Protocol):
    """Runs one command somewhere and waits for it: every sandbox, and the bench's host runner."""

    def exec(
        self,
        command: str | Sequence[str],
        *,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run one command (a string goes through `sh -c`) and wait for it."""
        ...


@runtime_checkable
class Sandbox(Executor, Protocol):
    id: str

    def shell(self) -> Shell: ...

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """A regular file's bytes (through a link inside the sandbox). ``max_bytes``: a longer
        file is refused (`FileTooLarge`) before it is read, and one grown past it while read."""
        ...

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    def remove(self, path: str) -> None: ...

    def list_dir(self, path: str = WORKSPACE) -> list[FileInfo]: ...

    def stat(self, path: str) -> FileInfo: ...

    def changes(self) -> list[Change]:
        """Paths under /workspace that differ from the image the sandbox started from."""
        ...

    def read_original(self, path: str, max_bytes: int | None = None) -> bytes:
        """A file's bytes in the image the sandbox started from (the other side of `changes`,
        by the path as it names it: a link on the way is not followed); SandboxError where the
        image has no regular file there. ``max_bytes``: as `read_file`'s, a longer file is
        refused (`FileTooLarge`) before it is read."""
        ...

    def snapshot(self) -> str:
        """Freeze the writable layer into a new read-only layer; returns the snapshot id."""
        ...

    def fork(self, n: int = 1, snapshot: str | None = None) -> list[Sandbox]:
        """N new sandboxes starting from `snapshot` (a fresh snapshot when None)."""
        ...

    def restore(self, snapshot: str) -> None:
        """Roll the filesystem back to `snapshot`; running processes are killed."""
        ...

    def destroy(self) -> None: ...


class SandboxProvider(Protocol):
    """Creates sandboxes: the local kind and the service client share this shape."""

    def create(self, spec: SandboxSpec) -> Sandbox: ...

    def get(self, sandbox_id: str) -> Sandbox: ...


# The sandbox service's token: given to callers through the environment, or read from the store
TOKEN_ENV = "CODEDOJO_SANDBOX_TOKEN"


def token_path(root: str) -> str:
    """Where a store keeps its service's token (readable by its owner only)."""
    return os.path.join(root, "service.token")
