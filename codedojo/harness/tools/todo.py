"""todo_write: the agent's own task list, kept per episode (the unfinished-todo reward reads
the same list back from the trajectory with `merge_todos`)."""

from __future__ import annotations

from typing import Any

from codedojo.harness.tools.base import FunctionTool, ToolContext, ToolError, obj

STATUSES = ("pending", "in_progress", "completed", "cancelled")


def merge_todos(
    current: list[dict[str, str]], todos: list[dict[str, Any]], merge: bool
) -> list[dict[str, str]]:
    """Apply one todo_write call: replace the list, or update items by id and append new ones."""
    new: list[dict[str, str]] = [] if not merge else [dict(t) for t in current]
    index = {t["id"]: i for i, t in enumerate(new)}
    for t in todos:
        tid = str(t.get("id", "")).strip()
        if not tid:
            raise ToolError("every todo needs a non-empty 'id'")
        status = t.get("status")
        if status is not None and status not in STATUSES:
            raise ToolError(f"todo {tid!r}: status must be one of {list(STATUSES)}, got {status!r}")
        if tid in index:
            item = new[index[tid]]
            if t.get("content") is not None:
                item["content"] = str(t["content"])
            if status is not None:
                item["status"] = status
        else:
            if not merge and t.get("content") is None:
                raise ToolError(f"todo {tid!r}: 'content' is required")
            index[tid] = len(new)
            new.append({"id": tid, "content": str(t.get("content", "")), "status": status or "pending"})
    return new


def render_todos(todos: list[dict[str, str]]) -> str:
    marks = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}
    if not todos:
        return "Todo list is empty."
    done = sum(t["status"] in ("completed", "cancelled") for t in todos)
    lines = [f"{marks[t['status']]} {t['id']}: {t['content']}" for t in todos]
    return "\n".join(lines) + f"\n({done}/{len(todos)} done)"


def _todo_write(ctx: ToolContext, args: dict[str, Any]) -> str:
    todos = merge_todos(ctx.state.get("todos", []), args["todos"], bool(args["merge"]))
    ctx.state["todos"] = todos
    return render_todos(todos)


TODO_WRITE = FunctionTool(
    name="todo_write",
    description=(
        "Create or update your todo list. merge=false replaces the list; merge=true updates items "
        "by id and appends new ones. Status: pending, in_progress, completed, cancelled."
    ),
    parameters=obj(
        {
            "merge": {"type": "boolean", "description": "Merge into the current list by id."},
            "todos": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "content": {"type": "string"},
                        "status": {"type": "string", "enum": list(STATUSES)},
                    },
                    "required": ["id"],
                    "additionalProperties": False,
                },
            },
        },
        ["merge", "todos"],
    ),
    fn=_todo_write,
)
