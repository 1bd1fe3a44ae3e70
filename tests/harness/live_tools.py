"""A second version of read_file, registered by import path while a job runs (live update test)."""

from __future__ import annotations

from typing import Any

from codedojo.harness.tools.base import FunctionTool, ToolContext
from codedojo.harness.tools.files import READ_FILE


def _read_file_v2(ctx: ToolContext, args: dict[str, Any]) -> str:
    return "[read_file v2]\n" + READ_FILE.run(ctx, args)


READ_FILE_V2 = FunctionTool(
    name="read_file",
    version="2",
    description=READ_FILE.description + " (v2: says which version answered)",
    parameters=READ_FILE.parameters,
    fn=_read_file_v2,
)
