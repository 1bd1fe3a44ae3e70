"""A file's lines as grep, ripgrep and editors count them: split at "\n" only.

`str.splitlines` also splits at form feeds, vertical tabs, U+0085, U+2028 and more, so a
tool that numbered lines with it disagreed with `grep -n` on the same file (a form feed, as
PEP 8 allows between sections, added a line), and a model sent to a line by one tool read
another with the next."""

from __future__ import annotations

import re


def lines_with_ends(text: str) -> list[str]:
    """The lines of ``text`` with their "\\n" (the last one without, if the text lacks it): what
    `str.splitlines(keepends=True)` gives, split at "\\n" only."""
    return re.split(r"(?<=\n)(?!\Z)", text) if text else []


def file_lines(text: str) -> list[str]:
    """The lines of ``text``, without their "\n" (nor a "\r" before it); a final "\n" ends the
    last line rather than starting an empty one."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]
