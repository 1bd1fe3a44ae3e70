"""grep: ripgrep run inside the sandbox, so it sees exactly the agent's files and nothing else."""

from __future__ import annotations

from typing import Any

from codedojo.harness.ripgrep import (
    RgError,
    RgTimeout,
    rg_files,
    rg_lines,
    rooted_glob,
    unread_note,
)
from codedojo.harness.tools.base import FunctionTool, ToolContext, ToolError, obj, resolve
from codedojo.harness.tools.files import is_dir
from codedojo.sandbox.base import WORKSPACE

DEFAULT_HEAD_LIMIT = 500
# A line is shown up to this many bytes (and a note of what follows): a minified bundle's one
# line of megabytes would otherwise pass the sandbox's output cap alone, and be cut away.
MAX_COLUMNS = 500


def _walk_flags(args: dict[str, Any]) -> list[str]:
    """The flags that choose which files rg walks into."""
    return ["--hidden", "--glob", "!.git"] + (["--type", args["type"]] if args.get("type") else [])


def rg_argv(args: dict[str, Any], paths: list[str]) -> list[str]:
    """The ripgrep command line for a grep call over `paths`. The glob is
    not among its flags: rg's --glob would list files its ignore rules leave out (see
    `rg_files`), so `_grep` names the files it chose."""
    mode = args.get("output_mode", "content")
    argv = ["rg", "--color", "never", "--no-heading", *_walk_flags(args)]
    if mode == "files_with_matches":
        argv.append("--files-with-matches")
    elif mode == "count":
        argv.append("--count-matches")
    else:
        argv += ["--line-number", "--max-columns", str(MAX_COLUMNS), "--max-columns-preview"]
        for flag in ("-A", "-B", "-C"):
            if args.get(flag) is not None:
                argv += [flag, str(args[flag])]
    if args.get("-i"):
        argv.append("--ignore-case")
    if args.get("multiline"):
        argv += ["--multiline", "--multiline-dotall"]
    # -e keeps a pattern that starts with '-' from being read as a flag.
    return argv + ["-e", args["pattern"], "--", *paths]


def _grep(ctx: ToolContext, args: dict[str, Any]) -> str:
    root = resolve(args.get("path") or WORKSPACE)
    try:
        paths, unread, cut = [root], [], False
        if args.get("glob"):  # the files rg would walk, those the glob chooses among them,
            # read from the path searched as glob_file_search reads it (a file named is
            # searched whatever the glob, as rg does)
            cwd = root if is_dir(ctx, root) else None
            glob = rooted_glob(args["glob"], root) if cwd else args["glob"]
            paths, unread = rg_files(ctx.sandbox, [root], [glob], _walk_flags(args), cwd=cwd,
                                     timeout=ctx.timeout_s)
        lines: list[str] = []
        if paths:  # (searched by name; rg names a line's file only when it searches several)
            argv = rg_argv(args, paths)
            if paths != [root]:
                argv.insert(1, "--with-filename")
            r = ctx.sandbox.exec(argv, timeout=ctx.timeout_s)
            lines, more = rg_lines(r)
            unread, cut = unread + more, r.truncated
    except RgTimeout:
        raise ToolError(f"grep timed out after {ctx.timeout_s:.0f}s; narrow the path or "
                        "glob") from None
    except RgError as e:
        raise ToolError(str(e)) from None
    if not lines:
        return "No matches found." + unread_note(unread)
    if args.get("output_mode", "content") == "content":  # (a CRLF file's lines: shown
        lines = [line.removesuffix("\r") for line in lines]  # as read_file shows them)
    head = args.get("head_limit") or DEFAULT_HEAD_LIMIT
    text = "\n".join(lines[:head])
    if cut:  # (the lines counted are those the sandbox kept: its output's start and end)
        more = f"at least {len(lines) - head} more lines" if len(lines) > head else "lines"
        text += (f"\n... [{more} not shown: rg's output passed the sandbox's limit and its "
                 "middle was cut; narrow the search]")
    elif len(lines) > head:
        text += f"\n... [{len(lines) - head} more lines not shown; raise head_limit or narrow the search]"
    return text + unread_note(unread)


GREP = FunctionTool(
    name="grep",
    description=(
        "Search file contents with ripgrep (regular expressions). output_mode: 'content' (matching "
        "lines with line numbers, default), 'files_with_matches' or 'count'."
    ),
    parameters=obj(
        {
            "pattern": {"type": "string", "description": "Regular expression (ripgrep syntax)."},
            "path": {"type": "string", "description": "File or directory to search (default: the workspace)."},
            "glob": {"type": "string", "description": "Only files matching this glob, e.g. '*.py'."},
            "type": {"type": "string", "description": "Only files of this ripgrep type, e.g. 'py'."},
            "output_mode": {
                "type": "string",
                "enum": ["content", "files_with_matches", "count"],
                "description": "What to show.",
            },
            "-A": {"type": "integer", "minimum": 0, "description": "Lines of context after each match."},
            "-B": {"type": "integer", "minimum": 0, "description": "Lines of context before each match."},
            "-C": {"type": "integer", "minimum": 0, "description": "Lines of context around each match."},
            "-i": {"type": "boolean", "description": "Case-insensitive."},
            "head_limit": {"type": "integer", "minimum": 1, "description": "Show at most this many lines."},
            "multiline": {"type": "boolean", "description": "Let patterns span lines ('.' matches newlines)."},
        },
        ["pattern"],
    ),
    fn=_grep,
)
