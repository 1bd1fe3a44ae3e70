"""What an episode changed in its sandbox, for the rewards: (path, before, after) texts.

`before` is the file as the sandbox's image had it (`Sandbox.read_original`, the other side of
`Sandbox.changes`), whatever changed it: a file tool, the shell, a build. `after` is read from
the sandbox. A file that is binary or too large on either side is no text change, and left
out (not reported as deleted); so is one where the image has no regular file to read (a link,
which `read_original` does not follow: `sed -i` on it leaves a file, not a new one). One that
the episode made so (it was text, or not there, in the image), or left there unreadable
(its mode, holes past the sandbox's disk), is named in `RewardContext.unread` where it is a
source file the rewards charge for (`codedojo.reward.auxiliary.UNREAD_CHARGED`; another's
original is not even read): size or a NUL byte does not hide what the episode
wrote in a source file from the rewards that read it, which charge a fixed cost for it
(`codedojo.reward.auxiliary.UNREAD_COST`), since its text, of any length, is not read.
What is read into the host, both sides of every change, is `MAX_TOTAL_BYTES` at most (a
sandbox's sparse files cost it little disk), the source files the rewards read first: past
it, a changed source file still there is named in `unread`, the rest left out.

`reward_context` gathers what the rewards read of a finished episode: the changes, and the
workspace's ruff configuration as the image had it, so that `lint_delta` lints by the
repository's rules, and an episode that edits them changes nothing of its own score.
"""

from __future__ import annotations

from codedojo.harness.lint import CONFIG_FILES
from codedojo.harness.trajectory import Trajectory
from codedojo.reward.auxiliary import UNREAD_CHARGED
from codedojo.reward.base import FileChange, RewardContext, TestReport
from codedojo.sandbox.base import WORKSPACE, FileTooLarge, Sandbox, SandboxError

MAX_BYTES = 1_000_000  # of one file, on either side
# of all the files read into the host, both sides of every change: many times what an episode
# changes in source, where each file's MAX_BYTES alone, over a sandbox's sparse files, is not
MAX_TOTAL_BYTES = 64 << 20

_UNREADABLE = object()  # binary, too large, or no file the host can read: not a text


def _text(data: bytes | object | None) -> str | object | None:
    if not isinstance(data, bytes):
        return data
    if len(data) > MAX_BYTES or b"\x00" in data[:8192]:
        return _UNREADABLE
    return data.decode("utf-8", "replace")


def _after(sandbox: Sandbox, path: str) -> bytes | object | None:
    """The sandbox's side of a changed path: None where there is no file (or a directory),
    `_UNREADABLE` where there is one it cannot read (too large, its mode, holes past its disk,
    a link leading nowhere readable)."""
    try:
        return sandbox.read_file(path, max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return None
    except FileTooLarge:
        return _UNREADABLE
    except SandboxError:
        try:
            return None if sandbox.stat(path).kind == "dir" else _UNREADABLE
        except (FileNotFoundError, SandboxError):  # (gone since)
            return None


def _before(sandbox: Sandbox, path: str) -> bytes | object | None:
    """The image's side of a path: `_UNREADABLE` where the image has no regular file there read
    whole within `MAX_BYTES` (a link, which `read_original` does not follow, a directory, a
    larger file). `_collect` asks it only of paths the image has (`Sandbox.changes` says)."""
    try:
        return sandbox.read_original(path, max_bytes=MAX_BYTES)
    except FileNotFoundError:
        return None
    except SandboxError:  # (FileTooLarge among them)
        return _UNREADABLE


def collect_changes(sandbox: Sandbox) -> list[FileChange]:
    """The text files the episode added, modified or deleted under /workspace."""
    return _collect(sandbox)[0]


def _collect(sandbox: Sandbox) -> tuple[list[FileChange], list[str]]:
    """`collect_changes`, and the files the episode left no text where the image had text or
    none (`RewardContext.unread`)."""
    out: list[FileChange] = []
    unread: list[str] = []
    left = MAX_TOTAL_BYTES
    paths = [(ch.path if ch.path.startswith("/") else f"{WORKSPACE}/{ch.path}", ch.kind)
             for ch in sandbox.changes()]
    # the source files the rewards read first, then the rest, each in the order of `changes`:
    # the total's room goes to them before a build's or a download's output
    for path, kind in sorted(paths, key=lambda p: not p[0].endswith(UNREAD_CHARGED)):
        charged = path.endswith(UNREAD_CHARGED)
        if left < 2 * MAX_BYTES:  # (both sides might not fit: neither is read)
            if charged and kind != "deleted":
                unread.append(path)
            continue
        data = None if kind == "deleted" else _after(sandbox, path)
        left -= len(data) if isinstance(data, bytes) else 0
        after = _text(data)
        if after is _UNREADABLE and not charged:
            continue  # (nothing to compare, nothing charged: the image's side is not read)
        data = None if kind == "added" else _before(sandbox, path)
        left -= len(data) if isinstance(data, bytes) else 0
        before = _text(data)
        if before is _UNREADABLE or before == after:  # directories: None on both
            continue
        if after is _UNREADABLE:
            unread.append(path)
            continue
        out.append(FileChange(path, before, after))  # type: ignore[arg-type]
    order = {path: i for i, (path, _) in enumerate(paths)}  # (as `changes` lists them)
    return sorted(out, key=lambda c: order[c.path]), sorted(unread, key=order.__getitem__)


def image_lint_configs(sandbox: Sandbox) -> dict[str, str]:
    """The ruff configuration files at /workspace as the image had them."""
    configs = {}
    for name in CONFIG_FILES:
        text = _text(_before(sandbox, f"{WORKSPACE}/{name}"))
        if isinstance(text, str):
            configs[name] = text
    return configs


def reward_context(trajectory: Trajectory, sandbox: Sandbox,
                   tests: TestReport | None = None) -> RewardContext:
    """What the rewards read of a finished episode whose sandbox is still alive."""
    changes, unread = _collect(sandbox)
    return RewardContext(trajectory, tests, changes, image_lint_configs(sandbox), unread)
