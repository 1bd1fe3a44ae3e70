"""`dojo traj ...`: look at trajectories. Heavy imports stay inside the commands."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from codedojo.harness.trajectory import Trajectory

traj_app = typer.Typer(help="Inspect and convert agent trajectories (.jsonl step logs, .parquet).", no_args_is_help=True)


@traj_app.command("show")
def show(
    path: Annotated[Path, typer.Argument(help="A trajectory .jsonl or a .parquet of trajectories.")],
    index: Annotated[int, typer.Option("--index", "-i", help="Which trajectory of a parquet file.")] = 0,
    full: Annotated[bool, typer.Option("--full", help="Do not shorten long messages.")] = False,
    width: Annotated[int, typer.Option("--max-chars", min=0,
                                       help="Characters shown per message unless --full.")] = 1500,
) -> None:
    """Print a trajectory readably: header, messages with tool calls, per-turn statistics."""
    from codedojo.harness.render import print_trajectory

    trajs = _load(path, "PATH")
    if not 0 <= index < len(trajs):
        raise typer.BadParameter(f"{path} holds {len(trajs)} trajectories", param_hint="--index")
    print_trajectory(trajs[index], max_chars=None if full else width)


@traj_app.command("export")
def export(
    inputs: Annotated[list[Path], typer.Argument(help="Trajectory .jsonl files.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .parquet file to write.")],
) -> None:
    """Collect .jsonl trajectories into one parquet file (one row per trajectory)."""
    from codedojo.harness.trajectory import write_parquet

    for p in inputs:  # (one that is missing is named by `_load`)
        if out.exists() and p.exists() and out.samefile(p):
            raise typer.BadParameter(f"{out} is the input {p}: it would be written over",
                                     param_hint="--out")
    trajs = [t for p in inputs for t in _load(p, "INPUTS", parquet=False)]
    try:
        write_parquet(trajs, out)
    except OSError as e:
        raise typer.BadParameter(f"{out}: {e.strerror or e}", param_hint="--out") from e
    typer.echo(f"wrote {len(trajs)} trajectories to {out}")


def _load(path: Path, hint: str, parquet: bool = True) -> list[Trajectory]:
    """The trajectories of a .jsonl step log (or, with ``parquet``, a .parquet file); a file
    that is missing, unreadable or not a trajectory is a bad ``hint`` argument."""
    from codedojo.harness.trajectory import load, read_jsonl

    if not path.exists():
        raise typer.BadParameter(f"{path} does not exist", param_hint=hint)
    try:
        return load(path) if parquet else [read_jsonl(path)]
    except OSError as e:  # a directory, unreadable
        raise typer.BadParameter(f"{path}: {e.strerror or e}", param_hint=hint) from e
    except (ValueError, KeyError) as e:
        why = str(e) if str(e).startswith(str(path)) else f"{path}: {e}"  # (not named twice)
        raise typer.BadParameter(why, param_hint=hint) from e


tools_app = typer.Typer(help="The tool service (JSON-RPC) beside a sandbox.", no_args_is_help=True)


@tools_app.command("serve")
def tools_serve(
    image: Annotated[str | None, typer.Option(help="Image id or name to start the sandbox from.")] = None,
    directory: Annotated[Path | None, typer.Option("--dir", help="Build the image from this directory.")] = None,
    root: Annotated[str | None, typer.Option(help="Sandbox store (default: the provider's).")] = None,
    port: Annotated[int, typer.Option(min=0, max=65535,
                                      help="TCP port on 127.0.0.1 (0 = any free port).")] = 0,
    uds: Annotated[str | None, typer.Option(help="Serve on this unix socket instead.")] = None,
    env: Annotated[list[str] | None, typer.Option(help="NAME=TOML: an environment's tool config.")] = None,
    idle_s: Annotated[float | None, typer.Option(
        min=0, help="Close an episode no call used for this many seconds, its shell and jobs "
        "with it (0: never; default: the service's, 1800).")] = None,
) -> None:
    """Start a sandbox and serve its tools; prints {url, sandbox_id} as one JSON line."""
    from codedojo.harness.service import main as service_main
    from codedojo.sandbox.base import SandboxError

    argv = ["--port", str(port)]
    for flag, value in (("--image", image), ("--dir", directory), ("--root", root), ("--uds", uds),
                        ("--idle-s", idle_s)):
        if value is not None:
            argv += [flag, str(value)]
    for item in env or []:
        argv += ["--env", item]
    try:
        service_main(argv)
    except SandboxError as e:  # no such image, a directory it cannot build from
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def register(app: typer.Typer) -> None:
    app.add_typer(traj_app, name="traj")
    app.add_typer(tools_app, name="tools")
