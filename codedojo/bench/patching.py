"""Unified diffs: make them from file contents and apply them strictly (context must match).

Kept in pure Python so a patch applies the same way on the host, in a sandbox we only reach
through read_file/write_file, and on a machine without `patch` or `git`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from codedojo.harness.lines import lines_with_ends

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch that does not parse or whose context does not match the files."""


def make_diff(before: Mapping[str, str | None], after: Mapping[str, str | None], context: int = 3) -> str:
    """A unified diff over paths (relative, '/'-separated); None = the file does not exist."""
    chunks: list[str] = []
    for path in sorted(set(before) | set(after)):
        a, b = before.get(path), after.get(path)
        if a == b:
            continue
        a_lines = lines_with_ends(a or "")
        b_lines = lines_with_ends(b or "")
        diff = list(difflib.unified_diff(
            a_lines, b_lines,
            fromfile="/dev/null" if a is None else f"a/{path}",
            tofile="/dev/null" if b is None else f"b/{path}",
            n=context,
        ))
        for line in diff:
            chunks.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(chunks)


@dataclass
class FilePatch:
    old_path: str | None
    new_path: str | None
    hunks: list[tuple[int, list[str]]] = field(default_factory=list)  # (old start, lines with +/-/space)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


def _strip(p: str) -> str | None:
    """A header's path, refused when it would lead out of the tree it is applied to."""
    p = p.split("\t")[0].strip()
    if p == "/dev/null":
        return None
    p = p[2:] if p.startswith(("a/", "b/")) else p
    if p.startswith("/") or ".." in p.split("/") or not p:
        raise PatchError(f"{p!r}: a patch's path must stay inside the tree")
    return p


def parse_patch(text: str) -> list[FilePatch]:
    files: list[FilePatch] = []
    lines = lines_with_ends(text)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            fp = FilePatch(_strip(line[4:]), _strip(lines[i + 1][4:]))
            files.append(fp)
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise PatchError(f"line {i + 1}: hunk before any file header")
            old_len = int(m.group(2) or "1")
            new_len = int(m.group(4) or "1")
            body: list[str] = []
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                ln = lines[i]
                tag = ln[:1]
                if tag == "\\":
                    if body:
                        body[-1] = body[-1].rstrip("\n")
                    i += 1
                    continue
                if tag not in (" ", "-", "+") and ln.strip():
                    raise PatchError(f"line {i + 1}: bad hunk line {ln[:40]!r}")
                if tag == "" or ln == "\n":  # a blank context line whose space was stripped
                    ln, tag = " \n", " "
                body.append(ln)
                seen_old += tag in (" ", "-")
                seen_new += tag in (" ", "+")
                i += 1
            if seen_old < old_len or seen_new < new_len:  # the patch ended inside the hunk
                raise PatchError(
                    f"{files[-1].path}: hunk {line.strip()!r} ends after {seen_old} old and "
                    f"{seen_new} new lines, its header counts {old_len} and {new_len}")
            while i < len(lines) and lines[i].startswith("\\"):
                body[-1] = body[-1].rstrip("\n")
                i += 1
            files[-1].hunks.append((int(m.group(1)), body))
            continue
        i += 1
    if not files:
        raise PatchError("no file headers ('--- '/'+++ ') in patch")
    return files


def apply_to_text(original: str | None, fp: FilePatch) -> str | None:
    if fp.new_path is None:
        return None
    src = lines_with_ends(original or "")
    out: list[str] = []
    pos = offset = 0
    for start, body in fp.hunks:
        old = [ln[1:] for ln in body if ln[:1] in (" ", "-")]
        new = [ln[1:] for ln in body if ln[:1] in (" ", "+")]
        stated = (max(start - 1, 0) if old else start) + offset
        if stated < pos:
            raise PatchError(f"{fp.path}: hunk at line {start} overlaps the hunk before it")
        # Tolerate shifted hunks (another hunk or file edit moved lines), like `patch` does:
        # where the block stands nearest the line stated (shifted as the hunk before was).
        at = _find(src, old, stated, pos)
        if at < 0:
            raise PatchError(f"{fp.path}: hunk at line {start} does not match the file")
        offset += at - stated
        out.extend(src[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(src[pos:])
    return "".join(out)


def _find(src: list[str], block: list[str], want: int, lo: int) -> int:
    """Where ``block`` stands in ``src`` nearest ``want``, at ``lo`` or after; -1 if nowhere."""
    hi = len(src) - len(block)
    for d in range(max(want - lo, hi - want) + 1):
        for k in (want - d, want + d):
            if lo <= k <= hi and src[k:k + len(block)] == block:
                return k
    return -1


def apply_patch(text: str, read: Callable[[str], str | None]) -> dict[str, str | None]:
    """New contents of every file the patch touches (None = deleted); `read` gives the current
    content of a path, None when it does not exist. Nothing is written: the caller does that."""
    result: dict[str, str | None] = {}
    for fp in parse_patch(text):
        current = result[fp.old_path] if fp.old_path in result else (read(fp.old_path) if fp.old_path else None)
        if fp.old_path is not None and current is None:
            raise PatchError(f"{fp.old_path}: patch modifies a file that does not exist")
        if fp.old_path is None and fp.new_path and read(fp.new_path) is not None:
            raise PatchError(f"{fp.new_path}: patch creates a file that already exists")
        if fp.old_path and fp.new_path and fp.old_path != fp.new_path:
            result[fp.old_path] = None
        result[fp.path] = apply_to_text(current, fp)
    return result


def apply_patch_to_dir(text: str, root: Path) -> list[str]:
    """Apply a patch to a directory on the host; returns the touched paths."""

    def read(rel: str) -> str | None:
        p = root / rel
        return p.read_text(encoding="utf-8") if p.is_file() else None

    changes = apply_patch(text, read)
    for rel, content in changes.items():
        p = root / rel
        if content is None:
            p.unlink(missing_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content, encoding="utf-8")
    return sorted(changes)
