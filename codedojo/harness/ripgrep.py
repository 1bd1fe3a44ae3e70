"""ripgrep's answer: the lines it found, and the paths it could not read beside them."""

from __future__ import annotations

import re
from collections.abc import Sequence

from codedojo.sandbox.base import CUT_LINE, ExecResult, Sandbox

_PATH_ERROR = re.compile(r"\(os error \d+\)$")  # "path: Permission denied (os error 13)"


class RgError(RuntimeError):
    """rg failed outright: a bad pattern or glob, a timeout (`RgTimeout`), no rg."""


class RgTimeout(RgError):
    """rg ran past its time."""


def rg_lines(r: ExecResult) -> tuple[list[str], list[str]]:
    """(the output's lines, rg's errors for paths it could not read). rg exits 2 when a path
    was unreadable even where it found what was asked elsewhere: that is an answer with a
    note, not a failure; any other error is `RgError`."""
    errors = [e for e in r.stderr.splitlines() if e.strip()]
    unreadable = r.exit_code == 2 and bool(errors) and all(_PATH_ERROR.search(e) for e in errors)
    if r.timed_out:
        raise RgTimeout("rg timed out")
    if not (r.exit_code in (0, 1) or unreadable):
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


def missing_paths(errors: list[str], paths: list[str]) -> list[str]:
    """The paths among ``paths`` that rg's errors say do not exist (``<path>: ... No such
    file or directory (os error 2)``, worded otherwise with ``--sort``)."""
    gone = [e.removeprefix("rg: ") for e in errors if e.endswith("(os error 2)")]
    return [p for p in paths if any(e.startswith(f"{p}: ") for e in gone)]


def rg_files(sandbox: Sandbox, roots: Sequence[str], globs: Sequence[str] = (),
             flags: Sequence[str] = (), *, cwd: str | None = None,
             timeout: float | None = None) -> tuple[list[str], list[str]]:
    """(the files rg walks under ``roots``, by path, with ``flags`` and its ignore rules, those
    the ``globs`` choose among them; rg's errors for paths it could not read). A glob, read
    from ``cwd`` as rg reads it, narrows the listing and never widens it: rg's own ``--glob``
    overrides its ignore rules (``-g '*'`` lists .git and an ignored venv, ``-g '*.log'``
    ignored logs), so a file is kept where rg lists it both with the globs and without.
    `RgError` for a bad glob or a timeout."""
    def listing(extra: list[str]) -> tuple[list[str], list[str]]:
        argv = ["rg", "--files", "--sort", "path", *flags, *extra, "--", *roots]
        return rg_lines(sandbox.exec(argv, cwd=cwd, timeout=timeout))

    if not globs:
        return listing([])
    chosen = set(listing([a for g in globs for a in ("--glob", g)])[0])  # (a bad glob: first)
    files, unread = listing([])
    return [f for f in files if f in chosen], unread
