"""`dojo egress serve`'s options: bad ones are named before anything starts."""

from __future__ import annotations

from typer.testing import CliRunner

from codedojo.egress.cli import egress_app


def test_a_config_that_cannot_be_read_is_named(tmp_path):
    runner = CliRunner()
    for config, says in ((tmp_path / "missing.toml", "No such file"),
                         (tmp_path / "bad.toml", "bad.toml: ")):
        if config.name == "bad.toml":
            config.write_text("[egress\n")
        res = runner.invoke(egress_app, ["serve", "--config", str(config)])
        assert res.exit_code == 2 and "--config" in res.output and says in res.output, res.output
    res = runner.invoke(egress_app, ["serve", "--explicit-port", "-1"])
    assert res.exit_code == 2 and "--explicit-port" in res.output
