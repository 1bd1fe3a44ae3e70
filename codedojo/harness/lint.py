"""Ruff over a sandbox's files, run on the host.

Why on the host: ruff ships in the training venv but not in every task image, and it only
parses the files (it never runs them), so giving it copies of the sandbox's files is safe and
gives the same answer on every image. The repository's own ruff settings (.ruff.toml,
ruff.toml, or pyproject.toml's [tool.ruff] at /workspace, the first that has them, as ruff
takes them) travel with the files, less ``extend``: a path on the host, which ruff would read
there (and quote back in its error); so does pyproject.toml's ``requires-python``, from which
ruff takes the Python version its rules judge by. Ruff reads those settings alone, or none
(``--isolated``): no settings of the host's, above the copies or the user's, change the
answer. Settings that are not TOML, or that this ruff refuses (a rule it removed, a misspelt
key), are `ConfigRejected`, which the lint-delta reward answers by linting with ruff's
defaults. Shared by the `read_lints` tool and the lint-delta reward.
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


class ConfigRejected(ValueError):
    """The repository's ruff configuration is not TOML, or this ruff refuses it (a rule it
    removed, a misspelt key): the message says which and why."""


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


def ruff_config(configs: Mapping[str, str]) -> dict[str, Any] | None:
    """The pyproject.toml ruff is to read, from the repository's config files' texts (name ->
    text): its ruff settings as ruff finds them at the root (the first of `CONFIG_FILES` that
    has any) less ``extend``, and pyproject.toml's ``requires-python``; None where it has
    neither. A file that is not TOML is a `ConfigRejected` naming it."""
    parsed: dict[str, dict[str, Any]] = {}
    for name in CONFIG_FILES:
        if name in configs:
            try:
                parsed[name] = tomllib.loads(configs[name])
            except tomllib.TOMLDecodeError as e:
                raise ConfigRejected(f"the repository's {name} is not TOML: {e}") from None
    pyproject = parsed.get("pyproject.toml", {})
    tool = pyproject.get("tool")
    if isinstance(tool, dict) and isinstance(tool.get("ruff"), dict):
        parsed["pyproject.toml"] = tool["ruff"]  # (one without ruff settings: ruff looks on)
    else:
        parsed.pop("pyproject.toml", None)
    settings = next((parsed[n] for n in CONFIG_FILES if n in parsed), None)
    project = pyproject.get("project")
    python = project.get("requires-python") if isinstance(project, dict) else None
    if settings is None and not isinstance(python, str):
        return None
    doc: dict[str, Any] = {"tool": {"ruff": {k: v for k, v in (settings or {}).items()
                                             if k != "extend"}}}
    if isinstance(python, str):
        doc["project"] = {"requires-python": python}
    return doc


def ruff_check(
    files: Mapping[str, str], configs: Mapping[str, str] | None = None, timeout: float = 60.0,
    ignore_noqa: bool = False,
) -> list[Diagnostic]:
    """Lint `files` (sandbox path -> text). `configs` maps config names (e.g. 'pyproject.toml')
    found at /workspace to their text. ``ignore_noqa``: count what ``# noqa`` comments hide
    (a reward's count, which a comment must not zero). `ConfigRejected` where ruff fails by
    the repository's settings and not without them (``--isolated``); RuntimeError where it
    fails either way."""
    if not files:
        return []
    doc = ruff_config(configs or {})
    with tempfile.TemporaryDirectory(prefix="dojo-lint-") as tmp:
        root = Path(tmp)
        if doc is None:
            config = ["--isolated"]
        else:
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
        def run(config: list[str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [ruff_bin(), "check", "--no-cache", "--output-format", "json", "--exit-zero",
                 *config, *(["--ignore-noqa"] if ignore_noqa else []), *sorted(local)],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=timeout,
            )

        proc = run(config)
        if proc.returncode != 0:
            why = proc.stderr.strip()[:2000]
            if doc is not None and run(["--isolated"]).returncode == 0:
                raise ConfigRejected(f"ruff rejects the repository's settings: {why}")
            raise RuntimeError(f"ruff failed: {why}")
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
