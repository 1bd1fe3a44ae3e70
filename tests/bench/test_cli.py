from typer.testing import CliRunner

from codedojo.cli import app


def test_bench_commands_on_the_fixture_suite(tiny_suite, provider, monkeypatch, tmp_path):
    monkeypatch.setenv("CODEDOJO_SANDBOX_ROOT", provider.root)  # reuse the session's built images
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "validate", str(tiny_suite.path), "--sample", "1", "--runs", "1"])
    assert res.exit_code == 0, res.output
    assert "1/1 tasks valid" in res.output
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "oracle", "--split", "train",
                              "--name", "cli", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "cli" / "report.md").is_file() and (tmp_path / "cli" / "report.png").is_file()
    res = runner.invoke(app, ["bench", "report", str(tmp_path / "cli")])
    assert res.exit_code == 0 and "dojobench run `cli`" in res.output


def test_bad_suite_and_agent_are_named(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "validate", str(tmp_path / "nope")])
    assert res.exit_code != 0 and "no suite" in res.output
    res = runner.invoke(app, ["bench", "run", "micro", "--agent", "gpt"])
    assert res.exit_code != 0 and "unknown agent" in res.output
