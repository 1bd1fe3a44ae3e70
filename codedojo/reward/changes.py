"""What an episode changed in its sandbox, for the rewards: (path, before, after) texts.

`before` is the file as the sandbox's image had it (`Sandbox.read_original`, the other side of
`Sandbox.changes`), whatever changed it: a file tool, the shell, a build. `after` is read from
the sandbox. A file that is binary or too large on either side is no text change, and left
out (not reported as deleted). One that the episode made so (it was text, or not there, in the
image) is named in `RewardContext.unread` where it is a source file the rewards charge for
(`codedojo.reward.auxiliary.UNREAD_CHARGED`; another's original is not even read): size or a
NUL byte does not hide what the episode
wrote in a source file from the rewards that read it, which charge a fixed cost for it
(`codedojo.reward.auxiliary.UNREAD_COST`), since its text, of any length, is not read.

`reward_context` gathers what the rewards read of a finished episode: the changes, and the
workspace's ruff configuration as the image had it, so that `lint_delta` lints by the
repository's rules, and an episode that edits them changes nothing of its own score.
"""

from __future__ import annotations

from collections.abc import Callable

from codedojo.harness.lint import CONFIG_FILES
from codedojo.harness.trajectory import Trajectory
from codedojo.reward.auxiliary import UNREAD_CHARGED
from codedojo.reward.base import FileChange, RewardContext, TestReport
from codedojo.sandbox.base import WORKSPACE, FileTooLarge, Sandbox, SandboxError

MAX_BYTES = 1_000_000

_UNREADABLE = object()  # binary or too large: not a text


def _text(data: bytes) -> str | object:
    if len(data) > MAX_BYTES or b"\x00" in data[:8192]:
        return _UNREADABLE
    return data.decode("utf-8", "replace")


def _side(read: Callable[[str], bytes], path: str) -> str | object | None:
    """The text of one side: None where there is no file, `_UNREADABLE` where it is no text."""
    try:
        return _text(read(path))
    except FileTooLarge:
        return _UNREADABLE
    except (FileNotFoundError, SandboxError):
        return None


def collect_changes(sandbox: Sandbox) -> list[FileChange]:
    """The text files the episode added, modified or deleted under /workspace."""
    return _collect(sandbox)[0]


def _collect(sandbox: Sandbox) -> tuple[list[FileChange], list[str]]:
    """`collect_changes`, and the files the episode left no text where the image had text or
    none (`RewardContext.unread`)."""
    out: list[FileChange] = []
    unread: list[str] = []
    for ch in sandbox.changes():
        path = ch.path if ch.path.startswith("/") else f"{WORKSPACE}/{ch.path}"
        after = None if ch.kind == "deleted" else _side(  # (a file past it is not read)
            lambda p: sandbox.read_file(p, max_bytes=MAX_BYTES), path)
        if after is _UNREADABLE and not path.endswith(UNREAD_CHARGED):
            continue  # (nothing to compare, nothing charged: the image's side is not read)
        before = None if ch.kind == "added" else _side(sandbox.read_original, path)
        if before is _UNREADABLE or before == after:  # directories: None on both
            continue
        if after is _UNREADABLE:
            unread.append(path)
            continue
        out.append(FileChange(path, before, after))  # type: ignore[arg-type]
    return out, unread


def image_lint_configs(sandbox: Sandbox) -> dict[str, str]:
    """The ruff configuration files at /workspace as the image had them."""
    configs = {}
    for name in CONFIG_FILES:
        text = _side(sandbox.read_original, f"{WORKSPACE}/{name}")
        if isinstance(text, str):
            configs[name] = text
    return configs


def reward_context(trajectory: Trajectory, sandbox: Sandbox,
                   tests: TestReport | None = None) -> RewardContext:
    """What the rewards read of a finished episode whose sandbox is still alive."""
    changes, unread = _collect(sandbox)
    return RewardContext(trajectory, tests, changes, image_lint_configs(sandbox), unread)
