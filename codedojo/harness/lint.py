"""Ruff over a sandbox's files, run on the host.

Why on the host: ruff ships in the training venv but not in every task image, and it only
parses the files (it never runs them), so giving it copies of the sandbox's files is safe and
gives the same answer on every image. The repository's own ruff settings (ruff.toml,
.ruff.toml, pyproject.toml at /workspace) travel with the files. Shared by the `read_lints` tool
and the lint-delta reward.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from codedojo.sandbox.base import WORKSPACE

CONFIG_FILES = ("ruff.toml", ".ruff.toml", "pyproject.toml")


@dataclass(frozen=True)
class Diagnostic:
    path: str  # inside the sandbox
    line: int
    column: int
    code: str
    message: str

    def render(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.code} {self.message}"


def ruff_bin() -> str:
    from ruff.__main__ import find_ruff_bin

    return str(find_ruff_bin())


_OUTSIDE = "__outside_workspace__"


def ruff_check(
    files: Mapping[str, str], configs: Mapping[str, str] | None = None, timeout: float = 60.0,
    ignore_noqa: bool = False,
) -> list[Diagnostic]:
    """Lint `files` (sandbox path -> text). `configs` maps config names (e.g. 'pyproject.toml')
    found at /workspace to their text. ``ignore_noqa``: count what ``# noqa`` comments hide
    (a reward's count, which a comment must not zero)."""
    if not files:
        return []
    with tempfile.TemporaryDirectory(prefix="dojo-lint-") as tmp:
        root = Path(tmp)
        for name, text in (configs or {}).items():
            (root / name).write_text(text)
        local: dict[str, str] = {}
        for path, text in files.items():
            rel = os.path.relpath(path, WORKSPACE) if path.startswith(WORKSPACE + "/") else ".."
            if rel.startswith(".."):  # (apart: /tmp/a.py is not /workspace/tmp/a.py)
                rel = _OUTSIDE + "/" + os.path.normpath(path).lstrip("/")
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
            local[str(dest.resolve())] = path
        proc = subprocess.run(
            [ruff_bin(), "check", "--no-cache", "--output-format", "json", "--exit-zero",
             *(["--ignore-noqa"] if ignore_noqa else []), *sorted(local)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ruff failed: {proc.stderr.strip()[:2000]}")
        out: list[Diagnostic] = []
        for d in json.loads(proc.stdout or "[]"):
            fname = str(Path(d["filename"]).resolve())
            out.append(
                Diagnostic(
                    path=local.get(fname, d["filename"]),
                    line=int(d["location"]["row"]),
                    column=int(d["location"]["column"]),
                    code=str(d.get("code") or "syntax-error"),
                    message=str(d["message"]),
                )
            )
    out.sort(key=lambda d: (d.path, d.line, d.column))
    return out
