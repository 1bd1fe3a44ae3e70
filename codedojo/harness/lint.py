"""Ruff over a sandbox's files, run on the host.

Why on the host: ruff ships in the training venv but not in every task image, and it only
parses the files (it never runs them), so giving it copies of the sandbox's files is safe and
gives the same answer on every image. The repository's own ruff settings (.ruff.toml,
ruff.toml, or pyproject.toml's [tool.ruff] at /workspace, the first that has them, as ruff
takes them) travel with the files, less ``extend``: a path on the host, which ruff would read
there (and quote back in its error); so does pyproject.toml's ``requires-python``, from which
ruff takes the Python version its rules judge by. Ruff reads those settings alone, or none
(``--isolated``): no settings of the host's, above the copies or the user's, change the
answer. Shared by the `read_lints` tool and the lint-delta reward.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from codedojo.sandbox.base import WORKSPACE

CONFIG_FILES = (".ruff.toml", "ruff.toml", "pyproject.toml")  # ruff's order: the first wins


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


def _parsed(configs: Mapping[str, str], name: str) -> dict[str, Any]:
    try:
        return tomllib.loads(configs[name])
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"the repository's {name} is not TOML: {e}") from None


def ruff_settings(configs: Mapping[str, str]) -> dict[str, Any] | None:
    """The repository's ruff settings from its config files' texts (name -> text), as ruff
    finds them at the root (the first of `CONFIG_FILES` that has any), less ``extend``; None
    where none has any. A file that is not TOML is a `ValueError` naming it."""
    for name in CONFIG_FILES:
        if name not in configs:
            continue
        data = _parsed(configs, name)
        if name == "pyproject.toml":
            tool = data.get("tool")
            data = tool.get("ruff") if isinstance(tool, dict) else None
            if not isinstance(data, dict):
                continue  # (a pyproject.toml without ruff settings: ruff looks on)
        data.pop("extend", None)
        return data
    return None


def requires_python(configs: Mapping[str, str]) -> str | None:
    """pyproject.toml's ``[project].requires-python``, where the repository says it."""
    if "pyproject.toml" not in configs:
        return None
    project = _parsed(configs, "pyproject.toml").get("project")
    value = project.get("requires-python") if isinstance(project, dict) else None
    return value if isinstance(value, str) else None


def ruff_check(
    files: Mapping[str, str], configs: Mapping[str, str] | None = None, timeout: float = 60.0,
    ignore_noqa: bool = False,
) -> list[Diagnostic]:
    """Lint `files` (sandbox path -> text). `configs` maps config names (e.g. 'pyproject.toml')
    found at /workspace to their text. ``ignore_noqa``: count what ``# noqa`` comments hide
    (a reward's count, which a comment must not zero)."""
    if not files:
        return []
    settings = ruff_settings(configs or {})
    python = requires_python(configs or {})
    with tempfile.TemporaryDirectory(prefix="dojo-lint-") as tmp:
        root = Path(tmp)
        if settings is None and python is None:
            config = ["--isolated"]
        else:
            doc: dict[str, Any] = {"tool": {"ruff": settings or {}}}
            if python is not None:
                doc["project"] = {"requires-python": python}
            (root / "pyproject.toml").write_text(tomli_w.dumps(doc))
            config = ["--config", str(root / "pyproject.toml")]
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
             *config, *(["--ignore-noqa"] if ignore_noqa else []), *sorted(local)],
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
