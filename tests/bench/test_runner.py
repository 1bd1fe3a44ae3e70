import json

from codedojo.bench.report import summary, write_report
from codedojo.bench.runner import HarnessAgent, NullAgent, OracleAgent, pass_at_k, run_agent
from codedojo.bench.validate import gold_changes, validate_task
from codedojo.harness.trajectory import read_jsonl


def test_oracle_resolves_everything_null_nothing_and_reports(images, tiny_suite, tmp_path):
    oracle = run_agent(images, OracleAgent(), tiny_suite.tasks, name="o", suite="tiny", parallel=2, out_dir=tmp_path)
    assert oracle.counts() == {"resolved": 3, "unresolved": 0, "infra_failure": 0}
    assert all(r.changed_files == ["tinycalc/core.py"] for r in oracle.results)
    null = run_agent(images, NullAgent(), tiny_suite.tasks[:2], name="n", suite="tiny", out_dir=tmp_path)
    assert null.counts()["unresolved"] == 2
    assert all(r.f2p_passed == 0 and r.p2p_passed == r.p2p_total for r in null.results)
    paths = write_report(oracle, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["overall"]["resolved"] == 3 and set(data["by_category"]) == {"bugfix", "feature", "log-investigation"}
    assert "| bugfix | 1 | 1 |" in paths["markdown"].read_text()
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


def test_validation_of_a_task(images, tiny_suite):
    v = validate_task(images, tiny_suite.tasks[0], runs=2)
    assert v.ok, v
    assert v.base_f2p_failed == v.f2p and v.gold_runs_passed == 2


def test_a_task_whose_image_cannot_be_built_is_invalid_not_the_validations_end(images,
                                                                               tiny_suite):
    from codedojo.bench.validate import validate_suite

    good = tiny_suite.tasks[0]
    bad = tiny_suite.tasks[1].model_copy(update={"base_sha256": "0" * 64})
    v_bad, v_good = validate_suite(images, [bad, good], runs=1)
    assert not v_bad.ok and "differs from the pinned" in v_bad.error
    assert v_bad.error.startswith("task image: ")
    assert v_good.ok, v_good


def test_editing_hidden_tests_does_not_help(images, tiny_suite, tmp_path):
    """An agent that rewrites the tests instead of the code is graded on the pinned tests."""
    task = tiny_suite.tasks[0]

    class Cheater:
        name = "cheater"

        def solve(self, task, sandbox, out_dir):
            from codedojo.bench.runner import AgentResult

            sandbox.write_file("/workspace/tests/test_core.py", "def test_nothing():\n    pass\n")
            return AgentResult()

    run = run_agent(images, Cheater(), [task], name="c", out_dir=tmp_path)
    assert run.results[0].status == "unresolved"


def test_changing_how_the_tests_run_does_not_help(images, tiny_suite, tmp_path):
    """Six ways to make the hidden tests report a pass without fixing the code, none of which
    touches a test file: a conftest.py hook, a module that shadows pytest, code under test
    that prints pass lines at exit, code that xfails the test it should make pass, and code
    that, as it is imported, patches pytest to pass every test or prints a whole summary of
    its own and leaves (these two the canary test sees: `Canary`)."""
    from codedojo.bench.runner import AgentResult

    task = tiny_suite.tasks[0]
    tests = task.FAIL_TO_PASS + task.PASS_TO_PASS
    hook = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
            "def pytest_runtest_makereport(item, call):\n"
            "    rep = (yield).get_result()\n    rep.outcome, rep.longrepr = 'passed', None\n")
    at_exit = ("\nimport atexit, sys\natexit.register(lambda: sys.stdout.write("
               f"''.join('PASSED ' + t + '\\n' for t in {tests!r})))\n")
    changed = task.patch.split("+++ b/", 1)[1].split("\n", 1)[0]  # the file the fix is in
    xfail = "\n".join(f"\ndef {fn}(*args, **kwargs):\n    import pytest\n"
                      "    pytest.xfail('later')\n"
                      for fn in ("mean", "clamp", "chunks", "parse_pair"))
    # as the code under test is imported: every test's run made a pass, or a summary of its
    # own for every test named on the command line, and gone before pytest's
    patch = "\nimport _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
    forge = ("\nimport os, sys\nprint('=== short test summary info ===')\n"
             "print(''.join('PASSED ' + a + '\\n' for a in sys.argv if '::' in a))\n"
             "sys.stdout.flush()\nos._exit(0)\n")

    def cheats(sandbox) -> dict[str, str]:
        src = sandbox.read_file(f"/workspace/{changed}").decode()
        return {
            "hook": {"conftest.py": hook, "tinycalc/conftest.py": hook},
            "shadow": {"pytest.py": "print('short test summary info')\n" + "".join(
                f"print('PASSED {t}')\n" for t in tests)},
            "at_exit": {changed: src + at_exit},
            "xfail": {changed: src + xfail},
            "patch_pytest": {changed: src + patch},
            "forge_and_leave": {changed: src + forge},
        }

    for cheat in ("hook", "shadow", "at_exit", "xfail", "patch_pytest", "forge_and_leave"):
        class Cheater:
            name = f"cheater-{cheat}"

            def solve(self, task, sandbox, out_dir, cheat=cheat):
                for rel, text in cheats(sandbox)[cheat].items():
                    sandbox.write_file(f"/workspace/{rel}", text)
                return AgentResult()

        (r,) = run_agent(images, Cheater(), [task], name=cheat, out_dir=tmp_path).results
        assert (r.status, r.f2p_passed) == ("unresolved", 0), cheat


def test_a_pass_to_pass_test_the_fix_broke_does_not_pass_by_failing_as_expected(
        images, tiny_suite, tmp_path):
    """The gold fix, and code that breaks a function other tests pass on and xfails them: on
    the task as it came those tests pass, so failing as expected is failing."""
    task = tiny_suite.tasks[0]
    fixed = {t.rsplit("::test_", 1)[1].split("_")[0] for t in task.FAIL_TO_PASS}
    other = next(t for t in task.PASS_TO_PASS
                 if t.rsplit("::test_", 1)[1].split("_")[0] not in fixed)
    fn = other.rsplit("::test_", 1)[1].split("_")[0]
    fn = "parse_pair" if fn == "parse" else fn
    changed = task.patch.split("+++ b/", 1)[1].split("\n", 1)[0]

    class BreaksAndHides(OracleAgent):
        name = "breaks-and-hides"

        def solve(self, task, sandbox, out_dir):
            res = super().solve(task, sandbox, out_dir)
            src = sandbox.read_file(f"/workspace/{changed}").decode()
            sandbox.write_file(f"/workspace/{changed}", src + f"\n\ndef {fn}(*args, **kw):\n"
                               "    import pytest\n    pytest.xfail('later')\n")
            return res

    (r,) = run_agent(images, BreaksAndHides(), [task], name="hide", out_dir=tmp_path).results
    assert r.status == "unresolved" and r.f2p_passed == r.f2p_total
    assert r.p2p_passed < r.p2p_total


def test_an_agent_past_its_time_limit_is_graded_on_what_it_did_by_then(images, tiny_suite,
                                                                        tmp_path):
    """Any agent, not only one that keeps the limit itself: a gold patch written after the
    limit does not count."""
    import time

    task = tiny_suite.tasks[0]
    task = task.model_copy(update={"timeouts": task.timeouts.model_copy(update={"agent_s": 0.5})})

    class SlowOracle(OracleAgent):
        name = "slow-oracle"

        def solve(self, task, sandbox, out_dir):
            time.sleep(3)
            return super().solve(task, sandbox, out_dir)

    (r,) = run_agent(images, SlowOracle(), [task], name="slow", out_dir=tmp_path).results
    assert (r.status, r.agent_status) == ("unresolved", "max_seconds") and r.agent_s < 3


def test_harness_agent_with_a_scripted_policy(images, tiny_suite, tmp_path):
    """The model path: the harness loop's tools write the fix; tokens and turns are counted."""
    from codedojo.harness.policy import ScriptedPolicy

    task = next(t for t in tiny_suite.tasks if t.category == "bugfix")
    fixed = gold_changes(task)["tinycalc/core.py"].decode()

    class PrefixCachingPolicy(ScriptedPolicy):
        """Reports a third of each prompt as served from a prefix cache."""

        def generate(self, messages, tools, max_tokens, time_left=None):
            out = super().generate(messages, tools, max_tokens)
            out.cached_tokens = out.prompt_tokens // 3
            return out

    policy = PrefixCachingPolicy([
        [("read_file", {"target_file": "/workspace/tinycalc/core.py"})],
        [("write", {"file_path": "/workspace/tinycalc/core.py", "contents": fixed})],
        "Fixed.",
    ])
    run = run_agent(images, HarnessAgent(policy), [task], name="h", out_dir=tmp_path)
    r = run.results[0]
    assert r.status == "resolved", r.error
    assert r.turns == 3 and r.completion_tokens > 0
    traj = read_jsonl(tmp_path / "h" / "episodes" / "s0" / f"{task.instance_id}.traj.jsonl")
    assert r.cached_tokens == sum(t.prompt_tokens // 3 for t in traj.turns) > 0
    assert summary(run)["overall"]["cached_tokens_total"] == r.cached_tokens
    assert (tmp_path / "h" / "episodes" / "s0" / f"{task.instance_id}.traj.jsonl").exists()


def test_harness_agent_stops_at_the_tasks_time_limit(images, tiny_suite, tmp_path):
    """timeouts.agent_s ends the episode; what it changed so far is graded."""
    import time

    from codedojo.harness.policy import ScriptedPolicy

    class Slow(ScriptedPolicy):
        def generate(self, messages, tools, max_tokens, time_left=None):
            time.sleep(0.2)
            return super().generate(messages, tools, max_tokens)

    task = next(t for t in tiny_suite.tasks if t.category == "bugfix")
    task = task.model_copy(update={"timeouts": task.timeouts.model_copy(update={"agent_s": 0.3})})
    policy = Slow([[("read_file", {"target_file": "/workspace/tinycalc/core.py"})]] * 50)
    r = run_agent(images, HarnessAgent(policy), [task], name="t", out_dir=tmp_path).results[0]
    assert (r.status, r.agent_status) == ("unresolved", "max_seconds") and r.turns <= 2, r


def test_pass_at_k():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert abs(pass_at_k(4, 1, 1) - 0.25) < 1e-9
    assert abs(pass_at_k(4, 1, 2) - 0.5) < 1e-9


def test_reconcile_drops_pass_to_pass_tests_failing_in_the_sandbox(images, tiny_suite):
    from codedojo.bench.validate import reconcile_task

    # A test that fails on the unpatched base, wrongly listed as pass-to-pass.
    task = tiny_suite.tasks[0]
    wrong = task.FAIL_TO_PASS[0]
    broken = task.model_copy(update={"PASS_TO_PASS": [*task.PASS_TO_PASS, wrong]})
    fixed, note = reconcile_task(images, broken)
    assert note == "1 PASS_TO_PASS test(s) fail in the sandbox; dropped"
    assert fixed.PASS_TO_PASS == task.PASS_TO_PASS and fixed.FAIL_TO_PASS == task.FAIL_TO_PASS


def test_a_harness_agents_settings_are_read_from_the_agent_itself():
    """What makes its episodes (loop, tools, sampling, prompt cut), so a stopped run is not
    taken up by an agent configured otherwise under the same name."""
    from codedojo.harness.loop import LoopConfig
    from codedojo.harness.policy import ScriptedPolicy

    plain = HarnessAgent(ScriptedPolicy(["Done."]), name="a")
    assert plain.settings == HarnessAgent(ScriptedPolicy(["Other."]), name="a").settings
    assert plain.settings["loop"]["max_turns"] == LoopConfig().max_turns
    assert "codebase_search" not in plain.settings["tools"]["tools"]
    for other in (HarnessAgent(ScriptedPolicy([]), LoopConfig(max_turns=3), name="a"),
                  HarnessAgent(ScriptedPolicy([]), name="a", max_prompt_chars=100)):
        assert other.settings != plain.settings
    json.dumps(plain.settings)  # it goes into the run's log
    from codedojo.harness.policy import OpenAIPolicy

    served = [HarnessAgent(OpenAIPolicy(model="m", base_url=url), name="a").settings
              for url in ("http://a:8000/v1", "http://b:8000/v1")]
    assert served[0]["endpoint"] == "http://a:8000/v1" and served[0] != served[1]
