"""What an episode changed in its sandbox, for the rewards: (path, before, after) texts.

`before` is the file as the sandbox's image had it (`Sandbox.read_original`, the other side of
`Sandbox.changes`), whatever changed it: a file tool, the shell, a build. `after` is read from
the sandbox. A file that is binary or too large on either side is no text change, and left
out (not reported as deleted).

`reward_context` gathers what the rewards read of a finished episode: the changes, and the
workspace's ruff configuration as the image had it, so that `lint_delta` lints by the
repository's rules, and an episode that edits them changes nothing of its own score.
"""

from __future__ import annotations

from collections.abc import Callable

from codedojo.harness.lint import CONFIG_FILES
from codedojo.harness.trajectory import Trajectory
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
    out: list[FileChange] = []
    for ch in sandbox.changes():
        path = ch.path if ch.path.startswith("/") else f"{WORKSPACE}/{ch.path}"
        after = None if ch.kind == "deleted" else _side(  # (a file past it is not read)
            lambda p: sandbox.read_file(p, max_bytes=MAX_BYTES), path)
        if after is _UNREADABLE:  # (no text: the image's side need not be read)
            continue
        before = None if ch.kind == "added" else _side(sandbox.read_original, path)
        if before is _UNREADABLE or before == after:  # directories: None on both
            continue
        out.append(FileChange(path, before, after))  # type: ignore[arg-type]
    return out


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
    return RewardContext(trajectory, tests, collect_changes(sandbox), image_lint_configs(sandbox))
