"""`dojo traj ...`: look at trajectories. Heavy imports stay inside the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

traj_app = typer.Typer(help="Inspect and convert agent trajectories (.jsonl step logs, .parquet).", no_args_is_help=True)


@traj_app.command("show")
def show(
    path: Annotated[Path, typer.Argument(help="A trajectory .jsonl or a .parquet of trajectories.")],
    index: Annotated[int, typer.Option("--index", "-i", help="Which trajectory of a parquet file.")] = 0,
    full: Annotated[bool, typer.Option("--full", help="Do not shorten long messages.")] = False,
    width: Annotated[int, typer.Option("--max-chars", help="Characters shown per message unless --full.")] = 1500,
) -> None:
    """Print a trajectory readably: header, messages with tool calls, per-turn statistics."""
    from codedojo.harness.render import print_trajectory
    from codedojo.harness.trajectory import load

    if not path.exists():
        raise typer.BadParameter(f"{path} does not exist", param_hint="PATH")
    try:
        trajs = load(path)
    except (ValueError, KeyError) as e:
        raise typer.BadParameter(f"{path}: {e}", param_hint="PATH") from e
    if not 0 <= index < len(trajs):
        raise typer.BadParameter(f"{path} holds {len(trajs)} trajectories", param_hint="--index")
    print_trajectory(trajs[index], max_chars=None if full else width)


@traj_app.command("export")
def export(
    inputs: Annotated[list[Path], typer.Argument(help="Trajectory .jsonl files.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .parquet file to write.")],
) -> None:
    """Collect .jsonl trajectories into one parquet file (one row per trajectory)."""
    from codedojo.harness.trajectory import read_jsonl, write_parquet

    trajs = [read_jsonl(p) for p in inputs]
    write_parquet(trajs, out)
    typer.echo(f"wrote {len(trajs)} trajectories to {out}")


tools_app = typer.Typer(help="The tool service (JSON-RPC) beside a sandbox.", no_args_is_help=True)


@tools_app.command("serve")
def tools_serve(
    image: Annotated[str | None, typer.Option(help="Image id or name to start the sandbox from.")] = None,
    directory: Annotated[Path | None, typer.Option("--dir", help="Build the image from this directory.")] = None,
    root: Annotated[str | None, typer.Option(help="Sandbox store (default: the provider's).")] = None,
    port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1 (0 = any free port).")] = 0,
    uds: Annotated[str | None, typer.Option(help="Serve on this unix socket instead.")] = None,
    env: Annotated[list[str] | None, typer.Option(help="NAME=TOML: an environment's tool config.")] = None,
) -> None:
    """Start a sandbox and serve its tools; prints {url, sandbox_id} as one JSON line."""
    from codedojo.harness.service import main as service_main

    argv = ["--port", str(port)]
    for flag, value in (("--image", image), ("--dir", directory), ("--root", root), ("--uds", uds)):
        if value is not None:
            argv += [flag, str(value)]
    for item in env or []:
        argv += ["--env", item]
    service_main(argv)


def register(app: typer.Typer) -> None:
    app.add_typer(traj_app, name="traj")
    app.add_typer(tools_app, name="tools")
