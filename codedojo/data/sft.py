"""SFT rendering of chat and tool trajectories, with loss on assistant tokens only.

The chat renderer (`codedojo.model.chat.render_with_mask`) alone decides which tokens are trained;
this module only feeds it conversations and stores its (ids, mask) pairs as masked token shards,
which the packer turns into `loss_mask`. Conversations are OpenAI chat messages, optionally with
tool calls and tool results, plus the tool schemas offered.

`code_sft_examples` builds a small instruction set from real code on the machine: "implement this
function" chats and read_file tool trajectories, so the SFT stage has code-grounded data without
any download.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from codedojo.data.readers import Document, json_objects
from codedojo.data.shards import ShardWriter

Message = dict[str, Any]

# the line ends ast numbers lines by; str.splitlines also breaks at \f, \v, \x1c-\x1e, \x85,
# \u2028 and \u2029, which may stand inside a line of code (a page break, a comment's text)
_LINE_END = re.compile(r"\r\n|\r|\n")


class ChatRenderer(Protocol):
    def __call__(self, messages: list[Message], tools: list[dict[str, Any]] | None = None
                 ) -> tuple[list[int], list[int]]: ...


READ_FILE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"target_file": {"type": "string"}},
                       "required": ["target_file"]},
    },
}


class Conversation(NamedTuple):
    """A chat to train on: its messages, the tool schemas offered, and where it came from
    (a file and line, which errors name)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    where: str = ""


def read_sft_jsonl(path: str | Path) -> Iterator[Conversation]:
    """Lines of {"messages": [...], "tools": [...]?}; errors name the line and field, and so do
    the renderer's (`render_to_shards`)."""
    for _, where, row in json_objects(Path(path)):
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: field 'messages' must be a non-empty list")
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"{where}: messages[{k}] must be an object with a role")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: field 'messages' has no assistant turn to train")
        tools = row.get("tools")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"{where}: field 'tools' must be a list of objects")
        yield Conversation(msgs, tools, where)


# conversations, or (messages, tools) pairs
Chats = Iterable[Conversation | tuple[list[Message], list[dict[str, Any]] | None]]


def render_to_shards(convs: Chats, render: ChatRenderer, out_dir: str | Path, vocab_size: int,
                     eos_id: int | None, max_tokens: int | None = None) -> Path:
    """Each conversation's (ids, mask) as a masked document; a conversation the renderer
    refuses is named by where it came from (or its place in ``convs``)."""
    w = ShardWriter(out_dir, vocab_size, eos_id)
    total = 0
    for n, (msgs, tools, *where) in enumerate(convs):
        try:
            ids, mask = render(msgs, tools)
        except ValueError as e:
            raise ValueError(f"{where[0] if where and where[0] else f'conversation {n}'}: "
                             f"{e}") from e
        if len(ids) != len(mask):
            raise ValueError("renderer returned ids and mask of different lengths")
        if not any(mask):
            continue  # nothing to learn from
        w.add(ids, mask)
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return w.close()


def _functions_with_docstrings(doc: Document, max_lines: int) -> Iterator[tuple[str, str, str]]:
    """(name, docstring summary, source) of each unindented function of ``doc`` with a
    docstring and 3 to ``max_lines`` lines; none for a file that does not parse, including one
    nested deeper than the parser builds (a long elif chain, a deeply nested expression)."""
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    lines = _LINE_END.split(doc.text)  # lines as ast numbers them
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        ds = ast.get_docstring(node)
        n = node.end_lineno - node.lineno + 1
        if not ds or n > max_lines or n < 3 or node.col_offset != 0:
            continue
        first = min((d.lineno for d in node.decorator_list), default=node.lineno)
        src = "\n".join(lines[first - 1:node.end_lineno])  # its decorators are the function's
        yield node.name, ds.strip().split("\n\n")[0], src


def code_sft_examples(docs: Iterable[Document], max_examples: int = 200, max_lines: int = 40
                      ) -> Iterator[Conversation]:
    """Alternates two shapes: a plain implement-this-function chat, and a tool trajectory where
    the assistant reads the file first (its tool call is trained, the tool output is not)."""
    n = 0
    for doc in docs:
        path = str(doc.meta.get("path", doc.source))
        for name, summary, src in _functions_with_docstrings(doc, max_lines):
            if n >= max_examples:
                return
            ask = f"Write the Python function `{name}` from `{path}`: {summary}"
            if n % 2 == 0:
                msgs: list[Message] = [{"role": "user", "content": ask},
                                       {"role": "assistant", "content": f"```python\n{src}\n```"}]
                yield Conversation(msgs, None, f"{path}: {name}")
            else:
                call = {"id": f"call_{n}", "type": "function",
                        "function": {"name": "read_file",
                                     "arguments": json.dumps({"target_file": path})}}
                excerpt = doc.text[:1500]
                msgs = [{"role": "user", "content": ask},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": f"call_{n}", "content": excerpt},
                        {"role": "assistant", "content": f"```python\n{src}\n```"}]
                yield Conversation(msgs, [READ_FILE_TOOL], f"{path}: {name}")
            n += 1
