"""The tool contract: a named, versioned function with an OpenAI function-calling schema.

A tool never raises into the agent loop: `invoke` turns every failure (bad arguments, a
refused path, a timeout) into a `ToolResult` with `is_error=True` whose text the model reads.
Tools see the sandbox only through the `Sandbox` protocol, so the sandbox alone decides what a
path may touch.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from codedojo.sandbox.base import WORKSPACE, Sandbox, SandboxError, Shell

Strictness = Literal["strict", "lenient"]

DEFAULT_MAX_OUTPUT_CHARS = 20_000


class ToolError(Exception):
    """A failure the model should read (bad argument, missing file); never leaves `invoke`."""


@dataclass
class ToolResult:
    content: str
    is_error: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    tool: str = ""
    version: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "is_error": self.is_error,
            "truncated": self.truncated,
            "duration_s": self.duration_s,
            "tool": self.tool,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ToolResult:
        return cls(
            content=str(d["content"]),
            is_error=bool(d.get("is_error", False)),
            truncated=bool(d.get("truncated", False)),
            duration_s=float(d.get("duration_s", 0.0)),
            tool=str(d.get("tool", "")),
            version=str(d.get("version", "")),
        )


@dataclass
class ToolContext:
    """What one episode's tools share: its sandbox, its persistent shell, per-episode state
    (todos, original file contents, background jobs) and the host-side services."""

    sandbox: Sandbox
    timeout_s: float = 60.0
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
    state: dict[str, Any] = field(default_factory=dict)
    search: Any = None  # a CodebaseIndex (host side), or None when the tool is not offered
    _shell: Shell | None = None

    def shell(self) -> Shell:
        if self._shell is None:
            self._shell = self.sandbox.shell()
        return self._shell

    def reset_shell(self) -> None:
        """Drop a shell that timed out: the next call starts a fresh one."""
        if self._shell is not None:
            try:
                self._shell.close()
            except Exception:
                pass
        self._shell = None

    def remember_edit(self, path: str) -> None:
        """Note a path the file tools changed (`read_lints` lints them by default), once, in
        the order first edited. (What changed, and from what, the sandbox says: `changes`.)"""
        edited: list[str] = self.state.setdefault("edited", [])
        if (p := resolve(path)) not in edited:
            edited.append(p)

    def close(self) -> None:
        self.reset_shell()


@runtime_checkable
class Tool(Protocol):
    name: str
    version: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments (type: object)

    def run(self, ctx: ToolContext, args: dict[str, Any]) -> str: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI function-calling entry for `tool`."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


def resolve(path: str) -> str:
    """A sandbox path made absolute (relative paths are relative to /workspace)."""
    if not path:
        raise ToolError("path is empty")
    p = path if path.startswith("/") else f"{WORKSPACE}/{path}"
    parts: list[str] = []
    for part in p.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """Keep the head and the tail of `text` and say how much was cut in between."""
    if len(text) <= limit:
        return text, False
    head = limit * 2 // 3
    tail = limit - head
    cut = len(text) - head - tail
    marker = f"\n... [output truncated: {cut} characters omitted] ...\n"
    return text[:head] + marker + text[len(text) - tail :], True



# ---- argument validation -------------------------------------------------------------------

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def _coerce(value: Any, typ: str) -> Any:
    """Lenient mode: accept the string forms small models often emit ("10", "true")."""
    if typ == "integer" and isinstance(value, str) and re.fullmatch(r"[+-]?[0-9]+", value.strip()):
        return int(value)
    if typ == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if typ == "number" and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if typ == "boolean" and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if typ == "string" and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if typ == "array" and isinstance(value, str):
        from codedojo.model.toolcalls import loads_json

        try:
            parsed = loads_json(value)
        except ValueError:
            return [value]
        return parsed if isinstance(parsed, list) else value
    return value


def _check(value: Any, schema: Mapping[str, Any], where: str, lenient: bool) -> Any:
    typ = schema.get("type")
    if isinstance(typ, str):
        if lenient:
            value = _coerce(value, typ)
        ok = isinstance(value, _TYPES[typ]) and not (
            typ in ("integer", "number") and isinstance(value, bool)
        )
        if not ok:
            raise ToolError(f"argument {where!r} must be of type {typ}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolError(f"argument {where!r} must be one of {schema['enum']}, got {value!r}")
    if typ in ("integer", "number"):
        try:
            finite = math.isfinite(value)  # NaN passes every test below; 10**400 fails them all
        except OverflowError:
            finite = False
        if not finite:
            raise ToolError(f"argument {where!r} must be a finite number, got {value!r:.40}")
        if "minimum" in schema and value < schema["minimum"]:
            raise ToolError(f"argument {where!r} must be >= {schema['minimum']}, got {value!r}")
        if "maximum" in schema and value > schema["maximum"]:
            raise ToolError(f"argument {where!r} must be <= {schema['maximum']}, got {value!r}")
    if typ == "array" and "items" in schema:
        value = [_check(v, schema["items"], f"{where}[{i}]", lenient) for i, v in enumerate(value)]
    if typ == "object" and "properties" in schema:
        value = validate_args(value, schema, lenient=lenient, prefix=f"{where}.")
    return value


def validate_args(
    args: Any, schema: Mapping[str, Any], *, lenient: bool = False, prefix: str = ""
) -> dict[str, Any]:
    """Check `args` against an object schema; returns the (lenient: coerced) arguments.

    Strict mode rejects unknown arguments and wrong types; lenient mode drops unknown arguments
    and optional ones given as null, and coerces string forms of numbers and booleans. Both
    reject missing required arguments.
    """
    if not isinstance(args, dict):
        raise ToolError(f"arguments must be a JSON object, got {type(args).__name__}")
    props: Mapping[str, Any] = schema.get("properties", {})
    out: dict[str, Any] = {}
    required = schema.get("required", [])
    for key, value in args.items():
        if key not in props or (lenient and value is None and key not in required):
            if lenient:  # (null for an optional argument: left out, as OpenAI's strict mode
                continue  # spells one)
            raise ToolError(
                f"unknown argument {prefix + key!r}; expected one of {sorted(props)}"
            )
        out[key] = _check(value, props[key], prefix + key, lenient)
    for key in required:
        if key not in out:
            raise ToolError(f"missing required argument {prefix + key!r}")
    return out


def shown(text: str) -> str:
    """``text`` as the model is shown it: bytes that are not UTF-8 (a file name or a file's
    text kept as ``surrogateescape`` reads them) and lone surrogates as U+FFFD, so that every
    tool's output is text the next prompt can carry (such a name ended the episode)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def invoke(
    tool: Tool,
    ctx: ToolContext,
    args: Any,
    *,
    strictness: Strictness = "strict",
    max_output_chars: int | None = None,
) -> ToolResult:
    """Validate, run and truncate; every failure comes back as an error result."""
    t0 = time.perf_counter()
    limit = max_output_chars or ctx.max_output_chars
    try:
        checked = validate_args(args, tool.parameters, lenient=strictness == "lenient")
        text = tool.run(ctx, checked)
        is_error = False
    except ToolError as e:
        text, is_error = f"Error: {e}", True
    except SandboxError as e:
        text, is_error = f"Error: {e}", True
    except Exception as e:  # a tool bug must not end the episode; the model sees what failed
        text, is_error = f"Error: {type(e).__name__}: {e}", True
    text, cut = truncate(shown(text), limit)
    return ToolResult(
        content=text,
        is_error=is_error,
        truncated=cut,
        duration_s=time.perf_counter() - t0,
        tool=tool.name,
        version=tool.version,
    )


@dataclass
class FunctionTool:
    """A tool from a plain function: the usual way to write one."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[[ToolContext, dict[str, Any]], str]
    version: str = "1"

    def run(self, ctx: ToolContext, args: dict[str, Any]) -> str:
        return self.fn(ctx, args)


def obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """A JSON schema object with no extra properties (OpenAI strict-mode friendly)."""
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
