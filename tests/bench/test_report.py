"""The run report's figures from results alone (no sandbox)."""

import pytest

from codedojo.bench.report import markdown, summary, write_report
from codedojo.bench.runner import RunResult, TaskResult


def _run(statuses: dict[str, list[str]]) -> RunResult:
    results = [TaskResult(task, "bugfix", i, status) for task, ss in statuses.items()
               for i, status in enumerate(ss)]
    return RunResult("r", "agent", "v0", max(map(len, statuses.values())), 1, 1.0, results)


def test_the_resolved_rate_comes_with_its_interval():
    # one episode a task: Wilson's interval over them, not empty where none resolved
    none = summary(_run({f"t{i}": ["unresolved"] for i in range(20)}))["overall"]
    assert none["resolved_rate"] == 0.0 and none["resolved_rate_ci95"][0] < 1e-9
    assert 0.15 < none["resolved_rate_ci95"][1] < 0.17
    five = _run({f"t{i}": ["resolved" if i < 5 else "unresolved"] for i in range(20)})
    lo, hi = summary(five)["overall"]["resolved_rate_ci95"]
    assert lo < 0.25 < hi and "| **all** | 20 | 5 | 15 | 0 | 25% (11%-47%) |" in markdown(five)
    # several samples of a task: the tasks are the units, so a task always resolved and one
    # never are two trials, not eight
    tasks = summary(_run({"a": ["resolved"] * 4, "b": ["unresolved"] * 4}))["overall"]
    episodes = summary(_run({f"t{i}": ["resolved" if i < 4 else "unresolved"]
                             for i in range(8)}))["overall"]
    assert tasks["resolved_rate"] == episodes["resolved_rate"] == 0.5
    assert tasks["resolved_rate_ci95"] == [0.0, 1.0]
    assert episodes["resolved_rate_ci95"][1] - episodes["resolved_rate_ci95"][0] < 0.7
    assert summary(_run({"a": ["resolved"]}))["by_category"]["bugfix"]["resolved_rate_ci95"]
    # where the tasks agree, or there is one, more samples do not shrink the interval to a point
    one_each = summary(_run({t: ["resolved"] for t in "abc"}))["overall"]["resolved_rate_ci95"]
    thrice = summary(_run({t: ["resolved"] * 3 for t in "abc"}))["overall"]["resolved_rate_ci95"]
    assert thrice == one_each and thrice[0] < 0.5
    lo, hi = summary(_run({"a": ["resolved"] * 2 + ["unresolved"] * 3}))["overall"][
        "resolved_rate_ci95"]
    assert lo < 0.1 and hi > 0.85


def test_a_report_that_fails_to_draw_leaves_the_old_one_whole(tmp_path, monkeypatch):
    from pathlib import Path

    from matplotlib.figure import Figure

    write_report(_run({"a": ["resolved"]}), tmp_path)
    old = {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir()}
    assert sorted(old) == ["report.json", "report.md", "report.png"]

    def broken(self, fname, *args, **kwargs):  # part of a PNG, then the drawing fails
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG")
        else:
            Path(fname).write_bytes(b"\x89PNG")
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="drawing failed"):
        write_report(_run({"a": ["unresolved"], "b": ["resolved"]}), tmp_path)
    assert {p.name: p.read_bytes() for p in (tmp_path / "r").iterdir()} == old


def test_a_run_with_no_episodes_still_gets_its_report(tmp_path):
    paths = write_report(RunResult("empty", "agent", "v0", 1, 1, 0.0, []), tmp_path)
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert '"samples": 0' in paths["json"].read_text()
