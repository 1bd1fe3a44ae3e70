import pytest
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
    # `.` inside a run directory is that run, by its directory's name
    monkeypatch.chdir(tmp_path / "cli")
    res = runner.invoke(app, ["bench", "report", "."])
    assert res.exit_code == 0 and "dojobench run `cli`" in res.output, res.output
    assert (tmp_path / "cli" / "report.md").read_text().startswith("# dojobench run `cli`")
    monkeypatch.chdir(tmp_path)
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


def test_run_names_endpoints_and_unbuilt_suites_are_refused_up_front(tmp_path, monkeypatch):
    runner = CliRunner()
    out = tmp_path / "runs"
    # a run's name is one plain path component: it cannot lead out of --out-dir
    for name in ("../escaped", str(tmp_path / "abs"), ".", "a/b", ""):
        res = runner.invoke(app, ["bench", "run", "micro", "--agent", "null", "--name", name,
                                  "--out-dir", str(out)])
        assert res.exit_code == 2 and "--name" in res.output, (name, res.output)
        assert "is not a plain name" in said(res), name
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # an endpoint that is no http(s) URL is named before anything runs
    for cmd in (["bench", "run", "micro", "--agent", "smollm2"], ["demo"]):
        for url in ("not-a-url", "ftp://host/v1", "http://"):
            res = runner.invoke(app, [*cmd, "--base-url", url, "--out-dir", str(out)])
            assert res.exit_code == 2 and "--base-url" in res.output, (cmd, url, res.output)
            assert "is not an http(s) URL" in said(res), (cmd, url)
    assert not out.exists()
    # a suite shipped as a recipe only says how to build it where `bench run` looks
    monkeypatch.setenv("CODEDOJO_CACHE", str(tmp_path / "cache"))
    res = runner.invoke(app, ["bench", "run", "micro", "--agent", "null", "--out-dir", str(out)])
    assert res.exit_code == 2 and "ships as a recipe only" in said(res), res.output
    assert "`dojo demo` builds it" in said(res)
    from codedojo.bench.suite import SUITES_DIR, load_suite

    recipe, built = SUITES_DIR / "micro" / "recipe.toml", tmp_path / "cache" / "bench" / "suites"
    with pytest.raises(FileNotFoundError) as e:
        load_suite("micro")
    assert f"`dojo bench build {recipe} -o {built / 'micro'}`" in str(e.value)


def test_an_out_dir_that_is_a_file_is_named(tiny_suite, monkeypatch, tmp_path):
    """`--out-dir` naming a file, or a folder under one: one line naming it, exit status 2,
    before anything runs."""
    import codedojo.bench.demo as demo

    def no_sandboxes():
        raise AssertionError("a sandbox provider was started")

    monkeypatch.setattr(demo, "micro_suite", lambda log: tiny_suite)
    monkeypatch.setattr("codedojo.bench.workspace.default_provider", no_sandboxes)
    runner = CliRunner()
    afile = tmp_path / "afile"
    afile.write_text("kept")
    for out, why in ((afile, f"{afile} is not a directory"),
                     (afile / "runs", f"{afile / 'runs'}: Not a directory")):
        for cmd in (["bench", "run", str(tiny_suite.path), "--agent", "null", "--limit", "1"],
                    ["demo"]):
            res = runner.invoke(app, [*cmd, "--out-dir", str(out)], env={"COLUMNS": "300"})
            assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (cmd, res.output)
            assert "--out-dir" in res.output and why in said(res), (cmd, res.output)
    assert afile.read_text() == "kept"


def test_a_run_with_no_episode_that_ran_fails(tiny_suite, provider, monkeypatch, tmp_path):
    monkeypatch.setenv("CODEDOJO_SANDBOX_ROOT", provider.root)
    import socket

    runner = CliRunner()
    # a port held but not listened on refuses every connection: every episode is an infra failure
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{held.getsockname()[1]}/v1"
    res = runner.invoke(app, ["bench", "run", str(tiny_suite.path), "--agent", "smollm2",
                              "--base-url", dead, "--limit", "1", "--name", "dead",
                              "--out-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    assert "every one of the run's 1 episode(s) was an infra failure" in said(res)
    assert "Connection" in said(res) and "choose another --name" in said(res)
    # the demo fails when SmolLM2's half does, even though the oracle resolved every task
    import codedojo.bench.demo as demo

    monkeypatch.setattr(demo, "micro_suite", lambda log: tiny_suite)
    res = runner.invoke(app, ["demo", "--base-url", dead, "--out-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    assert "oracle resolved every task" in res.output
    assert "SmolLM2 evaluation failed: every one of the run's 3 episode(s)" in said(res)

    def broken(**kw):
        raise RuntimeError("no model here")

    monkeypatch.setattr("codedojo.bench.models.smollm2_agent", broken)
    res = runner.invoke(app, ["demo", "--out-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output
    assert "oracle resolved every task" in res.output and "no model here" in res.output
    assert "SmolLM2 evaluation failed: it raised an error" in said(res)
    held.close()


def test_build_keeps_a_suite_of_another_name_or_version(tiny_suite, tmp_path, monkeypatch):
    import shutil

    import codedojo.bench.builder as builder
    from codedojo.bench.suite import load_suite, save_suite

    out = tmp_path / "suite"
    shutil.copytree(tiny_suite.path, out)
    built = []

    # the tiny suite's tasks, named as asked
    def build_suite(plan, path, log=print, jobs=1, check=None):
        built.append((plan.name, plan.version))
        return save_suite(path, plan.name, plan.version, tiny_suite.tasks,
                          tiny_suite.manifest.splits)

    monkeypatch.setattr(builder, "build_suite", build_suite)
    runner = CliRunner()
    recipe = tmp_path / "recipe.toml"
    pkg = '[[packages]]\nrequirement = "tinycalc==0.1.0"\n'
    for name, version in (("other", "0.0.1"), ("tiny", "0.0.2")):
        recipe.write_text(f'name = "{name}"\nversion = "{version}"\n{pkg}')
        res = runner.invoke(app, ["bench", "build", str(recipe), "-o", str(out), "--no-reconcile"])
        assert res.exit_code == 2 and "--out" in res.output, res.output
        assert "holds suite 'tiny' 0.0.1" in said(res) and "--force" in said(res)
    assert built == [] and load_suite(out).manifest.version == "0.0.1"
    # the same suite is built again over itself; another replaces it with --force
    recipe.write_text(f'name = "tiny"\nversion = "0.0.1"\n{pkg}')
    res = runner.invoke(app, ["bench", "build", str(recipe), "-o", str(out), "--no-reconcile"])
    assert res.exit_code == 0, res.output
    recipe.write_text(f'name = "other"\nversion = "1"\n{pkg}')
    res = runner.invoke(app, ["bench", "build", str(recipe), "-o", str(out), "--no-reconcile",
                              "--force"])
    assert res.exit_code == 0, res.output
    assert built == [("tiny", "0.0.1"), ("other", "1")] and load_suite(out).name == "other"


RECIPE = 'name = "r"\nversion = "1"\n[[packages]]\nrequirement = "tinycalc==0.1.0"\n'


def _build_gives(monkeypatch, tmp_path, tasks) -> None:
    """`bench build` builds ``tasks`` (the packages' own work skipped)."""
    from types import SimpleNamespace

    import codedojo.bench.builder as builder

    monkeypatch.setattr(builder, "prepare_package",
                        lambda pr, runs, log: SimpleNamespace(work=tmp_path / "work"))
    monkeypatch.setattr(builder, "build_package", lambda pw, *a: list(tasks))


def test_build_drops_a_task_that_does_not_validate_in_the_sandbox(tiny_suite, provider,
                                                                  monkeypatch, tmp_path):
    """The builder picks FAIL_TO_PASS on the host's Python: a task whose bug does not show in
    the grading sandbox (the null agent would solve it) or whose gold patch fails there (no
    agent could) is dropped, named, before the suite is saved, and the rest split again."""
    import random

    from codedojo.bench.builder import split_tasks
    from codedojo.bench.patching import make_diff
    from codedojo.bench.suite import load_suite
    from codedojo.bench.workspace import task_trees

    monkeypatch.setenv("CODEDOJO_SANDBOX_ROOT", provider.root)
    good, other, third = tiny_suite.tasks
    solved = third.model_copy(update={"instance_id": "tinycalc-0.1.0__passes-on-base",
                                      "FAIL_TO_PASS": third.PASS_TO_PASS[:1],
                                      "PASS_TO_PASS": third.PASS_TO_PASS[1:]})
    bugged = (task_trees(third)[1] / "tinycalc/core.py").read_text()
    no_fix = make_diff({"tinycalc/core.py": bugged}, {"tinycalc/core.py": bugged + "# none\n"})
    unsolvable = third.model_copy(update={"instance_id": "tinycalc-0.1.0__gold-fails",
                                          "patch": no_fix})
    _build_gives(monkeypatch, tmp_path, [solved, good, unsolvable, other])
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE)
    res = CliRunner().invoke(app, ["bench", "build", str(recipe), "-o", str(tmp_path / "out")],
                             env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert ("tinycalc-0.1.0__passes-on-base: task dropped: 1 FAIL_TO_PASS test(s) do not fail "
            "on the unpatched base in the grading sandbox") in said(res)
    assert ("tinycalc-0.1.0__gold-fails: task dropped: the gold patch does not pass in the "
            "grading sandbox") in said(res)
    s = load_suite(tmp_path / "out")
    assert [t.instance_id for t in s.tasks] == [good.instance_id, other.instance_id]
    assert s.manifest.splits == split_tasks([good, other], 0.5, random.Random(0))


def test_build_drops_a_task_with_no_pass_to_pass_test_in_the_sandbox(tiny_suite, provider,
                                                                     monkeypatch, tmp_path):
    """Named and dropped, not a traceback; and a suite none of whose tasks is left is not
    saved (nor one whose tasks were not checked)."""
    from codedojo.bench.suite import load_suite

    monkeypatch.setenv("CODEDOJO_SANDBOX_ROOT", provider.root)
    good = tiny_suite.tasks[0]
    none_pass = good.model_copy(update={"instance_id": "tinycalc-0.1.0__no-p2p",  # (both fail)
                                        "FAIL_TO_PASS": good.FAIL_TO_PASS[:1],
                                        "PASS_TO_PASS": good.FAIL_TO_PASS[1:]})
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE)
    runner = CliRunner()
    out = tmp_path / "out"
    _build_gives(monkeypatch, tmp_path, [none_pass])
    res = runner.invoke(app, ["bench", "build", str(recipe), "-o", str(out)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert ("tinycalc-0.1.0__no-p2p: task dropped: no PASS_TO_PASS test passes on the unpatched "
            "base in the grading sandbox") in said(res)
    assert "none of its 1 task(s) passed the check" in said(res)
    assert not (out / "manifest.json").exists()
    _build_gives(monkeypatch, tmp_path, [none_pass, good])
    res = runner.invoke(app, ["bench", "build", str(recipe), "-o", str(out)],
                        env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert [t.instance_id for t in load_suite(out).tasks] == [good.instance_id]


def test_build_to_a_file_is_refused_before_building(tmp_path, monkeypatch):
    import codedojo.bench.builder as builder

    built = []
    monkeypatch.setattr(builder, "build_suite", lambda *a, **kw: built.append(a))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE)
    afile = tmp_path / "afile"
    afile.write_text("kept")
    for out, why in ((afile, f"{afile} is not a directory"),
                     (afile / "suite", f"{afile / 'suite'}: Not a directory")):
        res = CliRunner().invoke(app, ["bench", "build", str(recipe), "-o", str(out)],
                                 env={"COLUMNS": "300"})
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
        assert "--out" in res.output and why in said(res), res.output
    assert built == [] and afile.read_text() == "kept"


def test_a_default_run_name_is_made_plain_not_refused():
    """A suite or split named with other characters still runs without --name."""
    from codedojo.bench.cli import _default_run_name
    from codedojo.configfile import plain_name

    for parts, name in ((("swe lite", "oracle"), "swe_lite-oracle"),
                        (("v0+fix", "null", "dev"), "v0_fix-null-dev"),
                        (("..", "x"), "run-..-x")):
        assert _default_run_name(*parts) == name and plain_name(name)
    assert plain_name(_default_run_name("x" * 300, "oracle")) == "x" * 100
