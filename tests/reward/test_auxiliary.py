import json

import pytest

from codedojo.harness.trajectory import Trajectory
from codedojo.reward.auxiliary import (
    comment_blocks,
    comment_reasoning,
    final_todos,
    lint_delta,
    tool_collapse,
    unfinished_todos,
)
from codedojo.reward.base import FileChange, RewardContext


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _traj(calls: list[tuple[str, dict]], tool_state: dict | None = None) -> Trajectory:
    msgs: list[dict] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for i, (name, args) in enumerate(calls):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [_call(i, name, args)]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    return Trajectory(task="t", messages=msgs, tool_state=tool_state or {})


def test_unfinished_todos_replayed_from_calls():
    t = _traj([
        ("todo_write", {"merge": False, "todos": [{"id": "1", "content": "a"}, {"id": "2", "content": "b"},
                                                   {"id": "3", "content": "c"}, {"id": "4", "content": "d"}]}),
        ("todo_write", {"merge": True, "todos": [{"id": "1", "status": "completed"}, {"id": "2", "status": "cancelled"}]}),
        ("todo_write", {"merge": True, "todos": [{"id": "3", "status": "bogus"}]}),  # invalid: ignored
    ])
    assert [x["status"] for x in final_todos(t)] == ["completed", "cancelled", "pending", "pending"]
    assert unfinished_todos(RewardContext(t)) == 0.5


def test_todos_are_replayed_as_the_tool_carried_them_out():
    """Where the tool state is missing: a lenient episode's "false" was the tool's False, and
    a call the tool answered with an error changed nothing."""
    t = _traj([
        ("todo_write", {"merge": False, "todos": [{"id": "1", "content": "fix the bug"}]}),
        ("todo_write", {"merge": "false", "todos": [{"id": "2", "content": "run the tests",
                                                     "status": "completed"}]}),
        ("todo_write", {"merge": True, "todos": [{"id": "3", "content": "x"}]}),
    ])
    t.messages[-1]["content"] = "Error: the tool service failed"  # the third was not carried out
    assert final_todos(t) == [{"id": "2", "content": "run the tests", "status": "completed"}]
    assert unfinished_todos(RewardContext(t)) == 0.0


def test_unfinished_todos_prefers_recorded_state_and_zero_without_todos():
    t = _traj([], tool_state={"todos": [{"id": "1", "content": "a", "status": "completed"}]})
    assert unfinished_todos(RewardContext(t)) == 0.0
    assert unfinished_todos(RewardContext(_traj([("grep", {"pattern": "x"})]))) == 0.0


def test_comment_reasoning_counts_long_added_comment_blocks():
    before = "def f(x):\n    return x + 1\n"
    after = (
        "def f(x):\n"
        "    # Wait, the caller passes a string here sometimes. Let me think: if x is a str we\n"
        "    # should convert it, but actually the tests only pass ints, so maybe not. Hmm, on\n"
        "    # reflection the original author meant to add one, which is what we do, but the\n"
        "    # off-by-one in the loop above means we actually need to add two. Let me re-check.\n"
        "    # Yes.\n"
        "    return x + 2  # fix off-by-one\n"
    )
    ctx = RewardContext(_traj([]), changes=[FileChange("/workspace/a.py", before, after)])
    assert comment_reasoning(ctx) == 1.0
    short = before.replace("return x + 1", "# guard\n    return x + 2")
    assert comment_reasoning(RewardContext(_traj([]), changes=[FileChange("/workspace/a.py", before, short)])) == 0.0
    # Comments that were already there are not the agent's.
    assert comment_reasoning(RewardContext(_traj([]), changes=[FileChange("/workspace/a.py", after, after + "\n")])) == 0.0
    assert comment_reasoning(ctx, max_lines=10, max_chars=10_000) == 0.0


def test_a_long_added_comment_is_one_block_around_a_comment_line_that_was_there():
    """The diff matches a bare "#" of the file inside the new block and splits it in two
    short runs; the block is still one, of the lines added (the old "#" not counted)."""
    block = ["# Wait, actually the bug is in the loop.", "# First I thought it was the index,",
             "# but the test fails at the boundary.", "# So let me reconsider the condition.",
             "#", "# The condition should be <= not <,", "# because the last element counts.",
             "# Let me fix it that way and re-run."]
    before = "x = 1\n#\ny = 2\n"
    change = FileChange("/workspace/a.py", before, "x = 1\n" + "\n".join(block) + "\ny = 2\n")
    assert [len(b) for b in comment_blocks(change)] == [7]  # (was [4, 3])
    assert comment_reasoning(RewardContext(_traj([]), changes=[change])) == 1.0
    # One line added to a long comment that was there is one short block.
    grown = FileChange("/workspace/a.py", "\n".join(block) + "\n", "\n".join(block) + "\n# ok\n")
    assert comment_blocks(grown) == [["ok"]]


def test_the_lines_added_to_a_large_file_are_found_without_diffing_it_whole(monkeypatch):
    """SequenceMatcher's time grows faster than the lines' pairs on repeated lines (a one-line
    edit of a 16,000-line table took a minute): it is given no more than `MAX_DIFF_PAIRS`."""
    import difflib

    from codedojo.reward.auxiliary import MAX_DIFF_PAIRS, added_line_numbers

    real = difflib.SequenceMatcher

    def bounded(*, a, b, **kw):
        assert len(a) * len(b) <= MAX_DIFF_PAIRS, (len(a), len(b))
        return real(a=a, b=b, **kw)

    monkeypatch.setattr(difflib, "SequenceMatcher", bounded)
    table = "TABLE = [\n" + "    0,\n" * 16_000 + "]\n"
    edited = table.replace("    0,\n", "    1,\n", 1)
    assert added_line_numbers(FileChange("/workspace/t.py", table, edited)) == {1}
    inserted = table.replace("    0,\n", "    0,\n    2,\n", 1)
    assert added_line_numbers(FileChange("/workspace/t.py", table, inserted)) == {2}
    # every line of a module spaced out: the middle is too large to diff, and what is left of
    # it, old comments among it, is not added; only what the old lines do not cover is
    module = "".join(f"# note {i}\nX{i} = {i}\n" for i in range(400))
    spaced = "".join(line + "\n" * 3 for line in module.splitlines(keepends=True))
    musing = "".join(f"# wait, actually ({i})\n" for i in range(6))
    change = FileChange("/workspace/m.py", module, spaced + musing)
    assert comment_blocks(change) == [[f"wait, actually ({i})" for i in range(6)]]
    assert len(added_line_numbers(change)) == 3 * 800 + 6


def test_tool_collapse():
    varied = _traj([(n, {}) for n in ["grep", "read_file", "search_replace", "run_terminal_cmd"] * 2])
    assert tool_collapse(RewardContext(varied)) == 0.0
    collapsed = _traj([("run_terminal_cmd", {})] * 9 + [("read_file", {})])
    v = tool_collapse(RewardContext(collapsed))
    assert v == pytest.approx((0.9 - 0.7) / 0.3)
    only = _traj([("run_terminal_cmd", {})] * 8)
    assert tool_collapse(RewardContext(only)) == pytest.approx(1.0)
    few = _traj([("run_terminal_cmd", {})] * 3)
    assert tool_collapse(RewardContext(few)) == 0.0


def test_lint_delta_on_changed_files():
    clean = "import os\n\nprint(os.sep)\n"
    dirty = "import os\nimport sys\n\nprint(os.sep)\n"  # F401 unused import
    worse = RewardContext(_traj([]), changes=[FileChange("/workspace/m.py", clean, dirty)])
    assert lint_delta(worse) == 1.0
    # lint removed earns nothing: not in the file cleaned, not against lint added elsewhere,
    # not by deleting a file full of it
    better = RewardContext(_traj([]), changes=[FileChange("/workspace/m.py", dirty, clean)])
    assert lint_delta(better) == 0.0
    trade = RewardContext(_traj([]), changes=[FileChange("/workspace/m.py", dirty, clean),
                                              FileChange("/workspace/k.py", clean, dirty)])
    assert lint_delta(trade) == 1.0
    full = "".join(f"import m{i}\n" for i in range(60))  # 60 unused imports
    gone = RewardContext(_traj([]), changes=[FileChange("/workspace/old.py", full, None)])
    assert lint_delta(gone) == 0.0
    new_file = RewardContext(_traj([]), changes=[FileChange("/workspace/n.py", None, dirty),
                                                  FileChange("/workspace/README.md", None, "x")])
    assert lint_delta(new_file) == 1.0
    # a comment that hides the lint from the linter hides none from the reward
    for hidden in ("# ruff: noqa\n" + dirty, dirty.replace("import sys", "import sys  # noqa")):
        muted = RewardContext(_traj([]), changes=[FileChange("/workspace/m.py", clean, hidden)])
        assert lint_delta(muted) == 1.0


def test_settings_this_ruff_refuses_lint_both_sides_by_its_defaults(monkeypatch):
    """A repository's ruff settings that this ruff refuses (a rule it removed, a misspelt key,
    not TOML) failed every episode of the task; both sides are linted by ruff's defaults."""
    from codedojo.harness.lint import ConfigRejected, ruff_check

    clean = "import os\n\nprint(os.sep)\n"
    dirty = "import os\nimport sys\n\nprint(os.sep)\n"  # F401, by ruff's defaults too
    for config in ({"pyproject.toml": '[tool.ruff.lint]\nselect = ["F", "ANN101"]\n'},
                   {"pyproject.toml": "[tool.ruff]\nline-lenght = 100\n"},
                   {"ruff.toml": "select = \n"}):
        with pytest.raises(ConfigRejected, match="ruff rejects|not TOML"):
            ruff_check({"/workspace/m.py": dirty}, config)
        ctx = RewardContext(_traj([]), changes=[FileChange("/workspace/m.py", clean, dirty)],
                            lint_configs=config)
        assert lint_delta(ctx) == 1.0
    # ruff failing without the settings too is no fault of theirs, and not hidden
    monkeypatch.setattr("codedojo.harness.lint.ruff_bin", lambda: "false")
    with pytest.raises(RuntimeError, match="ruff failed"):
        ruff_check({"/workspace/m.py": clean}, {"ruff.toml": "line-length = 100\n"})


def test_a_source_file_left_unread_costs_a_fixed_amount():
    """A file the episode grew past what is read (or made binary) is no text change; what it
    wrote there is unknown, and charged, not free."""
    from codedojo.reward.auxiliary import UNREAD_COST

    unread = ["/workspace/m.py", "/workspace/a.js", "/workspace/x.bin"]
    ctx = RewardContext(_traj([]), unread=unread)
    assert lint_delta(ctx) == UNREAD_COST and comment_reasoning(ctx) == 2 * UNREAD_COST
    clean = FileChange("/workspace/k.py", "X = 1\n", "X = 2\n")
    ctx = RewardContext(_traj([]), changes=[clean], unread=["/workspace/m.py"])
    assert lint_delta(ctx, normalize=True) == UNREAD_COST / 2
