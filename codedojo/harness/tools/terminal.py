"""run_terminal_cmd: the sandbox's persistent shell, so `cd` and exports carry between calls."""

from __future__ import annotations

import itertools
from typing import Any

from codedojo.harness.tools.base import FunctionTool, ToolContext, ToolError, obj, shell_quote

_bg_ids = itertools.count(1)


def _run_terminal_cmd(ctx: ToolContext, args: dict[str, Any]) -> str:
    command = args["command"]
    if not command.strip():
        raise ToolError("command is empty")
    # The model may ask for less time than the environment allows, never more.
    timeout = min(float(args.get("timeout") or ctx.timeout_s), ctx.timeout_s)
    shell = ctx.shell()
    if args.get("is_background"):
        n = next(_bg_ids)
        log = f"/tmp/dojo-bg-{n}.log"
        r = shell.run(
            f"nohup sh -c {shell_quote(command)} > {log} 2>&1 < /dev/null & echo $!", timeout=timeout
        )
        pid = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "?"
        ctx.state.setdefault("background", []).append({"pid": pid, "log": log, "command": command})
        return f"Started in the background (pid {pid}); output goes to {log}."
    r = shell.run(command, timeout=timeout)
    if r.timed_out:
        # A command that outlived its time leaves the shell in an unknown state: start afresh.
        ctx.reset_shell()
        out = (r.stdout + r.stderr).rstrip()
        raise ToolError(
            f"command timed out after {timeout:.0f}s; the shell was restarted (cwd and variables reset)"
            + (f"\npartial output:\n{out}" if out else "")
        )
    parts = [f"exit code: {r.exit_code}"]
    if r.stdout:
        parts.append(r.stdout.rstrip("\n"))
    if r.stderr:
        parts.append("stderr:\n" + r.stderr.rstrip("\n"))
    if r.truncated:
        parts.append("[output truncated by the sandbox]")
    return "\n".join(parts)


RUN_TERMINAL_CMD = FunctionTool(
    name="run_terminal_cmd",
    description=(
        "Run a shell command in the workspace. The shell persists between calls (cwd, exported "
        "variables). Set is_background for long-running servers; their output goes to a log file."
    ),
    parameters=obj(
        {
            "command": {"type": "string", "description": "The command line."},
            "is_background": {"type": "boolean", "description": "Run detached and return at once."},
            "timeout": {"type": "number", "minimum": 1, "description": "Seconds before the command is stopped."},
        },
        ["command"],
    ),
    fn=_run_terminal_cmd,
)
