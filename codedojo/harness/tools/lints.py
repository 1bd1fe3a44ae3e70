"""read_lints: ruff diagnostics for files in the sandbox (see `codedojo.harness.lint` for why
ruff runs on the host over copies of the files)."""

from __future__ import annotations

from typing import Any

from codedojo.harness.lint import CONFIG_FILES, ruff_check
from codedojo.harness.ripgrep import RgError, rg_files
from codedojo.harness.tools.base import FunctionTool, ToolContext, ToolError, obj, resolve
from codedojo.harness.tools.files import MAX_TEXT_BYTES, is_dir, read_text
from codedojo.sandbox.base import WORKSPACE, SandboxError

MAX_FILES = 200
PYTHON_GLOBS = ("*.py", "*.pyi")


def _python_files(ctx: ToolContext, root: str) -> list[str]:
    try:  # (a file it cannot read, ruff cannot either)
        return rg_files(ctx.sandbox, [root], PYTHON_GLOBS, ["--max-filesize", str(MAX_TEXT_BYTES)],
                        timeout=ctx.timeout_s)[0]
    except RgError as e:
        raise ToolError(f"cannot list files under {root}: {e}") from None


def workspace_configs(sandbox: Any) -> dict[str, str]:
    configs: dict[str, str] = {}
    for name in CONFIG_FILES:
        try:  # (no config file is that large; none is read whole into the host)
            data = sandbox.read_file(f"{WORKSPACE}/{name}", max_bytes=MAX_TEXT_BYTES)
        except (FileNotFoundError, SandboxError, OSError):  # (FileTooLarge among them)
            continue
        configs[name] = data.decode("utf-8", "replace")
    return configs


def _read_lints(ctx: ToolContext, args: dict[str, Any]) -> str:
    paths = [resolve(p) for p in (args.get("paths") or [])]
    if not paths:
        # By default: what the agent edited, else the whole workspace.
        paths = [p for p in ctx.state.get("edited", []) if p.endswith((".py", ".pyi"))]
        paths = paths or [WORKSPACE]
    files: dict[str, str] = {}
    for p in paths:
        try:
            info = ctx.sandbox.stat(p)
        except (FileNotFoundError, SandboxError):
            if args.get("paths"):
                raise ToolError(f"path not found: {p}") from None
            continue
        # (a link to a directory is one: followed, as grep and list_dir follow it)
        tree = info.kind == "dir" or (info.kind == "symlink" and is_dir(ctx, p))
        targets = _python_files(ctx, p) if tree else [p]
        for t in targets[: MAX_FILES - len(files)]:
            try:
                files[t] = read_text(ctx, t) or ""
            except ToolError:
                if tree:  # a binary or huge file of a tree: not linted
                    continue
                raise
    if not files:
        return "No Python files to lint."
    try:
        diags = ruff_check(files, workspace_configs(ctx.sandbox), timeout=ctx.timeout_s)
    except ValueError as e:  # (the repository's config, not TOML)
        raise ToolError(str(e)) from None
    if not diags:
        return f"No lint errors in {len(files)} file{'s' if len(files) > 1 else ''}."
    return "\n".join(d.render() for d in diags) + f"\n{len(diags)} lint error(s)."


READ_LINTS = FunctionTool(
    name="read_lints",
    description=(
        "Lint Python files with ruff. paths: files or directories (default: the files you edited, "
        "else the whole workspace)."
    ),
    parameters=obj(
        {
            "paths": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Files or directories to lint.",
            }
        },
        [],
    ),
    fn=_read_lints,
)
