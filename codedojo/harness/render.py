"""Terminal rendering of a trajectory (rich): what `dojo traj show` prints."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from codedojo.harness.sequences import training_sequences
from codedojo.harness.trajectory import Trajectory

ROLE_STYLE = {"system": "dim", "user": "bold cyan", "assistant": "bold green", "tool": "yellow"}


def _short(text: str, max_chars: int | None) -> str:
    if max_chars is None or len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n… [{len(text) - max_chars} more characters; --full shows all]"


def _call_text(call: dict[str, Any], max_chars: int | None) -> str:
    fn = call.get("function", {})
    args = fn.get("arguments", "")
    try:
        obj = json.loads(args) if isinstance(args, str) else args
        args = json.dumps(obj, ensure_ascii=False)
        if len(args) > 160:  # long arguments read better one field per line
            args = json.dumps(obj, ensure_ascii=False, indent=1)
    except (json.JSONDecodeError, TypeError):
        pass
    return f"→ {fn.get('name')}({_short(str(args), max_chars)})  [{call.get('id')}]"


def print_trajectory(traj: Trajectory, max_chars: int | None = 1500, console: Console | None = None) -> None:
    console = console or Console()
    head = Table.grid(padding=(0, 2))

    def row(table: Table, *cells: str) -> None:  # text as it is: a "[/b]" in it is no markup
        table.add_row(*(Text(c) for c in cells))

    row(head, "id", traj.id)
    row(head, "status", f"{traj.status}" + (f" — {traj.error}" if traj.error else ""))
    row(head, "model", traj.model or "-")
    row(head, "env", f"{traj.env} (tool set generation {traj.toolset_generation})")
    row(head, "tools", ", ".join(f"{n}@{v}" for n, v in traj.tool_versions.items()) or "-")
    row(head, "turns", f"{len(traj.turns)} model calls, {len(traj.segments)} context segment(s)")
    if traj.turns:
        whole = sum(len(t.prompt_ids) + len(t.completion_ids) for t in traj.turns)
        try:
            seqs = training_sequences(traj)
            row(head, "training", f"{len(seqs)} sequence(s), "
                f"{sum(len(q.token_ids) for q in seqs)} tokens ({whole} turn by turn)")
        except ValueError as e:  # shown all the same, to see what is wrong
            row(head, "training", f"not trainable: {e}")
    console.print(Panel(head, title="trajectory", expand=False))

    starts = set(traj.segments)
    for i, m in enumerate(traj.messages):
        if i in starts and i > 0:
            console.rule("[magenta]new context after self-summary[/magenta]")
        role = m.get("role", "?")
        parts: list[Any] = []
        if m.get("reasoning_content"):
            parts.append(Text(_short(m["reasoning_content"], max_chars), style="italic dim"))
        content = m.get("content")
        if content:
            parts.append(Text(_short(str(content), max_chars)))
        for c in m.get("tool_calls") or []:
            parts.append(Text(_call_text(c, max_chars), style="green"))
        title = escape(role + (f" ← {m.get('name', '')} [{m.get('tool_call_id')}]" if role == "tool" else ""))
        style = ROLE_STYLE.get(role, "")
        if role == "tool" and str(content or "").startswith("Error:"):
            style = "red"
        console.print(Panel(Group(*parts) if parts else Text("(empty)", style="dim"), title=title,
                            title_align="left", border_style=style))

    if traj.turns:
        t = Table(title="turns", show_lines=False)
        for col in ("#", "kind", "seg", "prompt", "cached", "completion", "trained", "mean logprob", "tools", "gen s", "tools s", "finish"):
            t.add_column(col, justify="right" if col not in ("kind", "tools", "finish") else "left")
        for u in traj.turns:
            mean_lp = f"{sum(u.logprobs) / len(u.logprobs):.3f}" if u.logprobs else "-"
            tools = ", ".join(f"{c.name}{'!' if c.is_error else ''}" for c in u.tool_calls) or "-"
            row(t, str(u.index), u.kind, str(u.segment), str(u.prompt_tokens or len(u.prompt_ids)),
                str(u.cached_tokens), str(u.completion_tokens or len(u.completion_ids)),
                str(sum(u.trained_mask())), mean_lp, tools, f"{u.generate_s:.2f}",
                f"{u.tools_s:.2f}", u.finish_reason)
        console.print(t)
    if traj.final_message:
        console.print(Panel(Text(_short(traj.final_message, max_chars)), title="final message",
                            border_style="green"))
    todos = traj.tool_state.get("todos") if isinstance(traj.tool_state, dict) else None
    if todos:
        console.print(escape("todos: " + "; ".join(f"[{x['status']}] {x['content']}" for x in todos)))
