"""Tool calls in model text: parse them out, and write them back in the model's own format.

Formats (a registry by name, `get_format(name)`):
- `hermes`: one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block per call
  (Hermes, Qwen2.5/Qwen3). A block may also hold a JSON list of calls.
- `smollm2`: SmolLM2-Instruct's trained shape, one block holding a JSON list
  `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`; parsed like `hermes`.
- `qwen3_coder`: XML, `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>
  </tool_call>`; values are converted with the tool's JSON schema when it is given.

Contract: parsing never raises on model output. A malformed call becomes a `ToolCallError`
value in the place the call was, so the agent loop can answer it with a tool error message and
the model learns from it. Parsing is linear in the text: markers are found with `str.find`, JSON
is read with the C decoder's `raw_decode` (which also means a `</tool_call>` inside a JSON string
does not end the call), and no backtracking regex touches the arguments.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

_WS = re.compile(r"\s*")


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


class _TooLarge:
    """A number past the float range, such as 1e999 (float() reads it as Infinity), kept as its
    text so that `_check_json_value` can name it."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _float(literal: str) -> float | _TooLarge:
    value = float(literal)
    return value if math.isfinite(value) else _TooLarge(literal)


_JSON = json.JSONDecoder(parse_constant=_not_json, parse_float=_float)
# `_json_at` decodes a window of the text this long first, doubling it while the answer could
# depend on what lies past the window; the decoder reads at most _LOOKAHEAD characters past
# where it stops (the "e+5" after "1", the "-Infinity" after "-").
_WINDOW, _LOOKAHEAD = 256, 16
# Errors quote at most this much of the offending text back to the model.
_RAW_QUOTE = 2000


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments as a JSON object."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class ToolCallError:
    """A call the model tried to make but wrote wrongly. `message` is meant for the model."""

    id: str
    message: str
    raw: str
    name: str | None = None

    def to_tool_message(self) -> dict[str, Any]:
        """An OpenAI `tool` message telling the model what was wrong."""
        return {"role": "tool", "tool_call_id": self.id, "content": f"Error: {self.message}"}


@dataclass
class ParsedOutput:
    """Model text split into plain content and the calls (or errors), in order of appearance."""

    content: str
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if isinstance(c, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [c for c in self.calls if isinstance(c, ToolCallError)]


class ToolCallFormat(Protocol):
    """One way a model writes tool calls. `start_marker` lets a streamer hold text back."""

    name: str
    start_marker: str

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None,
              id_factory: Callable[[], str] = new_call_id) -> ParsedOutput: ...

    def render(self, calls: Sequence[ToolCall]) -> str:
        """The calls as the model writes them; ValueError for a call the format cannot carry."""
        ...

    def call_prefix(self, name: str | None) -> str:
        """Text that commits the model to a call (of `name`, or of a tool it names itself):
        a server prefills it to honour `tool_choice` "required" or a named function."""
        ...


def _json_at(text: str, start: int = 0) -> tuple[Any, int]:
    """The JSON value that begins at ``text[start]`` and where it ends. ValueError saying what
    is wrong for anything but JSON a call's arguments can go on as: NaN and Infinity, numbers
    too large for a float, integers past Python's digit limit, lone surrogates.

    The value is decoded from a window of the text that doubles until the answer cannot depend
    on what lies past it: a decode error counts its line and column from the start of the
    string decoded, so decoding the whole text would cost each of many bad calls in a long
    text the length of the text before it.
    """
    size = _WINDOW
    while True:
        doc = text[start:start + size]
        # The decoder reads a few characters past where a value ends or an error is (the "e5"
        # that may follow "1"); past the window, an unterminated string may yet end.
        whole = start + size >= len(text)
        try:
            value, end = _JSON.raw_decode(doc)
        except json.JSONDecodeError as e:
            if whole or (e.pos + _LOOKAHEAD <= len(doc)
                         and not e.msg.startswith("Unterminated string")):
                raise ValueError(e.msg) from None
        except RecursionError:
            raise ValueError("nesting too deep") from None
        except ValueError as e:  # NaN, or an integer too long to convert: whole in the window
            raise ValueError(str(e).split(";")[0]) from None
        else:
            if whole or end + _LOOKAHEAD <= len(doc):
                _check_json_value(value)
                return value, start + end
        size *= 2


def _check_json_value(value: Any) -> None:
    """ValueError unless ``value`` can be written back as JSON and as text: no NaN or
    infinite float (`json.dumps` writes them as NaN and Infinity, which are not JSON) and no
    lone surrogates (an escape such as ``\\ud83d`` alone is no text, and no UTF-8 writer
    takes it)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, _TooLarge):
            raise ValueError(f"{v.literal[:40]} is a number too large for JSON")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{v} is not a JSON number")
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                code = ord(v[e.start])
                raise ValueError(f"a lone surrogate (\\u{code:04x}) is not text") from None


def loads_json(text: str) -> Any:
    """``text`` whole as JSON (`_json_at`'s rules)."""
    value, end = _json_at(text, _WS.match(text).end())
    if _WS.match(text, end).end() != len(text):
        raise ValueError("extra data after the JSON value")
    return value


def _quote(raw: str) -> str:
    return raw if len(raw) <= _RAW_QUOTE else raw[:_RAW_QUOTE] + f"... [{len(raw) - _RAW_QUOTE} more chars]"


# ----------------------------------------------------------------------------------------------
# JSON in <tool_call> blocks (Hermes / Qwen2.5 / SmolLM2)
# ----------------------------------------------------------------------------------------------


class _Find:
    """`text.find(sub, pos)` for one text that remembers its last answer for each `sub`, so
    that searches from positions that move forward read the text about once in all, not once
    per search (a search that finds nothing reads to the end)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.last: dict[str, tuple[int, int]] = {}  # sub -> (where the search began, its answer)

    def __call__(self, sub: str, pos: int) -> int:
        start, hit = self.last.get(sub, (len(self.text) + 1, -1))
        # The answer from `start` is the answer from any `pos` between `start` and the hit.
        if not (start <= pos and (hit < 0 or pos <= hit)):
            start, hit = pos, self.text.find(sub, pos)
            self.last[sub] = (start, hit)
        return hit


def _scan_blocks(
    text: str, open_tag: str,
    parse_block: Callable[[int], tuple[list[ToolCall | ToolCallError], int]],
) -> ParsedOutput:
    """Split `text` into plain content and the calls of every block opening with `open_tag`;
    `parse_block(start)` reads one block and says where the text resumes."""
    content: list[str] = []
    calls: list[ToolCall | ToolCallError] = []
    pos, n = 0, len(text)
    while pos < n:
        start = text.find(open_tag, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        found, pos = parse_block(start)
        calls.extend(found)
    return ParsedOutput("".join(content).strip(), calls)


class JsonToolCallFormat:
    """`<tool_call>JSON</tool_call>`, JSON being one call object or a list of them.

    A block whose closing tag is missing is accepted when the JSON is complete and nothing but
    whitespace follows it: the model ended its turn right after the call (its EOS replaces the
    tag). A block cut off inside the JSON is an error.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    start_marker = open_tag

    def __init__(self, name: str, list_style: bool) -> None:
        self.name = name
        self.list_style = list_style

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None,
              id_factory: Callable[[], str] = new_call_id) -> ParsedOutput:
        find = _Find(text)
        return _scan_blocks(text, self.open_tag,
                            lambda start: self._parse_block(text, start, id_factory, find))

    def _parse_block(self, text: str, start: int, id_factory: Callable[[], str],
                     find: _Find) -> tuple[list[ToolCall | ToolCallError], int]:
        n = len(text)
        body = _WS.match(text, start + len(self.open_tag)).end()
        try:
            value, end = _json_at(text, body)
        except ValueError as e:
            stop, closed = self._resync(text, body, find)
            where = "tool call" if closed else "unclosed <tool_call> block"
            error = ToolCallError(id_factory(), f"{where}: invalid JSON ({e})",
                                  _quote(text[start:stop]))
            return [error], stop
        after = _WS.match(text, end).end()
        if text.startswith(self.close_tag, after):
            pos = after + len(self.close_tag)
        elif after == n:
            pos = n
        else:
            stop, _ = self._resync(text, after, find)
            return [ToolCallError(
                id_factory(), f"unexpected text after the tool call JSON: {_quote(text[after:after + 40])!r}",
                _quote(text[start:stop]))], stop
        items = value if isinstance(value, list) else [value]
        return [_call_from_json(item, id_factory, _quote(text[start:pos])) for item in items], pos

    def _resync(self, text: str, pos: int, find: _Find) -> tuple[int, bool]:
        """Where the text resumes after a malformed block read up to ``pos``: past its closing
        tag, or at the next block's opening tag if that comes first (a block whose closing tag
        is missing does not take the next call with it); and whether the block was closed."""
        close = find(self.close_tag, pos)
        nxt = find(self.open_tag, pos)
        if nxt >= 0 and (close < 0 or nxt < close):
            return nxt, False
        return (len(text), False) if close < 0 else (close + len(self.close_tag), True)

    def call_prefix(self, name: str | None) -> str:
        head = self.open_tag + ("[\n" if self.list_style else "\n")
        return head + '{"name": "' + (f'{name}", "arguments": ' if name else "")

    def render(self, calls: Sequence[ToolCall]) -> str:
        objs = [json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) for c in calls]
        if self.list_style:
            return self.open_tag + "[\n" + ",\n".join(objs) + "\n]" + self.close_tag
        return "\n".join(f"{self.open_tag}\n{o}\n{self.close_tag}" for o in objs)


# The keys of a call object: Hermes, Qwen and SmolLM2 write "name" and "arguments"; Llama 3
# writes "parameters" for the arguments and may add "type": "function"; Mistral adds an "id".
_CALL_KEYS = ("name", "arguments", "parameters", "id", "type")


def _call_from_json(item: Any, id_factory: Callable[[], str], raw: str) -> ToolCall | ToolCallError:
    if not isinstance(item, dict):
        return ToolCallError(id_factory(), f"a tool call must be a JSON object, got {type(item).__name__}", raw)
    unknown = [k for k in item if k not in _CALL_KEYS]
    name = item.get("name")
    if unknown:
        # A misspelt "arguments" would otherwise be a call with no arguments.
        keys = ", ".join(json.dumps(k, ensure_ascii=False) for k in unknown)
        return ToolCallError(id_factory(), f"tool call has unknown keys {_quote(keys)}; write "
                             '{"name": ..., "arguments": {...}}', raw,
                             name if isinstance(name, str) and name else None)
    if not isinstance(name, str) or not name:
        return ToolCallError(id_factory(), "tool call has no \"name\" string", raw)
    given = [k for k in ("arguments", "parameters") if item.get(k) is not None]
    if len(given) > 1:
        return ToolCallError(id_factory(), f"tool call to {name} has both \"arguments\" and "
                             "\"parameters\"; write the arguments once", raw, name)
    args = item[given[0]] if given else {}
    if isinstance(args, str):
        # Some models write arguments as a JSON string, as the OpenAI API does.
        try:
            args = loads_json(args) if args.strip() else {}
        except ValueError as e:
            return ToolCallError(id_factory(), f"\"arguments\" of {name} is a string that is not "
                                 f"JSON ({e})", raw, name)
    if not isinstance(args, dict):
        return ToolCallError(id_factory(), f"\"arguments\" of {name} must be a JSON object, got "
                             f"{type(args).__name__}", raw, name)
    call_id = item.get("id") if isinstance(item.get("id"), str) and item.get("id") else id_factory()
    return ToolCall(call_id, name, args)


# ----------------------------------------------------------------------------------------------
# Qwen3-Coder XML
# ----------------------------------------------------------------------------------------------


class XmlToolCallFormat:
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`.

    Values are text; with the tool's schema they are converted to its declared type (integer,
    number, boolean, object, array, null), otherwise they stay strings. One newline on each
    side of a value is layout and is dropped.

    The format has no escape: a value ends at the first `</parameter>`, and a block ends where
    the next call opens (`<tool_call>`, then `<function=`), so no value can hold either
    (`render` refuses one that does); a value may mention the `<tool_call>` tag alone.
    """

    name = "qwen3_coder"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    start_marker = open_tag

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None,
              id_factory: Callable[[], str] = new_call_id) -> ParsedOutput:
        schemas = _param_schemas(tools)
        find = _Find(text)

        def block(start: int) -> tuple[list[ToolCall | ToolCallError], int]:
            call, end = self._parse_block(text, start, schemas, id_factory, find)
            return [call], end

        return _scan_blocks(text, self.open_tag, block)

    def _parse_block(self, text: str, start: int, schemas: dict[str, dict[str, Any]],
                     id_factory: Callable[[], str],
                     find: _Find) -> tuple[ToolCall | ToolCallError, int]:
        n = len(text)
        # The block ends where the next call opens: a block missing a closing tag does not take
        # the next call with it (nor does a value run on into it).
        nxt = _XML_CALL.search(text, start + len(self.open_tag))
        limit = n if nxt is None else nxt.start()

        def find_in(sub: str, pos: int) -> int:
            hit = find(sub, pos)
            return hit if hit < limit else -1

        def fail(msg: str, name: str | None = None) -> tuple[ToolCallError, int]:
            close = find_in(self.close_tag, start)
            stop = limit if close < 0 else close + len(self.close_tag)
            return ToolCallError(id_factory(), msg, _quote(text[start:stop]), name), stop

        i = _WS.match(text, start + len(self.open_tag)).end()
        if not text.startswith("<function=", i):
            return fail("expected <function=NAME> after <tool_call>")
        gt = find_in(">", i)
        nl = find("\n", i)
        if gt < 0 or (0 <= nl < gt):
            return fail("unclosed <function=NAME> tag")
        name = text[i + len("<function=") : gt].strip()
        if not name:
            return fail("<function=> has no name")
        types = schemas.get(name, {})
        args: dict[str, Any] = {}
        i = gt + 1
        while True:
            i = _WS.match(text, i).end()
            if text.startswith("<parameter=", i):
                pgt = find_in(">", i)
                if pgt < 0:
                    return fail(f"unclosed <parameter=...> tag in call to {name}", name)
                key = text[i + len("<parameter=") : pgt].strip()
                vstart = pgt + 1
                vend = find_in("</parameter>", vstart)
                if vend < 0:
                    return fail(f"parameter {key!r} of {name} has no </parameter>", name)
                raw_value = text[vstart:vend]
                if raw_value.startswith("\n"):
                    raw_value = raw_value[1:]
                if raw_value.endswith("\n"):
                    raw_value = raw_value[:-1]
                try:
                    args[key] = _convert(raw_value, types.get(key))
                except ValueError as e:
                    return fail(f"parameter {key!r} of {name}: {e}", name)
                i = vend + len("</parameter>")
                continue
            if text.startswith("</function>", i):
                i = _WS.match(text, i + len("</function>")).end()
                if text.startswith(self.close_tag, i):
                    return ToolCall(id_factory(), name, args), i + len(self.close_tag)
                if i == n:  # EOS right after </function>: the tag was implied
                    return ToolCall(id_factory(), name, args), n
                return fail(f"expected </tool_call> after </function> in call to {name}", name)
            if i == limit:
                return fail(f"call to {name} was cut off (no </function>)", name)
            return fail(f"unexpected text in call to {name}: {_quote(text[i:i + 40])!r}", name)

    def call_prefix(self, name: str | None) -> str:
        return f"{self.open_tag}\n<function=" + (f"{name}>\n" if name else "")

    def render(self, calls: Sequence[ToolCall]) -> str:
        """The calls as the model writes them. ValueError naming the argument for a value the
        parser would not read back (one holding `</parameter>`, or a call's opening)."""
        blocks = []
        for c in calls:
            params = []
            for k, v in c.arguments.items():
                value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                if (tag := "</parameter>" if "</parameter>" in value else
                        (m.group() if (m := _XML_CALL.search(value)) else None)):
                    raise ValueError(f"argument {k!r} of {c.name} holds {tag!r}, which the "
                                     f"{self.name} format cannot carry (it has no escape)")
                params.append(f"<parameter={k}>\n{value}\n</parameter>\n")
            blocks.append(f"{self.open_tag}\n<function={c.name}>\n{''.join(params)}</function>\n"
                          f"{self.close_tag}")
        return "\n".join(blocks)


# Where a Qwen3-Coder call opens: its tag, then the function's (the tag alone may be text)
_XML_CALL = re.compile(r"<tool_call>\s*<function=")


def _param_schemas(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """tool name -> {parameter name -> JSON schema type} from OpenAI tool definitions; a
    definition whose parameters or properties are not objects declares no types."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if not isinstance(props, dict):
            props = {}
        out[fn["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


_INTEGER = re.compile(r"-?[0-9]+")
# a decimal number as a model writes one: "2.5", "-1e-3", also ".5" and "5." (ASCII digits only)
_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _convert(value: str, kind: Any) -> Any:
    if isinstance(kind, list):  # ["integer", "null"]: try each declared type
        for k in kind:
            try:
                return _convert(value, k)
            except ValueError:
                pass
        raise ValueError(f"{value[:40]!r} matches none of the types {kind}")
    if kind in (None, "string"):
        return value
    v = value.strip()
    # int() and float() also take "1_000", other scripts' digits, "inf" and "nan": only JSON's
    # spellings are numbers. An integer stays an int, exact at any size.
    if kind in ("integer", "number") and _INTEGER.fullmatch(v):
        try:
            return int(v)
        except ValueError:  # past Python's digit limit
            raise ValueError(f"an integer of {len(v)} digits is too long") from None
    if kind == "integer":
        raise ValueError(f"{v[:40]!r} is not an integer")
    if kind == "number":
        if not _NUMBER.fullmatch(v):
            raise ValueError(f"{v[:40]!r} is not a number")
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"{v[:40]} is a number too large for JSON")
        return f
    if kind == "boolean":
        if v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ValueError(f"{v[:40]!r} is not a boolean")
    if kind == "null":
        if v in ("null", "None", ""):
            return None
        raise ValueError(f"{v[:40]!r} is not null")
    if kind in ("object", "array"):
        try:
            parsed = loads_json(v)
        except ValueError as e:
            raise ValueError(f"is not valid JSON for an {kind} ({e})") from None
        if not isinstance(parsed, dict if kind == "object" else list):
            raise ValueError(f"is not a JSON {kind}")
        return parsed
    return value


# ----------------------------------------------------------------------------------------------
# OpenAI API tool_calls
# ----------------------------------------------------------------------------------------------


def from_openai(tool_calls: Iterable[Any] | None) -> list[ToolCall | ToolCallError]:
    """Calls from an OpenAI-compatible API response (`message.tool_calls`, dicts or SDK objects)."""
    out: list[ToolCall | ToolCallError] = []
    for tc in tool_calls or ():
        d = tc if isinstance(tc, dict) else tc.model_dump() if hasattr(tc, "model_dump") else (
            vars(tc) if hasattr(tc, "__dict__") else None)
        if d is None or not isinstance(d.get("function") or {}, dict):
            what = "its function" if d is not None else "it"
            out.append(ToolCallError(new_call_id(), f"a tool call must be an object with a "
                                     f"\"function\" object; {what} is not",
                                     _quote(json.dumps(tc, ensure_ascii=False, default=str))))
            continue
        call_id = d.get("id") if isinstance(d.get("id"), str) and d.get("id") else new_call_id()
        fn = d.get("function") or {}
        name = fn.get("name")
        raw = json.dumps(d, ensure_ascii=False, default=str)
        if not isinstance(name, str) or not name:
            out.append(ToolCallError(call_id, "tool call has no function name", _quote(raw)))
            continue
        args = fn.get("arguments")
        try:
            if isinstance(args, str):
                args = loads_json(args) if args.strip() else {}
            else:  # a dict or list as it is, from a message built in Python
                _check_json_value(args)
        except ValueError as e:
            out.append(ToolCallError(call_id, f"arguments of {name} are not valid JSON ({e})",
                                     _quote(raw), name))
            continue
        if args is None:
            args = {}
        if not isinstance(args, dict):
            out.append(ToolCallError(call_id, f"arguments of {name} must be a JSON object", _quote(raw), name))
            continue
        out.append(ToolCall(call_id, name, args))
    return out


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


class UnknownToolCallFormat(ValueError):
    pass


FORMATS: dict[str, ToolCallFormat] = {}


def register_format(fmt: ToolCallFormat) -> None:
    FORMATS[fmt.name] = fmt


def get_format(name: str) -> ToolCallFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownToolCallFormat(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}") from None


def parse_tool_calls(text: str, format: str = "hermes", tools: Sequence[dict[str, Any]] | None = None,
                     id_factory: Callable[[], str] = new_call_id) -> ParsedOutput:
    """Split model text into content and tool calls with the named format."""
    return get_format(format).parse(text, tools, id_factory)


register_format(JsonToolCallFormat("hermes", list_style=False))
register_format(JsonToolCallFormat("smollm2", list_style=True))
register_format(XmlToolCallFormat())
