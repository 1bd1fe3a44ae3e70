"""The `dojo` command: one sub-command per stage.

Each stage package owns a `cli.py` with `register(app)`; this file only assembles them, so a
stage's heavy imports (torch, mitmproxy) happen when its command runs, not at start-up.
"""

from __future__ import annotations

import importlib
import signal
import sys

import typer

STAGES = ("engine", "sandbox", "egress", "harness", "bench", "pretrain")

app = typer.Typer(
    help="codedojo: train agentic coding models (pretrain, MTP, sandboxed RL, benchmark).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _register_stages() -> None:
    for stage in STAGES:
        importlib.import_module(f"codedojo.{stage}.cli").register(app)


_register_stages()


def exit_on_sigterm() -> None:
    """SIGTERM (`kill`, `timeout`, a scheduler's preemption, torchrun stopping its workers)
    ends a command as Ctrl-C does, with status 143: its ``finally`` blocks and exit handlers
    run, so its sandboxes, mounts and half-written files are cleaned up. Python's default is
    to die at once, running none of them. A server that takes SIGTERM itself (uvicorn) still
    does."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main() -> None:
    exit_on_sigterm()
    app()


if __name__ == "__main__":
    main()
