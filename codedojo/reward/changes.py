"""What an episode changed in its sandbox, as (path, before, after) texts for the rewards.

`after` is read from the sandbox. `before` comes, in order of preference, from the content the
file tools saw first (they record it), from git's HEAD when /workspace is a repository, and
otherwise is unknown (treated as a new file).
"""

from __future__ import annotations

from collections.abc import Mapping

from codedojo.reward.base import FileChange
from codedojo.sandbox.base import WORKSPACE, Sandbox, SandboxError

MAX_BYTES = 1_000_000


def _text(data: bytes) -> str | None:
    if len(data) > MAX_BYTES or b"\x00" in data[:8192]:
        return None
    return data.decode("utf-8", "replace")


def collect_changes(sandbox: Sandbox, originals: Mapping[str, str | None] | None = None) -> list[FileChange]:
    originals = dict(originals or {})
    out: list[FileChange] = []
    for ch in sandbox.changes():
        path = ch.path if ch.path.startswith("/") else f"{WORKSPACE}/{ch.path}"
        after: str | None = None
        if ch.kind != "deleted":
            try:
                after = _text(sandbox.read_file(path))
            except (FileNotFoundError, SandboxError, OSError):
                after = None
            if after is None and ch.kind != "deleted":
                try:
                    if sandbox.stat(path).kind != "file":
                        continue  # directories are not content changes
                except (FileNotFoundError, SandboxError):
                    pass
        if path in originals:
            before = originals[path]
        elif ch.kind == "added":
            before = None
        else:
            rel = path[len(WORKSPACE) + 1 :] if path.startswith(WORKSPACE + "/") else path
            r = sandbox.exec(["git", "show", f"HEAD:{rel}"], cwd=WORKSPACE, timeout=30)
            before = r.stdout if r.exit_code == 0 else None
        if before != after:
            out.append(FileChange(path, before, after))
    return out
