"""`dojo egress serve`'s options: bad ones are named before anything starts."""

from __future__ import annotations

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
