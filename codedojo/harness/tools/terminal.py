"""run_terminal_cmd: the sandbox's persistent shell, so `cd` and exports carry between calls."""

from __future__ import annotations

import itertools
from typing import Any

from codedojo.harness.tools.base import FunctionTool, ToolContext, ToolError, obj
from codedojo.sandbox.base import Shell

_bg_ids = itertools.count(1)


def _run_terminal_cmd(ctx: ToolContext, args: dict[str, Any]) -> str:
    command = args["command"]
    if not command.strip():
        raise ToolError("command is empty")
    # The model may ask for less time than the environment allows, never more.
    timeout = min(float(args.get("timeout") or ctx.timeout_s), ctx.timeout_s)
    shell = ctx.shell()
    if args.get("is_background"):
        return _start_in_background(ctx, shell, command, timeout)
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
        parts.append("[output past the sandbox's limit: its middle was cut]")
    if shell.exited:  # (`exit`, `set -e` on a failure): as after a timeout, the state is gone
        parts.append("[the shell exited: the next command runs in a new one (cwd and "
                     "variables reset)]")
    return "\n".join(parts)


# Run apart from the shell, whose end on a timeout ends all it started, in its directory and with
# its exported variables: a command that ends by itself leaves its background jobs running.
_LAUNCH = ('source "$1" 2>/dev/null; rm -f "$1"; '
           'nohup bash -c "$2" > "$3" 2>&1 < /dev/null & echo $!')


def _start_in_background(ctx: ToolContext, shell: Shell, command: str, timeout: float) -> str:
    n = next(_bg_ids)
    log, env = f"/tmp/dojo-bg-{n}.log", f"/tmp/dojo-bg-{n}.env"
    r = shell.run(f'export -p > {env} && printf %s "$PWD"', timeout=timeout)
    if r.exit_code != 0 or not r.stdout:
        raise ToolError(f"cannot read the shell's directory and variables: {r.stderr.strip()}")
    r = ctx.sandbox.exec(["bash", "-c", _LAUNCH, "bash", env, command, log], cwd=r.stdout,
                         timeout=timeout)
    pid = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "?"
    ctx.state.setdefault("background", []).append({"pid": pid, "log": log, "command": command})
    return f"Started in the background (pid {pid}); output goes to {log}."


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
