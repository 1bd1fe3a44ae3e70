"""Who a grading failure is put down to: an error of the test run on the task as it came is
the environment's (infra), on the agent's changes alone the agent's (unresolved)."""

from __future__ import annotations

import pytest

from codedojo.bench import runner
from codedojo.bench.runner import AgentResult, run_one
from codedojo.bench.task import Timeouts
from codedojo.bench.testrun import TestReport
from codedojo.sandbox.base import ExecResult


class _Task:
    instance_id, category = "t-1", "bugfix"
    FAIL_TO_PASS, PASS_TO_PASS = ["t.py::test_fix"], ["t.py::test_keep"]
    timeouts = Timeouts()


class _Images:
    def __init__(self):
        self.commands: list[list[str]] = []  # what the runner ran in the agent's sandbox

    def agent_sandbox(self, task):
        commands = self.commands

        class Sb:
            def exec(self, command, timeout=None):
                commands.append(command)
                return ExecResult(0, "", "")

            def destroy(self):
                pass
        return Sb()

    def baseline(self, task):  # as TaskImages.baseline: the run on the task as it came
        return runner.grade_changes(self, task, {})[1]


class _Agent:
    name = "stub"

    def solve(self, task, sb, out_dir):
        return AgentResult(turns=1)


def _report(broken: bool) -> TestReport:
    if broken:  # the test command could not run
        return TestReport(outcomes={t: "error" for t in ["t.py::test_fix", "t.py::test_keep"]},
                          exit_code=127, output_tail="python: not found")
    return TestReport(outcomes={"t.py::test_fix": "failed", "t.py::test_keep": "passed"},
                      exit_code=1, reported=2)


@pytest.mark.parametrize("changes, broken_with, broken_without, status", [
    ({"a.py": b"x"}, True, False, "unresolved"),  # the change broke the run: the agent's
    ({"a.py": b"x"}, True, True, "infra_failure"),  # broken either way: the environment's
    ({}, True, True, "infra_failure"),
    ({"a.py": b"x"}, False, False, "unresolved"),
])
def test_a_broken_test_run_is_put_down_to_whoever_broke_it(
        monkeypatch, tmp_path, changes, broken_with, broken_without, status):
    graded: list[dict] = []

    def grade(images, task, ch):
        graded.append(dict(ch))
        return False, _report(broken_with if ch else broken_without)

    monkeypatch.setattr(runner, "collect_changes", lambda sb: dict(changes))
    monkeypatch.setattr(runner, "grade_changes", grade)
    res = run_one(_Images(), _Agent(), _Task(), 0, tmp_path)  # type: ignore[arg-type]
    assert res.status == status, res.error
    if status == "infra_failure":
        assert "test command exit 127" in res.error
    assert graded[0] == changes and len(graded) == (2 if changes and broken_with else 1)


def test_what_an_agent_left_running_is_killed_before_its_changes_are_collected(
        monkeypatch, tmp_path):
    """An agent that returns in time may have left commands running in the background: they
    stop before the collect, or they could change what is graded as it is read."""
    images = _Images()
    seen: list[int] = []
    monkeypatch.setattr(runner, "collect_changes", lambda sb: seen.append(len(images.commands))
                        or {})
    monkeypatch.setattr(runner, "grade_changes", lambda images, task, ch: (False, _report(False)))
    res = run_one(images, _Agent(), _Task(), 0, tmp_path)  # type: ignore[arg-type]
    assert res.agent_status == "finished"
    assert images.commands == [["kill", "-KILL", "-1"]] and seen == [1]


def test_an_infra_failure_is_the_episodes_not_the_runs(tmp_path):
    """An agent's sandbox that cannot be made (or an agent that raises) is an infra failure of
    that episode, its traceback kept beside the agent's files; where that file cannot be
    written, the episode's result holds the error still."""
    from types import SimpleNamespace

    from codedojo.bench.runner import run_agent
    from codedojo.sandbox.base import SandboxError

    def no_sandbox(task):
        raise SandboxError("disk full")

    images = SimpleNamespace(warm=lambda task: None, agent_sandbox=no_sandbox)
    task = SimpleNamespace(instance_id="t-1", category="bugfix", FAIL_TO_PASS=[], PASS_TO_PASS=[],
                           content_hash=lambda: "h")
    run = run_agent(images, _Agent(), [task], name="r", out_dir=tmp_path)  # type: ignore[arg-type]
    assert run.counts()["infra_failure"] == 1 and "disk full" in run.results[0].error
    kept = tmp_path / "r" / "episodes" / "s0" / "t-1.s0.error.txt"
    assert "SandboxError: disk full" in kept.read_text()
    (tmp_path / "file").write_text("")
    res = run_one(images, _Agent(), task, 0, tmp_path / "file" / "s0")  # type: ignore[arg-type]
    assert res.status == "infra_failure" and "disk full" in res.error


def test_an_agent_past_its_time_limit_can_change_nothing_more(monkeypatch, tmp_path):
    """Once the runner has ended the episode (its commands killed), the agent's calls, on the
    sandbox or a shell it opened, are refused: a late write is not graded."""
    import threading
    from types import SimpleNamespace

    from codedojo.sandbox.base import ExecResult, SandboxError

    killed, tried = threading.Event(), threading.Event()
    refused: list[str] = []

    class Sb:
        def __init__(self):
            self.files: dict[str, bytes] = {}

        def exec(self, command, timeout=None):  # the runner's kill: the agent writes now
            killed.set()
            tried.wait(30)
            return ExecResult(0, "", "")

        def write_file(self, path, data, mode=0o644):
            self.files[path] = data

        def shell(self):
            return SimpleNamespace(run=lambda command, timeout=None: ExecResult(0, "", ""))

        def destroy(self):
            pass

    class Late:
        name = "late"

        def solve(self, task, sandbox, out_dir):
            shell = sandbox.shell()
            killed.wait(30)
            for call in (lambda: sandbox.write_file("/workspace/a.py", b"late"),
                         lambda: shell.run("echo late > a.py")):
                try:
                    call()
                except SandboxError as e:
                    refused.append(str(e))
            tried.set()
            return AgentResult(turns=1)

    sb = Sb()
    images = SimpleNamespace(agent_sandbox=lambda task: sb)
    task = _Task()
    task.timeouts = Timeouts(agent_s=0.01)
    monkeypatch.setattr(runner, "collect_changes", lambda sb: {
        p.removeprefix("/workspace/"): d for p, d in sb.files.items()})
    monkeypatch.setattr(runner, "grade_changes", lambda images, task, ch: (False, _report(False)))
    res = run_one(images, Late(), task, 0, tmp_path)  # type: ignore[arg-type]
    assert (res.status, res.agent_status, res.changed_files) == ("unresolved", "max_seconds", [])
    assert len(refused) == 2 and all("episode has ended" in e for e in refused)


def test_a_stopped_run_goes_on_with_the_episodes_it_had_not_finished(monkeypatch, tmp_path):
    """Each result is logged as its episode ends; started again, the run does only the rest,
    and a task whose image cannot be built is an infra failure of its own, not the run's end."""
    import json
    from types import SimpleNamespace

    from codedojo.bench.runner import TaskResult, run_agent

    tasks = [SimpleNamespace(instance_id=f"t-{i}", category="bugfix",
                             content_hash=lambda i=i: f"h{i}") for i in range(3)]

    class Images:
        def warm(self, task):
            if task.instance_id == "t-2":
                raise RuntimeError("sdist not found")

    ran: list[tuple[str, int]] = []

    clock = {"now": 1000.0}  # an episode takes 10 s of the run's clock

    def one(images, agent, task, sample, out_dir):
        if len(ran) == 3 and stop["now"]:
            raise KeyboardInterrupt
        ran.append((task.instance_id, sample))
        clock["now"] += 10
        return TaskResult(task.instance_id, task.category, sample, "resolved")

    stop = {"now": True}
    monkeypatch.setattr(runner, "run_one", one)
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock["now"])
    with pytest.raises(KeyboardInterrupt):
        run_agent(Images(), _Agent(), tasks, name="r", samples=2, out_dir=tmp_path)  # type: ignore[arg-type]
    assert not (tmp_path / "r" / "results.json").exists()
    stop["now"] = False
    ran.clear()
    clock["now"] += 5000  # started again later: the pause is not the run's
    run = run_agent(Images(), _Agent(), tasks, name="r", samples=2, out_dir=tmp_path)  # type: ignore[arg-type]
    assert ran == [("t-1", 1)]  # three finished before the stop
    assert run.wall_s == 40  # its starts' time: three episodes, then one
    assert sorted((r.instance_id, r.sample, r.status) for r in run.results) == [
        ("t-0", 0, "resolved"), ("t-0", 1, "resolved"), ("t-1", 0, "resolved"),
        ("t-1", 1, "resolved"), ("t-2", 0, "infra_failure"), ("t-2", 1, "infra_failure")]
    assert all("sdist not found" in r.error for r in run.results if r.instance_id == "t-2")
    saved = json.loads((tmp_path / "r" / "results.json").read_text())
    assert saved["counts"] == {"resolved": 4, "unresolved": 0, "infra_failure": 2}
    assert not (tmp_path / "r" / "results.partial.jsonl").exists()


def test_a_stopped_run_resumes_only_as_it_was(monkeypatch, tmp_path):
    """Started again with other samples, an agent of other settings, without a task it had
    results for, or with a task whose content changed, a stopped run is refused, its log
    untouched; more tasks may join."""
    from types import SimpleNamespace

    from codedojo.bench.runner import TaskResult, run_agent

    def task(i, h="a"):
        return SimpleNamespace(instance_id=f"t-{i}", category="bugfix", content_hash=lambda: h)

    class Images:
        def warm(self, task):
            pass

    ran: list[str] = []

    def one(images, agent, task, sample, out_dir):
        if task.instance_id == "t-1" and not ran.count("go"):
            raise KeyboardInterrupt
        ran.append(task.instance_id)
        return TaskResult(task.instance_id, task.category, sample, "resolved")

    monkeypatch.setattr(runner, "run_one", one)
    with pytest.raises(KeyboardInterrupt):
        run_agent(Images(), _Agent(), [task(0), task(1)], name="r",  # type: ignore[arg-type]
                  out_dir=tmp_path)
    log = (tmp_path / "r" / "results.partial.jsonl").read_text()
    for why, tasks, samples in (("samples 1, not 2", [task(0), task(1)], 2),
                                ("tasks not selected now: t-0", [task(1)], 1),
                                ("tasks whose content changed since: t-0", [task(0, "b")], 1)):
        with pytest.raises(ValueError, match=why):
            run_agent(Images(), _Agent(), tasks,  # type: ignore[arg-type]
                      name="r", samples=samples, out_dir=tmp_path)
        assert (tmp_path / "r" / "results.partial.jsonl").read_text() == log
    other = _Agent()
    other.settings = {"loop": {"max_turns": 8}}  # the same agent's name, another agent
    with pytest.raises(ValueError, match=r"settings loop\.max_turns None, not 8\)"):
        run_agent(Images(), other, [task(0), task(1)], name="r",  # type: ignore[arg-type]
                  out_dir=tmp_path)
    assert (tmp_path / "r" / "results.partial.jsonl").read_text() == log
    ran.append("go")
    run = run_agent(Images(), _Agent(), [task(0), task(1), task(2)],  # type: ignore[arg-type]
                    name="r", out_dir=tmp_path)
    assert ran == ["t-0", "go", "t-1", "t-2"]
    assert sorted(r.instance_id for r in run.results) == ["t-0", "t-1", "t-2"]


def test_a_run_that_replaces_begins_again_over_a_stopped_run_of_another_kind(monkeypatch,
                                                                             tmp_path):
    """With ``replace`` (`dojo demo` run again with other options), a stopped run it cannot go
    on with is not refused: its results are dropped and every episode runs again."""
    import json
    from types import SimpleNamespace

    from codedojo.bench.runner import TaskResult, run_agent

    tasks = [SimpleNamespace(instance_id=f"t-{i}", category="bugfix",
                             content_hash=lambda: "a") for i in range(2)]

    class Images:
        def warm(self, task):
            pass

    ran: list[tuple[int, str]] = []

    def one(images, agent, task, sample, out_dir):
        max_turns = agent.settings["loop"]["max_turns"]
        if (max_turns, task.instance_id) == (1, "t-1"):  # stopped there
            raise KeyboardInterrupt
        ran.append((max_turns, task.instance_id))
        return TaskResult(task.instance_id, task.category, sample, "resolved",
                          turns=max_turns)

    def agent(max_turns):
        a = _Agent()
        a.settings = {"loop": {"max_turns": max_turns}}
        return a

    monkeypatch.setattr(runner, "run_one", one)
    with pytest.raises(KeyboardInterrupt):
        run_agent(Images(), agent(1), tasks, name="r", out_dir=tmp_path,  # type: ignore[arg-type]
                  replace=True)
    assert ran == [(1, "t-0")]
    run = run_agent(Images(), agent(2), tasks, name="r", out_dir=tmp_path,  # type: ignore[arg-type]
                    replace=True)
    assert ran == [(1, "t-0"), (2, "t-0"), (2, "t-1")]
    assert sorted((r.instance_id, r.turns) for r in run.results) == [("t-0", 2), ("t-1", 2)]
    assert [r["turns"] for r in json.loads((tmp_path / "r" / "results.json").read_text())[
        "results"]] == [2, 2]
    assert not (tmp_path / "r" / "results.partial.jsonl").exists()


def test_an_agents_file_is_not_taken_for_bytecode_by_a_piece_of_its_name():
    from types import SimpleNamespace

    from codedojo.bench.workspace import collect_changes
    from codedojo.sandbox.base import Change

    paths = ["a.py", "notes.pyc.md", ".pyc_notes/x.txt", "pkg/__pycache__/a.cpython-311.pyc",
             "b.pyc", ".pytest_cache/v/x"]
    sb = SimpleNamespace(
        changes=lambda: [Change(f"/workspace/{p}", "added") for p in paths],
        stat=lambda p: SimpleNamespace(path=p, kind="file", mode=0o644),
        read_file=lambda p, max_bytes=None: b"x")
    assert sorted(collect_changes(sb)) == [".pyc_notes/x.txt", "a.py", "notes.pyc.md"]


def test_a_finished_run_is_replaced_only_when_asked(monkeypatch, tmp_path):
    """(`dojo demo` runs again over its own runs; `dojo bench run` does not write over one.)"""
    from types import SimpleNamespace

    from codedojo.bench.runner import RunNameTaken, TaskResult, run_agent

    tasks = [SimpleNamespace(instance_id="t-0", category="bugfix", content_hash=lambda: "h")]
    monkeypatch.setattr(runner, "run_one", lambda images, agent, task, sample, out: TaskResult(
        task.instance_id, task.category, sample, "resolved"))
    images = SimpleNamespace(warm=lambda task: None)
    run_agent(images, _Agent(), tasks, name="d", out_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(RunNameTaken, match="holds a finished run"):
        run_agent(images, _Agent(), tasks, name="d", out_dir=tmp_path)  # type: ignore[arg-type]
    again = run_agent(images, _Agent(), tasks, name="d", out_dir=tmp_path,  # type: ignore[arg-type]
                      replace=True)
    assert [r.instance_id for r in again.results] == ["t-0"]


def test_a_tasks_run_as_it_came_is_made_once_for_workers_asking_together(monkeypatch):
    import threading
    import time
    from types import SimpleNamespace

    from codedojo.bench import workspace

    calls = []

    def grade(images, task, changes):
        calls.append(task.instance_id)
        time.sleep(0.2)
        return False, _report(False)

    monkeypatch.setattr(workspace, "grade_changes", grade)
    images = workspace.TaskImages(SimpleNamespace(images=object()))
    task = SimpleNamespace(instance_id="t-1", content_hash=lambda: "h")
    workers = [threading.Thread(target=images.baseline, args=(task,)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert calls == ["t-1"] and images.baseline(task).outcomes
