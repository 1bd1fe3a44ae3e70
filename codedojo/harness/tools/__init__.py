"""The IDE-aligned tool library; `DEFAULT_TOOLS` lists version 1 of every tool."""

from codedojo.harness.tools.base import (
    FunctionTool,
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    invoke,
    tool_schema,
    truncate,
    validate_args,
)
from codedojo.harness.tools.files import (
    DELETE_FILE,
    GLOB_FILE_SEARCH,
    LIST_DIR,
    READ_FILE,
    SEARCH_REPLACE,
    WRITE,
)
from codedojo.harness.tools.grep import GREP
from codedojo.harness.tools.lints import READ_LINTS
from codedojo.harness.tools.search import CODEBASE_SEARCH
from codedojo.harness.tools.terminal import RUN_TERMINAL_CMD
from codedojo.harness.tools.todo import TODO_WRITE
from codedojo.harness.tools.web import WEB_FETCH

DEFAULT_TOOLS: tuple[Tool, ...] = (
    READ_FILE,
    LIST_DIR,
    GLOB_FILE_SEARCH,
    GREP,
    CODEBASE_SEARCH,
    SEARCH_REPLACE,
    WRITE,
    DELETE_FILE,
    RUN_TERMINAL_CMD,
    READ_LINTS,
    TODO_WRITE,
    WEB_FETCH,
)

__all__ = [
    "DEFAULT_TOOLS",
    "FunctionTool",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolResult",
    "invoke",
    "tool_schema",
    "truncate",
    "validate_args",
]
