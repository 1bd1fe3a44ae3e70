"""ripgrep's answer: the lines it found, and the paths it could not read beside them."""

from __future__ import annotations

import re

from codedojo.sandbox.base import CUT_LINE, ExecResult

_PATH_ERROR = re.compile(r"\(os error \d+\)$")  # "path: Permission denied (os error 13)"


class RgError(RuntimeError):
    """rg failed outright: a bad pattern or glob, a timeout, no rg."""


def rg_lines(r: ExecResult) -> tuple[list[str], list[str]]:
    """(the output's lines, rg's errors for paths it could not read). rg exits 2 when a path
    was unreadable even where it found what was asked elsewhere: that is an answer with a
    note, not a failure; any other error is `RgError`."""
    errors = [e for e in r.stderr.splitlines() if e.strip()]
    unreadable = r.exit_code == 2 and bool(errors) and all(_PATH_ERROR.search(e) for e in errors)
    if r.timed_out or not (r.exit_code in (0, 1) or unreadable):
        raise RgError(r.stderr.strip() or f"rg failed with exit code {r.exit_code}")
    lines = r.stdout.splitlines()
    if r.truncated:  # past the sandbox's cap: its cut line, and the lines cut on either side
        cut = next((i for i, line in enumerate(lines) if CUT_LINE.fullmatch(line)), None)
        if cut is not None:
            lines = lines[:max(0, cut - 1)] + lines[cut + 2:]
    return [line for line in lines if line], errors if unreadable else []


def unread_note(errors: list[str]) -> str:
    """A line telling what was not searched ('' when all was)."""
    if not errors:
        return ""
    more = f" and {len(errors) - 1} more" if len(errors) > 1 else ""
    return f"\n[not searched: {errors[0]}{more}]"
