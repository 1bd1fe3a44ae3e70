"""File tools: read_file, list_dir, glob_file_search, search_replace, write, delete_file.

Every path goes through the sandbox's own file API (or a command run inside it), never the
host filesystem, so the sandbox's path rules apply. Edits remember the first content they
saw, so the rewards can diff what the agent changed.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from typing import Any

from codedojo.harness.lines import file_lines
from codedojo.harness.ripgrep import RgError, rg_files, rooted_glob, unread_note
from codedojo.harness.tools.base import (
    FunctionTool,
    ToolContext,
    ToolError,
    obj,
    resolve,
    shown,
)
from codedojo.sandbox.base import WORKSPACE, FileTooLarge, SandboxError

MAX_LIST_ENTRIES = 500
MAX_GLOB_RESULTS = 200
MAX_TEXT_BYTES = 8 << 20  # a file the file tools read whole (a log of gigabytes is not)


def read_text(ctx: ToolContext, path: str, errors: str = "replace") -> str | None:
    """The file's text, or None when it does not exist. Bytes that are not UTF-8 are shown as
    U+FFFD; ``errors="surrogateescape"`` keeps them, for a text to be written back. A file
    over `MAX_TEXT_BYTES` is refused before it is read."""
    try:
        data = ctx.sandbox.read_file(path, max_bytes=MAX_TEXT_BYTES)
    except FileTooLarge as e:
        raise ToolError(f"{path} is {e.size} bytes, more than the file tools read "
                        f"({MAX_TEXT_BYTES >> 20} MiB): use grep, or head/sed in the terminal"
                        ) from None
    except (FileNotFoundError, SandboxError) as e:
        if _exists(ctx, path):
            raise ToolError(f"cannot read {path}: {e}") from e
        return None
    if b"\x00" in data[:8192]:
        raise ToolError(f"{path} is a binary file ({len(data)} bytes)")
    return data.decode("utf-8", errors=errors)


def _exists(ctx: ToolContext, path: str) -> bool:
    try:
        ctx.sandbox.stat(path)
        return True
    except (FileNotFoundError, SandboxError):
        return False


def is_dir(ctx: ToolContext, path: str) -> bool:
    """Whether ``path`` is a directory, or a link to one (followed as rg and `list_dir` follow
    it)."""
    try:
        kind = ctx.sandbox.stat(path).kind
    except (FileNotFoundError, SandboxError):
        return False
    if kind != "symlink":
        return kind == "dir"
    return ctx.sandbox.exec(["test", "-d", path], timeout=ctx.timeout_s).exit_code == 0


def _write_text(ctx: ToolContext, path: str, text: str) -> int:
    """Write ``text`` (bytes kept from a read with "surrogateescape" go back as they were);
    returns the bytes written."""
    parent = posixpath.dirname(path)
    if parent and not _exists(ctx, parent):
        r = ctx.sandbox.exec(["mkdir", "-p", parent], timeout=ctx.timeout_s)
        if r.exit_code != 0:
            raise ToolError(f"cannot create directory {parent}: {r.stderr.strip()}")
    data = text.encode("utf-8", errors="surrogateescape")
    ctx.sandbox.write_file(path, data)
    return len(data)


# ---- read_file ------------------------------------------------------------------------------


def _read_file(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = resolve(args["target_file"])
    text = read_text(ctx, path)
    if text is None:
        raise ToolError(f"file not found: {args['target_file']}")
    if text == "":
        return "File is empty."
    lines = file_lines(text)
    offset = args.get("offset")
    limit = args.get("limit")
    # 1-based, negative from the end; 0 (a 0-based habit) is the first line too
    start = 1 if not offset else (offset if offset > 0 else max(1, len(lines) + offset + 1))
    if start > len(lines):
        raise ToolError(f"offset {offset} is past the end of the file ({len(lines)} lines)")
    end = len(lines) if limit is None else min(len(lines), start - 1 + limit)
    body = "\n".join(f"{n:6d}|{lines[n - 1]}" for n in range(start, end + 1))
    if start > 1 or end < len(lines):
        body += f"\n[lines {start}-{end} of {len(lines)}]"
    return body


READ_FILE = FunctionTool(
    name="read_file",
    description=(
        "Read a text file from the workspace. Lines are numbered (LINE|content). Use offset (1-based "
        "line; negative counts from the end) and limit to read part of a long file."
    ),
    parameters=obj(
        {
            "target_file": {"type": "string", "description": "Path, relative to the workspace or absolute."},
            "offset": {"type": "integer", "description": "First line to read (1-based)."},
            "limit": {"type": "integer", "minimum": 1, "description": "Number of lines to read."},
        },
        ["target_file"],
    ),
    fn=_read_file,
)


# ---- list_dir -------------------------------------------------------------------------------


def _list_dir(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = resolve(args.get("target_directory") or WORKSPACE)
    ignore = list(args.get("ignore_globs") or [])
    try:
        entries = ctx.sandbox.list_dir(path)
    except (FileNotFoundError, NotADirectoryError, SandboxError) as e:
        if not _exists(ctx, path):
            raise ToolError(f"directory not found: {path}") from e
        raise ToolError(f"cannot list {path}: {e}") from e
    entries = [
        e
        for e in entries
        if not any(fnmatch.fnmatch(posixpath.basename(e.path), g) or fnmatch.fnmatch(e.path, g) for g in ignore)
    ]
    entries.sort(key=lambda e: (e.kind != "dir", posixpath.basename(e.path)))
    lines = [f"{path}/"]
    for e in entries[:MAX_LIST_ENTRIES]:
        name = posixpath.basename(e.path)
        if e.kind == "dir":
            lines.append(f"  - {name}/")
        elif e.kind == "symlink":
            lines.append(f"  - {name} -> (symlink)")
        else:
            lines.append(f"  - {name} ({e.size} bytes)")
    if len(entries) > MAX_LIST_ENTRIES:
        lines.append(f"  ... [{len(entries) - MAX_LIST_ENTRIES} more entries not shown]")
    if not entries:
        lines.append("  (empty)")
    return "\n".join(lines)


LIST_DIR = FunctionTool(
    name="list_dir",
    description="List the entries of a directory (one level). Directories end with '/'.",
    parameters=obj(
        {
            "target_directory": {"type": "string", "description": "Directory, relative to the workspace or absolute."},
            "ignore_globs": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Glob patterns of names to leave out.",
            },
        },
        ["target_directory"],
    ),
    fn=_list_dir,
)


# ---- glob_file_search -----------------------------------------------------------------------


def _glob_file_search(ctx: ToolContext, args: dict[str, Any]) -> str:
    pattern = args["glob_pattern"].strip()
    if not pattern:
        raise ToolError("glob_pattern is empty")
    root = resolve(args.get("target_directory") or WORKSPACE)
    # A pattern matches at any depth, as in an IDE's file search, unless it is anchored at the
    # search root: one that starts with "/" or "./", or an absolute path under the root.
    pattern = rooted_glob(pattern, root)
    negated = "!" if pattern.startswith("!") else ""
    if not pattern.startswith((f"{negated}**/", f"{negated}/")):
        pattern = f"{negated}**/{pattern.removeprefix(negated)}"
    try:
        files, unread = rg_files(ctx.sandbox, [root], [pattern], ["--hidden", "--glob", "!.git"],
                                 cwd=root, timeout=ctx.timeout_s)
    except RgError as e:  # (a root that is no directory: named so, not as a cwd rg lacks)
        if not is_dir(ctx, root):
            what = "not a directory" if _exists(ctx, root) else "directory not found"
            raise ToolError(f"{what}: {root}") from None
        raise ToolError(str(e)) from None
    if not files:
        return f"No files matching {args['glob_pattern']!r} under {root}." + unread_note(unread)
    out = files[:MAX_GLOB_RESULTS]
    text = "\n".join(out)
    if len(files) > len(out):
        text += f"\n... [{len(files) - len(out)} more files not shown]"
    return text + unread_note(unread)


GLOB_FILE_SEARCH = FunctionTool(
    name="glob_file_search",
    description=(
        "Find files by glob pattern (e.g. '*.py', 'src/**/test_*.py'). A pattern without a leading "
        "'**/' matches at any depth. Respects .gitignore."
    ),
    parameters=obj(
        {
            "glob_pattern": {"type": "string", "description": "The glob pattern."},
            "target_directory": {"type": "string", "description": "Directory to search (default: the workspace)."},
        },
        ["glob_pattern"],
    ),
    fn=_glob_file_search,
)


# ---- search_replace -------------------------------------------------------------------------


def _any_line_endings(old: str) -> re.Pattern[str]:
    """``old`` with each line ending ("\\n" or "\\r\\n") matching either: `read_file` shows
    neither's "\\r", and a file may mix them."""
    lines = old.replace("\r\n", "\n").split("\n")
    return re.compile("\r?\n".join(re.escape(line) for line in lines))


def _with_endings(new: str, replaced: str, eol: str) -> str:
    """``new`` with the line endings of the text it replaces, line for line; past the last of
    them, that one's again, and ``eol`` (the file's) where the text replaced has none. A new
    text replacing "\\n" endings alone, in a file of them, is left as it is."""
    ends = re.findall(r"\r?\n", replaced) or [eol]
    if set(ends) == {"\n"}:
        return new
    lines = new.replace("\r\n", "\n").split("\n")
    ended = (line + ends[min(i, len(ends) - 1)] for i, line in enumerate(lines[:-1]))
    return "".join(ended) + lines[-1]


def _search_replace(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = resolve(args["file_path"])
    old, new = args["old_string"], args["new_string"]
    text = read_text(ctx, path, errors="surrogateescape")  # what is not UTF-8 stays as it was
    if text is None:
        if old == "":
            _write_text(ctx, path, new)
            ctx.remember_edit(path)
            return f"Created {path}."
        raise ToolError(f"file not found: {args['file_path']}")
    if old == new:
        raise ToolError("old_string and new_string are identical; nothing to change")
    if old == "":
        raise ToolError("old_string is empty; give the exact text to replace")
    # lines as `read_file` shows them, without the CR before their "\n": each occurrence
    # counts, whichever endings it has (a file may mix them)
    found = _any_line_endings(old) if "\n" in old else re.compile(re.escape(old))
    count = len(found.findall(text))
    if count == 0:
        raise ToolError(f"old_string not found in {path}" + (
            " (the file is not all UTF-8: text shown with U+FFFD cannot be matched)"
            if shown(text) != text else ""))
    if count > 1 and not args.get("replace_all", False):
        raise ToolError(
            f"old_string occurs {count} times in {path}; add context to make it unique or set replace_all"
        )
    eol = "\r\n" if "\r\n" in text and text.count("\n") == text.count("\r\n") else "\n"
    updated = found.sub(lambda m: _with_endings(new, m[0], eol), text,
                        count=0 if args.get("replace_all", False) else 1)
    _write_text(ctx, path, updated)
    ctx.remember_edit(path)
    n = count if args.get("replace_all", False) else 1
    return f"Replaced {n} occurrence{'s' if n > 1 else ''} in {path}."


SEARCH_REPLACE = FunctionTool(
    name="search_replace",
    description=(
        "Replace exact text in a file. old_string must occur exactly once unless replace_all is true. "
        "An empty old_string on a missing file creates it with new_string."
    ),
    parameters=obj(
        {
            "file_path": {"type": "string", "description": "File to edit."},
            "old_string": {"type": "string", "description": "Exact text to replace."},
            "new_string": {"type": "string", "description": "Replacement text."},
            "replace_all": {"type": "boolean", "description": "Replace every occurrence (default false)."},
        },
        ["file_path", "old_string", "new_string"],
    ),
    fn=_search_replace,
)


# ---- write ----------------------------------------------------------------------------------


def _write(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = resolve(args["file_path"])
    n = _write_text(ctx, path, args["contents"])
    ctx.remember_edit(path)
    return f"Wrote {n} bytes to {path}."


WRITE = FunctionTool(
    name="write",
    description="Write a file, replacing it if it exists. Parent directories are created.",
    parameters=obj(
        {
            "file_path": {"type": "string", "description": "File to write."},
            "contents": {"type": "string", "description": "The full new contents."},
        },
        ["file_path", "contents"],
    ),
    fn=_write,
)


# ---- delete_file ----------------------------------------------------------------------------


def _delete_file(ctx: ToolContext, args: dict[str, Any]) -> str:
    path = resolve(args["target_file"])
    try:
        info = ctx.sandbox.stat(path)
    except (FileNotFoundError, SandboxError) as e:
        raise ToolError(f"file not found: {args['target_file']}") from e
    if info.kind == "dir":
        raise ToolError(f"{path} is a directory; delete_file removes files only")
    ctx.sandbox.remove(path)
    ctx.remember_edit(path)
    return f"Deleted {path}."


DELETE_FILE = FunctionTool(
    name="delete_file",
    description="Delete a file.",
    parameters=obj(
        {"target_file": {"type": "string", "description": "File to delete."}},
        ["target_file"],
    ),
    fn=_delete_file,
)
