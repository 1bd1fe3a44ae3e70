from typer.testing import CliRunner

from codedojo.cli import app


def said(res) -> str:
    """A command's output as one line, without the error box's borders."""
    return " ".join(res.output.replace("│", " ").split())


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
    # a task is run only from the split asked for: a train task named in a test run would leak
    train = tiny_suite.manifest.splits["train"]
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "null", "--split",
                              "test", "--task", train[0], "--out-dir", str(tmp_path)])
    assert res.exit_code == 2 and "is not in split 'test'" in said(res)
    # a task named twice runs once
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "null", "--split",
                              "train", "--task", train[0], "--task", train[0], "--name", "twice",
                              "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    import json

    ran = json.loads((tmp_path / "twice" / "results.json").read_text())["results"]
    assert [r["instance_id"] for r in ran] == [train[0]], ran
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "null", "--task",
                              "nope", "--out-dir", str(tmp_path)])
    assert res.exit_code == 2 and "'nope' is no task of" in said(res)
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "null", "--split",
                              "dev", "--out-dir", str(tmp_path)])
    assert res.exit_code == 2 and "--split" in res.output and "no split 'dev'" in said(res)
    # a copied run reports beside its own results, and leaves the original's alone
    import shutil

    shutil.copytree(tmp_path / "cli", tmp_path / "cli-old")
    (tmp_path / "cli" / "report.md").unlink()
    res = runner.invoke(app, ["bench", "report", str(tmp_path / "cli-old")])
    assert res.exit_code == 0 and "dojobench run `cli-old`" in res.output
    assert not (tmp_path / "cli" / "report.md").exists()
    # a finished run is not written over; by default a split's run is named for it
    before = (tmp_path / "cli" / "results.json").read_text()
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "null", "--split",
                              "train", "--name", "cli", "--out-dir", str(tmp_path)])
    assert res.exit_code == 2 and "holds a finished run (results.json)" in said(res)
    assert (tmp_path / "cli" / "results.json").read_text() == before
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "null", "--split",
                              "train", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0 and (tmp_path / "tiny-null-train" / "results.json").is_file()
    (tmp_path / "cli-old" / "results.json").write_text('{"name": "x"}')
    res = runner.invoke(app, ["bench", "report", str(tmp_path / "cli-old")])
    assert res.exit_code == 2 and "not a run's results (KeyError" in said(res)


def test_bad_suite_and_agent_are_named(tmp_path):
    runner = CliRunner()
    for args in (["validate", "micro", "--runs", "0"], ["run", "micro", "--samples", "0"],
                 ["run", "micro", "--limit", "0"], ["run", "micro", "--max-turns", "0"]):
        res = runner.invoke(app, ["bench", *args])
        assert res.exit_code == 2 and "greater than or equal to 1" in res.output, args
    bad = tmp_path / "recipe.toml"
    bad.write_text("[packages\n")
    res = runner.invoke(app, ["bench", "build", str(bad), "--out", str(tmp_path / "s")])
    assert res.exit_code == 2 and "recipe.toml:" in res.output, res.output
    res = runner.invoke(app, ["bench", "build", str(tmp_path), "--out", str(tmp_path / "s")])
    assert res.exit_code == 2 and "is a directory, not a recipe file" in said(res), res.output
    res = runner.invoke(app, ["bench", "validate", str(tmp_path / "nope")])
    assert res.exit_code != 0 and "no suite" in res.output
    res = runner.invoke(app, ["bench", "run", "micro", "--agent", "gpt"])
    assert res.exit_code != 0 and "unknown agent" in res.output
