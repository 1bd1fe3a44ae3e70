"""Auxiliary signals about habits, each a registered reward returning a cost (>= 0, or a signed
delta); composition gives them negative weights.

- unfinished_todos:  share of the agent's own todo items not completed or cancelled at the end
- comment_reasoning: long reasoning left in code comments, from the added lines of the diff
- tool_collapse:     how far one tool's share of the calls exceeds a threshold
- lint_delta:        ruff diagnostics added, per changed Python file (after minus before, if more)
"""

from __future__ import annotations

import difflib
from collections import Counter
from typing import Annotated, Any

from pydantic import Field

from codedojo.harness.lint import ConfigRejected, ruff_check
from codedojo.harness.tools.base import ToolError, validate_args
from codedojo.harness.tools.todo import TODO_WRITE, merge_todos
from codedojo.harness.toolset import parse_arguments
from codedojo.harness.trajectory import Trajectory
from codedojo.reward.base import FileChange, RewardContext, reward

DONE = ("completed", "cancelled")
# What comment_reasoning (in blocks) and lint_delta (in diagnostics) charge for each source file
# the episode left too large or binary to read (`RewardContext.unread`): what it wrote there is
# unknown, so at least what padding could hide. With the default weights (-0.05 and -0.02) a
# Python file costs 1.4, more than solving the task earns: size never pays for a file's signals.
UNREAD_COST = 20.0


def final_todos(traj: Trajectory) -> list[dict[str, str]]:
    """The todo list at the end: from the tool state when recorded, else replayed from the
    todo_write calls in the messages that the tool carried out (answered without an error),
    with their arguments as the tool took them."""
    if isinstance(traj.tool_state.get("todos"), list):
        return traj.tool_state["todos"]
    records = [c for t in traj.turns for c in t.tool_calls]
    failed = {c.call_id for c in records if c.is_error} if records else {
        m.get("tool_call_id") for m in traj.messages  # a trajectory without the turns' records
        if m.get("role") == "tool" and str(m.get("content") or "").startswith("Error:")}
    todos: list[dict[str, str]] = []
    for m in traj.messages:
        if m.get("role") != "assistant":
            continue
        for c in m.get("tool_calls") or []:
            if c["function"]["name"] != "todo_write" or c.get("id") in failed:
                continue
            args, _ = parse_arguments(c["function"]["arguments"])
            try:  # lenient: a call the tool carried out reads the same either way
                args = validate_args(args, TODO_WRITE.parameters, lenient=True)
                todos = merge_todos(todos, args["todos"], args["merge"])
            except ToolError:
                continue
    return todos


@reward("unfinished_todos")
def unfinished_todos(ctx: RewardContext) -> float:
    todos = final_todos(ctx.trajectory)
    if not todos:
        return 0.0
    return sum(t.get("status") not in DONE for t in todos) / len(todos)


_COMMENT_PREFIX = {".py": "#", ".sh": "#", ".toml": "#", ".yaml": "#", ".yml": "#", ".rb": "#",
                   ".js": "//", ".ts": "//", ".tsx": "//", ".go": "//", ".rs": "//", ".c": "//",
                   ".h": "//", ".cc": "//", ".cpp": "//", ".java": "//"}


# Past this many line pairs (before × after) between the lines a change keeps at the start and
# at the end of a file, its middle is not diffed: SequenceMatcher's time grows faster than the
# pairs' on repeated lines (1.5 s at 500 of them on each side, 10 s at 1,000).
MAX_DIFF_PAIRS = 100_000


def added_line_numbers(change: FileChange) -> set[int]:
    """The indices of the lines of the file after the change that the change added: of those
    between the lines it kept at the start and at the end, those a diff says are new; where
    the two middles pair past `MAX_DIFF_PAIRS`, each line of the new one that the old one has
    no copy left of (each copy matched once, in any order)."""
    before = (change.before or "").splitlines()
    after = (change.after or "").splitlines()
    start = 0
    while start < min(len(before), len(after)) and before[start] == after[start]:
        start += 1
    end = 0
    while end < min(len(before), len(after)) - start and before[-1 - end] == after[-1 - end]:
        end += 1
    old, new = before[start:len(before) - end], after[start:len(after) - end]
    if len(old) * len(new) > MAX_DIFF_PAIRS:
        left = Counter(old)
        added = set()
        for j, line in enumerate(new, start):
            if left[line] > 0:
                left[line] -= 1
            else:
                added.add(j)
        return added
    sm = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    return {start + j for op, _, _, j1, j2 in sm.get_opcodes() if op in ("insert", "replace")
            for j in range(j1, j2)}


def comment_blocks(change: FileChange) -> list[list[str]]:
    """Added comment blocks: of each run of consecutive comment lines in the file after the
    change, the lines the change added (a comment line that was there before, a bare ``#``
    the diff matched inside a new block, joins what is around it; it does not count)."""
    prefix = next((p for ext, p in _COMMENT_PREFIX.items() if change.path.endswith(ext)), None)
    if prefix is None or change.after is None:
        return []
    added = added_line_numbers(change)
    blocks: list[list[str]] = []
    cur: list[str] = []
    for j, line in enumerate([*change.after.splitlines(), ""]):
        s = line.strip()
        if s.startswith(prefix) and not s.startswith("#!"):
            if j in added:
                cur.append(s[len(prefix):].strip())
            continue
        if cur:
            blocks.append(cur)
        cur = []
    return blocks


@reward("comment_reasoning")
def comment_reasoning(ctx: RewardContext, *, max_lines: Annotated[int, Field(ge=1)] = 4,
                      max_chars: Annotated[int, Field(ge=1)] = 300) -> float:
    """Number of added comment blocks longer than `max_lines` lines or `max_chars` characters:
    deliberation ("wait, actually the bug is...") belongs in reasoning, not in the code. A
    file left too large or binary to read counts `UNREAD_COST` blocks."""
    n = UNREAD_COST * sum(p.endswith(tuple(_COMMENT_PREFIX)) for p in ctx.unread)
    for change in ctx.changes:
        for block in comment_blocks(change):
            if len(block) > max_lines or sum(len(x) for x in block) > max_chars:
                n += 1
    return float(n)


@reward("tool_collapse")
def tool_collapse(ctx: RewardContext, *,
                  threshold: Annotated[float, Field(ge=0, lt=1)] = 0.7,
                  min_calls: Annotated[int, Field(ge=1)] = 6) -> float:
    """0 when no tool takes more than `threshold` of the calls, rising linearly to 1 when one
    tool takes all of them (e.g. everything done through run_terminal_cmd)."""
    names = ctx.trajectory.tool_call_names()
    if len(names) < min_calls:
        return 0.0
    share = Counter(names).most_common(1)[0][1] / len(names)
    if share <= threshold:
        return 0.0
    return (share - threshold) / (1.0 - threshold)


PYTHON = (".py", ".pyi")
# The files `UNREAD_COST` is charged for, when an episode leaves one too large or binary to read
UNREAD_CHARGED = (*_COMMENT_PREFIX, ".pyi")


def _lint_counts(files: dict[str, str], configs: dict[str, str]) -> Counter[str]:
    """Ruff diagnostics per file, by the repository's configuration; ``# noqa`` comments (a
    `# ruff: noqa` atop a file) hide none of them."""
    return Counter(d.path for d in ruff_check(files, configs, ignore_noqa=True)
                   ) if files else Counter()


@reward("lint_delta")
def lint_delta(ctx: RewardContext, *, normalize: bool = False) -> float:
    """Ruff diagnostics the agent added: per changed Python file, those after the episode
    minus those before, where more (normalize: divided by the number of files). A cost only:
    lint removed from a file earns nothing, or deleting or rewriting files full of it, which
    no test asks for, would pay more than solving the task. A Python file left too large or
    binary to read counts `UNREAD_COST` diagnostics. Where the repository's ruff settings are
    refused (`ConfigRejected`: not TOML, a rule this ruff removed, a misspelt key), both sides
    are linted by ruff's defaults instead: the delta stays fair, and the task gradable."""
    py = [c for c in ctx.changes if c.path.endswith(PYTHON)]
    unread = sum(p.endswith(PYTHON) for p in ctx.unread)
    if not py and not unread:
        return 0.0
    sides = ({c.path: c.before for c in py if c.before is not None},
             {c.path: c.after for c in py if c.after is not None})
    try:
        before, after = (_lint_counts(files, ctx.lint_configs) for files in sides)
    except ConfigRejected:
        before, after = (_lint_counts(files, {}) for files in sides)
    added = float(sum(max(0, after[c.path] - before[c.path]) for c in py)) + UNREAD_COST * unread
    return added / (len(py) + unread) if normalize else added


def aux_params_doc() -> dict[str, Any]:
    return {
        "unfinished_todos": {},
        "comment_reasoning": {"max_lines": 4, "max_chars": 300},
        "tool_collapse": {"threshold": 0.7, "min_calls": 6},
        "lint_delta": {"normalize": False},
    }
