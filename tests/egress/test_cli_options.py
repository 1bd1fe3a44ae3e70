"""`dojo egress serve`'s options: bad ones are named before anything starts."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from codedojo.egress.cli import egress_app


def test_a_config_that_cannot_be_read_is_named(tmp_path):
    runner = CliRunner()
    for config, says in ((tmp_path / "missing.toml", "no such file"),
                         (tmp_path / "bad.toml", "bad.toml: ")):
        if config.name == "bad.toml":
            config.write_text("[egress\n")
        res = runner.invoke(egress_app, ["serve", "--config", str(config)])
        assert res.exit_code == 2 and "--config" in res.output and says in res.output, res.output
    res = runner.invoke(egress_app, ["serve", "--explicit-port", "-1"])
    assert res.exit_code == 2 and "--explicit-port" in res.output


def test_a_bad_port_or_config_field_is_named_as_itself(tmp_path):
    """A port out of range is the option's fault, not the config's; a config whose egress or
    egress.proxy is not a table is refused naming it (not a crash)."""
    runner = CliRunner()
    for option in ("--explicit-port", "--transparent-port"):
        res = runner.invoke(egress_app, ["serve", option, "70000", "--state-dir", str(tmp_path)])
        assert res.exit_code == 2 and option in res.output, res.output
        assert "--config" not in res.output, res.output
    config = tmp_path / "c.toml"
    for text, says in (('egress = "on"\n', "egress must be a table"),
                       ("[egress]\nproxy = 3\n", "egress.proxy must be a table"),
                       ("[egress.proxy]\ndns_port = 70000\n", "egress.proxy.dns_port: ")):
        config.write_text(text)
        res = runner.invoke(egress_app, ["serve", "--config", str(config),
                                         "--state-dir", str(tmp_path)])  # fmt: skip
        assert res.exit_code == 2, (text, res.exception)
        flat = " ".join(res.output.replace("│", " ").split())  # (rich wraps it in a box)
        assert "--config" in flat and says in flat, res.output


class _Made(Exception):
    """Raised by `_Proxy.start`: the command got as far as starting the proxy."""


class _Proxy:
    """Stands in for `EgressProxy`: keeps the config it was made with; nothing is started."""

    made: list[_Proxy] = []

    def __init__(self, config) -> None:
        self.config, self.stopped = config, False
        self.ports = None  # (a command that went on past the control socket stops at this)
        _Proxy.made.append(self)

    def start(self) -> _Proxy:
        raise _Made

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def fake_proxy(monkeypatch):
    from codedojo.egress import proxy

    _Proxy.made = []
    monkeypatch.setattr(proxy, "EgressProxy", _Proxy)
    return _Proxy


def test_a_port_of_zero_overrides_the_configs(tmp_path, fake_proxy):
    config = tmp_path / "c.toml"
    config.write_text("[egress.proxy]\nexplicit_port = 18601\ntransparent_port = 18602\n")
    args = ["serve", "--config", str(config), "--state-dir", str(tmp_path)]
    res = CliRunner().invoke(egress_app, args)
    assert isinstance(res.exception, _Made), res.output
    assert (fake_proxy.made[0].config.explicit_port,
            fake_proxy.made[0].config.transparent_port) == (18601, 18602)  # fmt: skip
    res = CliRunner().invoke(egress_app, [*args, "--explicit-port", "0",
                                          "--transparent-port", "0"])  # fmt: skip
    assert isinstance(res.exception, _Made), res.output
    assert (fake_proxy.made[1].config.explicit_port,
            fake_proxy.made[1].config.transparent_port) == (0, 0)  # fmt: skip


def test_a_port_taken_is_named_before_the_proxy_starts(tmp_path, fake_proxy):
    """As the option's fault when the option gave it, as the config's field otherwise."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.toml"
        config.write_text(f"[egress.proxy]\ntransparent_port = {port}\n")
        for args, says in ((["--explicit-port", str(port)],
                            f"Invalid value for --explicit-port: port {port} is taken"),
                           (["--config", str(config)],
                            f"--config: {config}: egress.proxy.transparent_port: port {port} "
                            "is taken")):  # fmt: skip
            res = CliRunner().invoke(egress_app, ["serve", "--state-dir", str(tmp_path), *args],
                                     env={"COLUMNS": "300"})  # fmt: skip
            flat = " ".join(res.output.replace("│", " ").split())
            assert res.exit_code == 2 and says in flat, res.output
    assert fake_proxy.made == []


def test_a_control_socket_path_that_is_taken_is_named(tmp_path, fake_proxy, monkeypatch):
    """The proxy started before it is stopped again; the file there is kept."""
    monkeypatch.setattr(_Proxy, "start", lambda self: self)
    kept = tmp_path / "results.txt"
    kept.write_text("results\n")
    res = CliRunner().invoke(egress_app, ["serve", "--state-dir", str(tmp_path),
                                          "--control-socket", str(kept)],
                             env={"COLUMNS": "300"})  # fmt: skip
    flat = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2, res.output
    assert f"--control-socket: {kept} exists and is not a socket" in flat, res.output
    assert kept.read_text() == "results\n" and fake_proxy.made[0].stopped
