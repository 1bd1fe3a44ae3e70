"""ripgrep's answer: the lines it found, and the paths it could not read beside them."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from codedojo.sandbox.base import CUT_LINE, ExecResult, Sandbox

_OS_ERROR = re.compile(r"\(os error (\d+)\)$")  # "path: Permission denied (os error 13)"


class RgError(RuntimeError):
    """rg failed outright: a bad pattern or glob, a timeout (`RgTimeout`), no rg."""


class RgTimeout(RgError):
    """rg ran past its time."""


def rg_lines(r: ExecResult) -> tuple[list[str], list[str]]:
    """(the output's lines, split at "\n" only; rg's errors for paths it could not read).
    rg exits 2 when a path was unreadable even where it found what was asked elsewhere: that
    is an answer with a note, not a failure; any other error is `RgError`."""
    errors = [e for e in r.stderr.splitlines() if e.strip()]
    unreadable = r.exit_code == 2 and bool(errors) and all(_OS_ERROR.search(e) for e in errors)
    if r.timed_out:
        raise RgTimeout("rg timed out")
    if not (r.exit_code in (0, 1) or unreadable):
        raise RgError(r.stderr.strip() or f"rg failed with exit code {r.exit_code}")
    # rg ends a line with "\n" alone: `str.splitlines` would also split one at a form feed,
    # U+2028, a lone "\r" or a group separator a matched line holds
    lines = r.stdout.split("\n")
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


def root_errors(errors: list[str], roots: Sequence[str]) -> dict[str, int]:
    """The roots among ``roots`` that rg's errors say it could not read, with the errno (a
    root not there: ENOENT; ``README.md/x``: ENOTDIR; unreadable: EACCES). rg words them
    ``<path>: ... (os error N)``, otherwise with ``--sort``."""
    out: dict[str, int] = {}
    for e in errors:
        m = _OS_ERROR.search(e)
        root = next((r for r in roots if e.removeprefix("rg: ").startswith(f"{r}: ")), None)
        if m and root is not None:
            out.setdefault(root, int(m[1]))
    return out


def rooted_glob(glob: str, root: str) -> str:
    """``glob`` as rg reads it with ``root`` its cwd, as a .gitignore there: "./x" and an
    absolute path under ``root`` become "/x", anchored at ``root``; any other glob is left as
    it is (without a "/" it matches a name at any depth, with one a path from ``root``). A
    leading "!" (rg's "leave out") stays in front."""
    negated = "!" if glob.startswith("!") else ""
    g = glob.removeprefix(negated)
    base = root.rstrip("/") + "/"
    if g.startswith("./"):
        while g.startswith("./"):
            g = g[2:].lstrip("/")
        g = "/" + g
    elif g.startswith(base):
        g = "/" + g[len(base):]
    return negated + g


# Both listings stay in the sandbox (the whole tree's can be far longer than a command's output
# may be, and a name that is not UTF-8 would not come back byte for byte): awk runs each (their
# commands in the environment, as shell lines) and prints the names both hold, writing nothing
# to disk. A name is a line, as rg writes them.
_KEEP_CHOSEN = ('BEGIN { cmd = ENVIRON["CODEDOJO_RG_CHOSEN"] " 2>/dev/null"; '
                'while ((cmd | getline name) > 0) chosen[name]; close(cmd); '
                'cmd = ENVIRON["CODEDOJO_RG_EVERY"] " 2>/dev/null"; '
                'while ((cmd | getline name) > 0) if (name in chosen) print name; close(cmd) }')


def rg_files(sandbox: Sandbox, roots: Sequence[str], globs: Sequence[str] = (),
             flags: Sequence[str] = (), *, cwd: str | None = None,
             timeout: float | None = None) -> tuple[list[str], list[str]]:
    """(the files rg walks under ``roots``, by path, with ``flags`` and its ignore rules, those
    the ``globs`` choose among them; rg's errors for paths it could not read). A glob, read
    from ``cwd`` as rg reads it, narrows the listing and never widens it: rg's own ``--glob``
    overrides its ignore rules (``-g '*'`` lists .git and an ignored venv, ``-g '*.log'``
    ignored logs), so a file is kept where rg lists it both with the globs and without.
    `RgError` for a bad glob, a timeout, or a step that failed."""
    def listing(extra: Sequence[str]) -> tuple[list[str], list[str]]:
        argv = ["rg", "--files", *flags, *extra, "--", *roots]  # (walked in parallel: sorted
        return rg_lines(sandbox.exec(argv, cwd=cwd, timeout=timeout))  # below)

    if not globs:
        files, unread = listing(())
        return sorted(files, key=lambda f: f.split("/")), unread
    chose = [a for g in globs for a in ("--glob", g)]
    chosen, unread = listing(chose)  # (its errors: a bad glob, what could not be read)
    if not chosen:
        return [], unread
    env = {"CODEDOJO_RG_CHOSEN": shlex.join(["rg", "--files", *flags, *chose, "--", *roots]),
           "CODEDOJO_RG_EVERY": shlex.join(["rg", "--files", *flags, "--", *roots])}
    r = sandbox.exec(["awk", _KEEP_CHOSEN], cwd=cwd, timeout=timeout, env=env)
    if r.exit_code != 0 and not r.timed_out:  # (awk's own failure: no awk, no sh)
        raise RgError(r.stderr.strip() or f"filtering the listing failed ({r.exit_code})")
    kept, _ = rg_lines(r)
    return sorted(kept, key=lambda f: f.split("/")), unread  # (rg's --sort path order)
