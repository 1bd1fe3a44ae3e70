"""codebase_search: semantic search over the workspace, answered by the host-side index
(`codedojo.harness.embeddings.CodebaseIndex`); only file reads touch the sandbox."""

from __future__ import annotations

import errno
from typing import Any

from codedojo.harness import embeddings
from codedojo.harness.embeddings import RootUnreadable, SearchTimeout
from codedojo.harness.lines import file_lines
from codedojo.harness.tools.base import FunctionTool, ToolContext, ToolError, obj, resolve

SNIPPET_LINES = 12


def _codebase_search(ctx: ToolContext, args: dict[str, Any]) -> str:
    if ctx.search is None:
        raise ToolError("codebase_search is not available in this environment")
    query = args["query"].strip()
    if not query:
        raise ToolError("query is empty")
    roots = [resolve(d) for d in (args.get("target_directories") or [])]
    try:
        hits = ctx.search.search(ctx.sandbox, query, roots or None, timeout_s=ctx.timeout_s)
    except SearchTimeout as e:
        done = f" with {e.indexed} of {e.total} chunks indexed" if e.total else ""
        raise ToolError(f"codebase_search timed out after {ctx.timeout_s:g}s{done}; "
                        "call it again to go on, or narrow target_directories") from None
    except RootUnreadable as e:  # ("No results." would say the code is not there)
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise ToolError(f"path not found: {e.filename}") from None
        raise ToolError(f"cannot search {e.filename}: {e.strerror}") from None
    left_out = hits.left_out
    note = (f"\n\n[only part of the code was searched: {left_out} files were left out past "
            f"the index's limit of {embeddings.MAX_FILES} files; pass target_directories to "
            "search the rest]" if left_out else "")
    if not hits:
        return "No results." + note
    blocks = []
    for h in hits:
        lines = file_lines(h.text)
        snippet = "\n".join(lines[:SNIPPET_LINES])
        if len(lines) > SNIPPET_LINES:
            snippet += f"\n... ({len(lines) - SNIPPET_LINES} more lines)"
        blocks.append(f"{h.path}:{h.start_line}-{h.end_line} (score {h.score:.3f})\n{snippet}")
    return "\n\n".join(blocks) + note


CODEBASE_SEARCH = FunctionTool(
    name="codebase_search",
    description=(
        "Semantic search: find code by meaning, e.g. 'where are user sessions validated'. Returns "
        "the best matching snippets with their line ranges."
    ),
    parameters=obj(
        {
            "query": {"type": "string", "description": "What you are looking for, in words."},
            "target_directories": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Limit the search to these directories.",
            },
        },
        ["query"],
    ),
    fn=_codebase_search,
)
