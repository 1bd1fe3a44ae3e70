"""`dojo egress ...`: run the egress proxy as a service, check a policy file."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated

import typer

egress_app = typer.Typer(help="The egress proxy: policy, secret stripping, audit log.",
                         no_args_is_help=True)  # fmt: skip


@egress_app.command("serve")
def serve(
    state_dir: Annotated[
        Path | None,
        typer.Option(help="CA, audit logs, control socket (default: the config's, else "
                     "runs/egress)."),
    ] = None,
    explicit_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535,
                     help="HTTP_PROXY listener; 0 = any (default: the config's, else any)."),
    ] = None,
    transparent_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535,
                     help="Transparent listener; 0 = any (default: the config's, else any)."),
    ] = None,
    control_socket: Annotated[
        Path | None,
        typer.Option(
            help="Unix socket sandboxes attach through (default: STATE_DIR/control.sock)."
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="TOML file with an [egress.proxy] (or top-level) EgressProxyConfig."),
    ] = None,
) -> None:
    """Run the proxy until interrupted; sandboxes attach over the control socket."""
    import signal
    import threading

    from pydantic import ValidationError
    from rich.console import Console

    from codedojo.configfile import field_errors, read_toml
    from codedojo.egress.control import ControlServer
    from codedojo.egress.proxy import EgressProxy, EgressProxyConfig

    console = Console()
    data: dict = {}
    where = ""  # the table the config's fields are read from
    if config is not None:
        try:
            raw = read_toml(config)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--config") from None
        egress = raw.get("egress", {})
        if not isinstance(egress, dict) or not isinstance(egress.get("proxy", {}), dict):
            what = "egress" if not isinstance(egress, dict) else "egress.proxy"
            raise typer.BadParameter(f"{config}: {what} must be a table ([egress.proxy])",
                                     param_hint="--config")  # fmt: skip
        data, where = (egress["proxy"], "egress.proxy.") if "proxy" in egress else (raw, "")
    if state_dir is not None or "state_dir" not in data:
        data = {**data, "state_dir": state_dir or Path("runs/egress")}
    if explicit_port is not None:
        data["explicit_port"] = explicit_port
    if transparent_port is not None:
        data["transparent_port"] = transparent_port
    try:
        cfg = EgressProxyConfig.model_validate(data)
    except ValidationError as e:  # (the options' values are in range: the config's are wrong)
        raise typer.BadParameter(f"{config}: {field_errors(e.errors(), where)}",
                                 param_hint="--config") from None
    # A port taken is named here: the proxy itself only finds that its listeners do not come up.
    for field, option, kind in (("explicit_port", explicit_port, socket.SOCK_STREAM),
                                ("transparent_port", transparent_port, socket.SOCK_STREAM),
                                ("dns_port", None, socket.SOCK_DGRAM)):  # fmt: skip
        port = getattr(cfg, field)
        why = _port_taken(cfg.listen_host, port, kind) if port else None
        if why and option is not None:
            raise typer.BadParameter(f"port {port} is taken on {cfg.listen_host} ({why})",
                                     param_hint=f"--{field.replace('_', '-')}")  # fmt: skip
        if why:
            raise typer.BadParameter(f"{config}: {where}{field}: port {port} is taken on "
                                     f"{cfg.listen_host} ({why})", param_hint="--config")
    proxy = EgressProxy(cfg).start()
    sock = control_socket or cfg.state_dir / "control.sock"
    try:
        control = ControlServer(proxy, sock).start()
    except OSError as e:  # a file that is not a socket, another proxy's socket
        proxy.stop()
        raise typer.BadParameter(str(e), param_hint="--control-socket") from None
    assert proxy.ports is not None
    console.print(
        f"[bold]egress proxy[/bold] explicit :{proxy.ports.explicit}  "
        f"transparent :{proxy.ports.transparent}  dns :{proxy.ports.dns}\n"
        f"CA {proxy.ca_dir / 'mitmproxy-ca-cert.pem'}\ncontrol {sock}\n"
        f"audit {cfg.state_dir / 'audit'}/<sandbox>.jsonl"
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        control.stop()
        proxy.stop()
        console.print("egress proxy stopped")


def _port_taken(host: str, port: int, kind: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` (TCP or UDP, as ``kind``), or None if it can."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as s:
        if kind == socket.SOCK_STREAM:  # (as a listener binds: a port in TIME_WAIT is free)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


@egress_app.command("check-policy")
def check_policy(
    path: Annotated[Path, typer.Argument(help="TOML policy file.")],
    table: Annotated[str | None, typer.Option(help="Read the policy from this [table].")] = None,
) -> None:
    """Validate a policy file and print it with its defaults filled in."""
    from codedojo.egress.policy import EgressPolicy, PolicyError

    try:
        policy = EgressPolicy.from_toml(path, table)
    except PolicyError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(policy.model_dump_json(indent=2))


@egress_app.command("gc")
def gc() -> None:
    """Remove iptables chains and veth links left by egress proxies that are no longer running."""
    from codedojo.egress.network import gc_stale

    tags = gc_stale()
    typer.echo(
        f"removed {len(tags)} stale proxy instance(s){': ' + ', '.join(tags) if tags else ''}"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(egress_app, name="egress")
