"""The `dojo` command: one sub-command per stage.

Each stage package owns a `cli.py` with `register(app)`; this file only assembles them, so a
stage's heavy imports (torch, mitmproxy) happen when its command runs, not at start-up.
"""

from __future__ import annotations

import importlib

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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
