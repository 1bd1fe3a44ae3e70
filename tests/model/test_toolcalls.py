"""Tool-call parsing: well-formed, malformed and adversarial model output."""

from __future__ import annotations

import itertools
import json

import pytest

from codedojo.model.toolcalls import (
    ToolCall,
    ToolCallError,
    UnknownToolCallFormat,
    from_openai,
    get_format,
    loads_json,
    parse_tool_calls,
)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# -- hermes / smollm2 JSON ----------------------------------------------------------------------


def test_hermes_single_call_and_content():
    text = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"target_file": "a.py"}}\n</tool_call>'
    out = parse_tool_calls(text, "hermes", id_factory=ids())
    assert out.content == "Let me look."
    assert out.calls == [ToolCall("call_0", "read_file", {"target_file": "a.py"})]


def test_hermes_several_calls_in_one_turn():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"y": [1, {"z": 2}]}}</tool_call> done')
    out = parse_tool_calls(text, "hermes", id_factory=ids())
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("a", {"x": 1}), ("b", {"y": [1, {"z": 2}]})]
    assert out.content == "done"


def test_smollm2_list_block_and_empty_list():
    text = '<tool_call>[\n{"name": "f", "arguments": {"a": "1"}},\n{"name": "g", "arguments": {}}\n]</tool_call>'
    out = parse_tool_calls(text, "smollm2")
    assert [c.name for c in out.tool_calls] == ["f", "g"]
    assert parse_tool_calls("<tool_call>[]</tool_call>", "smollm2").calls == []


def test_json_string_containing_close_tag_and_braces():
    args = {"code": 'print("</tool_call>") if x else {"a": {"b": "}}"}}', "note": "<tool_call>"}
    text = f"<tool_call>{json.dumps({'name': 'write', 'arguments': args})}</tool_call>after"
    out = parse_tool_calls(text, "hermes")
    assert len(out.tool_calls) == 1 and out.tool_calls[0].arguments == args
    assert out.content == "after"


def test_arguments_given_as_json_string():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>'
    assert parse_tool_calls(text).tool_calls[0].arguments == {"a": 2}


def test_unclosed_tag_after_complete_json_is_accepted():
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}\n', "hermes")
    assert [c.name for c in out.tool_calls] == ["f"] and not out.errors


def test_unclosed_tag_cut_inside_json_is_an_error():
    out = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"a": "tru', "hermes")
    assert out.content == "ok"
    (err,) = out.calls
    assert isinstance(err, ToolCallError) and "unclosed" in err.message and "invalid JSON" in err.message


@pytest.mark.parametrize("body, needle", [
    ('{"name": "f", "arguments": {"a": 1,}}', "invalid JSON"),
    ('{"arguments": {}}', "name"),
    ('{"name": "f", "arguments": [1, 2]}', "JSON object"),
    ('"just a string"', "JSON object"),
    ('{"name": "f", "arguments": {}} trailing junk', "unexpected text"),
    ('{"name": "f", "arguments": "{not json"}', "not JSON"),
    # JSON no writer takes back: NaN, a lone surrogate (half an emoji), an integer of 5000 digits
    ('{"name": "f", "arguments": {"x": NaN}}', "NaN is not JSON"),
    ('{"name": "f", "arguments": {"x": -Infinity}}', "-Infinity is not JSON"),
    ('{"name": "f", "arguments": {"smile \\ud83d": 1}}', "a lone surrogate (\\ud83d) is not text"),
    ('{"name": "f", "arguments": "{\\"x\\": [\\"\\\\udc00\\"]}"}', "lone surrogate (\\udc00)"),
    ('{"name": "f", "arguments": {"n": ' + "7" * 5000 + '}}', "Exceeds the limit"),
    # numbers past the float range, which Python's decoder reads as Infinity without a word
    ('{"name": "f", "arguments": {"n": [1, -1e999]}}', "-1e999 is a number too large for JSON"),
    ('{"name": "f", "arguments": "{\\"n\\": 1e400}"}', "1e400 is a number too large for JSON"),
    # an arguments key the parser does not know is not a call without arguments
    ('{"name": "write_file", "args": {"path": "a.py"}}', 'unknown keys "args"'),
    ('{"name": "write_file", "argument": {}, "note": 1}', 'unknown keys "argument", "note"'),
    ('{"function": {"name": "f", "arguments": "{}"}}', 'unknown keys "function"'),
    ('{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}',
     'both "arguments" and "parameters"'),
])
def test_malformed_calls_become_error_values(body, needle):
    text = f"before <tool_call>{body}</tool_call> after"
    out = parse_tool_calls(text, "hermes")
    (err,) = out.calls
    assert isinstance(err, ToolCallError) and needle in err.message
    assert err.to_tool_message()["role"] == "tool" and err.to_tool_message()["tool_call_id"] == err.id
    # Text after the bad block is still content; the parser resynchronised on </tool_call>.
    assert out.content.endswith("after")


def test_malformed_call_does_not_swallow_the_next_good_one():
    text = '<tool_call>{"name": oops}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    out = parse_tool_calls(text, "hermes")
    assert isinstance(out.calls[0], ToolCallError) and out.calls[1].name == "g"


def test_arguments_null_counts_as_missing_and_llama_keys_are_known():
    text = ('<tool_call>[{"name": "f", "arguments": null, "parameters": {"a": 1}},\n'
            '{"type": "function", "name": "g", "parameters": {"b": 2}, "id": "c9"},\n'
            '{"name": "h", "arguments": null}]</tool_call>')
    out = parse_tool_calls(text, "smollm2", id_factory=ids())
    assert out.calls == [ToolCall("call_0", "f", {"a": 1}), ToolCall("c9", "g", {"b": 2}),
                         ToolCall("call_1", "h", {})]


def test_loads_json_refuses_numbers_too_large_for_a_float():
    for text, literal in [("1e999", "1e999"), ('{"a": [-1e400]}', "-1e400"), ("2e308", "2e308")]:
        with pytest.raises(ValueError, match=f"^{literal} is a number too large for JSON$"):
            loads_json(text)
    assert loads_json("[1.7e308, -5e-324]") == [1.7e308, -5e-324]


@pytest.mark.parametrize("between", ["\nI will also call g.\n", "\n", ""])
def test_a_block_missing_its_closing_tag_does_not_swallow_the_next_call(between):
    text = f'<tool_call>{{"name": "f", "arguments": {{}}}}{between}<tool_call>{{"name": "g", ' \
           '"arguments": {"a": 1}}</tool_call>'
    out = parse_tool_calls(text, "hermes")
    err, good = out.calls
    assert isinstance(err, ToolCallError) and good == ToolCall(good.id, "g", {"a": 1})
    assert isinstance(parse_tool_calls(text.replace('{}}', "{", 1), "hermes").calls[1], ToolCall)


def test_deep_nesting_is_an_error_not_a_crash():
    text = "<tool_call>" + "[" * 200_000 + "</tool_call>"
    (err,) = parse_tool_calls(text, "hermes").calls
    assert isinstance(err, ToolCallError)


@pytest.fixture
def decoded(monkeypatch):
    """The characters the parser hands its JSON decoder, in all (a window decoded again and
    again as it grows would be quadratic)."""
    from codedojo.model import toolcalls

    real = toolcalls._JSON
    count = [0]

    class Counting:
        def raw_decode(self, doc, *args):
            count[0] += len(doc)
            return real.raw_decode(doc, *args)

    monkeypatch.setattr(toolcalls, "_JSON", Counting())
    return count


def test_one_megabyte_arguments_parse_whole(decoded):
    big = "x = {'a': [1, 2, 3]}\n" * 50_000  # ~1 MB of code with braces and quotes
    text = _CountingText("<tool_call>" + json.dumps({"name": "write", "arguments": {
        "contents": big}}) + "</tool_call>")
    assert len(text) > 1_000_000
    out = parse_tool_calls(text, "hermes")
    assert out.tool_calls[0].arguments["contents"] == big
    assert text.read < 2 * len(text)  # (no search of the text again and again)
    assert decoded[0] < 4 * len(text)


def test_one_megabyte_unclosed_garbage_is_one_error_read_in_linear_work(decoded):
    text = _CountingText("<tool_call>{" + '"a":' * 250_000)
    out = parse_tool_calls(text, "hermes")
    assert isinstance(out.calls[0], ToolCallError)
    assert text.read < 4 * len(text) and decoded[0] < 4 * len(text)


class _CountingText(str):
    """Text that counts the characters its searches read: `find` and `rfind`, and `count`,
    which a JSON decode error runs from the start of the text it decoded to the error."""

    read = 0

    def find(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        hit = super().find(sub, start, end)
        self.read += (hit + len(sub) if hit >= 0 else end) - start
        return hit

    def rfind(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        hit = super().rfind(sub, start, end)
        self.read += end - (hit if hit >= 0 else start)
        return hit

    def count(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        self.read += end - start
        return super().count(sub, start, end)


@pytest.mark.parametrize("fmt, block", [
    ("smollm2", "<tool_call>x"),
    ("hermes", "<tool_call>{"),
    ("qwen3_coder", "<tool_call><function=f><parameter=a>1</tool_call>"),
    ("qwen3_coder", "<tool_call><function=f>x</function></tool_call>"),
])
def test_many_malformed_blocks_are_read_in_linear_work(fmt, block):
    # Each bad block must not cost a search or a decode to the end of the text.
    text = _CountingText(block * 2000)
    out = parse_tool_calls(text, fmt)
    assert len(out.errors) == 2000
    assert text.read < 20 * len(text)


def test_a_value_reads_the_same_wherever_the_text_around_it_ends():
    # Values of every length, so that each kind of token meets the end of a decode window.
    for k in range(0, 600, 7):
        pad = "a" * k
        good = f'<tool_call>{{"name": "f", "arguments": {{"s": "{pad}", "n": -1.5e+3, "t": true}}}}'
        (call,) = parse_tool_calls(good + "</tool_call>").calls
        assert call.arguments == {"s": pad, "n": -1500.0, "t": True}
        (err,) = parse_tool_calls(good.replace("true", "tru") + "</tool_call>").calls
        assert "Expecting value" in err.message
        (err,) = parse_tool_calls(good.replace("-1.5e+3", "-1.5e+999") + "</tool_call>").calls
        assert "-1.5e+999 is a number too large for JSON" in err.message


def test_text_without_calls_is_all_content():
    out = parse_tool_calls("no tools here, {\"name\": 1}", "hermes")
    assert out.calls == [] and out.content == 'no tools here, {"name": 1}'


def test_render_then_parse_round_trips():
    calls = [ToolCall("call_0", "a", {"x": "</tool_call>"}), ToolCall("call_1", "b", {"n": 2, "l": [1]})]
    for fmt in ("hermes", "smollm2", "qwen3_coder"):
        f = get_format(fmt)
        tools = [{"type": "function", "function": {"name": "b", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}, "l": {"type": "array"}}}}}]
        parsed = f.parse(f.render(calls), tools=tools, id_factory=ids())
        # For XML, `</tool_call>` inside a value is fine too: blocks are read parameter by
        # parameter, and the schema turns "2" back into an integer.
        assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]


# -- qwen3-coder XML ----------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object", "properties": {
    "pattern": {"type": "string"}, "-A": {"type": "integer"}, "-i": {"type": "boolean"},
    "globs": {"type": "array"}, "ratio": {"type": "number"}}}}}]


def test_xml_call_with_typed_parameters():
    text = ("I'll search.\n<tool_call>\n<function=grep>\n<parameter=pattern>\ndef foo(\n</parameter>\n"
            "<parameter=-A>\n3\n</parameter>\n<parameter=-i>\ntrue\n</parameter>\n"
            "<parameter=globs>\n[\"*.py\"]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
            "</function>\n</tool_call>")
    out = parse_tool_calls(text, "qwen3_coder", tools=TOOLS)
    assert out.content == "I'll search."
    (call,) = out.tool_calls
    assert call.name == "grep"
    assert call.arguments == {"pattern": "def foo(", "-A": 3, "-i": True, "globs": ["*.py"], "ratio": 0.5}


def test_xml_multiline_value_keeps_inner_newlines_and_no_schema_means_strings():
    text = "<tool_call><function=write><parameter=contents>\na\n\nb\n</parameter><parameter=n>5</parameter></function></tool_call>"
    (call,) = parse_tool_calls(text, "qwen3_coder").tool_calls
    assert call.arguments == {"contents": "a\n\nb", "n": "5"}


def test_xml_several_calls():
    one = "<tool_call><function=f><parameter=a>1</parameter></function></tool_call>"
    out = parse_tool_calls(one + "\n" + one.replace("=f>", "=g>"), "qwen3_coder")
    assert [c.name for c in out.tool_calls] == ["f", "g"]


@pytest.mark.parametrize("text, needle", [
    ("<tool_call><parameter=a>1</parameter></tool_call>", "expected <function=NAME>"),
    ("<tool_call><function=f><parameter=a>1</function></tool_call>", "no </parameter>"),
    ("<tool_call><function=f><parameter=a>1</parameter>", "cut off"),
    ("<tool_call><function=f>junk</function></tool_call>", "unexpected text"),
    ("<tool_call><function=grep><parameter=-A>three</parameter></function></tool_call>", "not an integer"),
    ("<tool_call><function=grep\n", "unclosed <function"),
    ("<tool_call><function=grep><parameter=ratio>nan</parameter></function></tool_call>",
     "'nan' is not a number"),
    # int() and float() read these; JSON does not
    ("<tool_call><function=grep><parameter=-A>1_000</parameter></function></tool_call>",
     "'1_000' is not an integer"),
    ("<tool_call><function=grep><parameter=-A>\u0661\u0662</parameter></function></tool_call>",
     "is not an integer"),
    ("<tool_call><function=grep><parameter=ratio>1_0.5</parameter></function></tool_call>",
     "'1_0.5' is not a number"),
    ("<tool_call><function=grep><parameter=ratio>Infinity</parameter></function></tool_call>",
     "'Infinity' is not a number"),
    ("<tool_call><function=grep><parameter=ratio>-1e400</parameter></function></tool_call>",
     "-1e400 is a number too large for JSON"),
    ('<tool_call><function=grep><parameter=globs>["\\ud800"]</parameter></function></tool_call>',
     "lone surrogate"),
])
def test_xml_malformed(text, needle):
    (err,) = parse_tool_calls(text, "qwen3_coder", tools=TOOLS).calls
    assert isinstance(err, ToolCallError) and needle in err.message


def test_xml_numbers_keep_their_value():
    text = ("<tool_call><function=grep><parameter=ratio>12345678901234567890</parameter>"
            "<parameter=-A>-98765432109876543210</parameter></function></tool_call>")
    (call,) = parse_tool_calls(text, "qwen3_coder", tools=TOOLS).tool_calls
    assert call.arguments == {"ratio": 12345678901234567890, "-A": -98765432109876543210}
    assert isinstance(call.arguments["ratio"], int)
    for written, value in (("-2.5e-3", -0.0025), (".5", 0.5), ("5.", 5.0), ("+1.5", 1.5)):
        text = (f"<tool_call><function=grep><parameter=ratio>{written}</parameter></function>"
                "</tool_call>")
        (call,) = parse_tool_calls(text, "qwen3_coder", tools=TOOLS).tool_calls
        assert call.arguments == {"ratio": value}, written


def test_xml_one_megabyte_value_parses_whole():
    big = "<div>{x}</div>\n" * 70_000
    text = _CountingText(f"<tool_call><function=write><parameter=contents>\n{big}\n"
                         "</parameter></function></tool_call>")
    (call,) = parse_tool_calls(text, "qwen3_coder").tool_calls
    # (read twice: once for where the block ends, the next <tool_call>, once for the value's end)
    assert call.arguments["contents"] == big and text.read < 3 * len(text)


_XML_B = "<tool_call>\n<function=b>\n<parameter=y>\n2\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("broken, needle", [
    ("<tool_call>\n<function=a>\n<parameter=x>\n1\n</function>\n</tool_call>", "no </parameter>"),
    ("<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n",
     "expected </tool_call>"),
    ("<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n", "cut off"),
    ("<tool_call>\n<function=a>\n<parameter=x>\n1\n", "no </parameter>"),
    ("<tool_call>\n<function=a\n", "unclosed <function"),
    ("<tool_call>\n<function=a>\n<parameter=x", "unclosed <parameter"),
])
def test_xml_a_block_missing_a_closing_tag_does_not_swallow_the_next_call(broken, needle):
    out = parse_tool_calls(broken + _XML_B, "qwen3_coder", id_factory=ids())
    err, good = out.calls
    assert isinstance(err, ToolCallError) and needle in err.message and err.raw == broken
    assert good == ToolCall("call_1", "b", {"y": "2"})


def test_xml_render_refuses_a_value_the_parser_cannot_read_back():
    f = get_format("qwen3_coder")
    for value in ("<a>x</parameter>y</a>", {"s": "</parameter>"},
                  "a call: <tool_call>\n<function=f>"):
        with pytest.raises(ValueError, match="^argument 'content' of write holds "):
            f.render([ToolCall("c", "write", {"path": "t", "content": value})])


def test_xml_a_value_may_mention_the_call_tag():
    """Code about the format names its tag: a value holding ``<tool_call>`` that opens no call
    (no ``<function=`` after it) is read back whole, and does not end its block."""
    doc = "DOC = '<tool_call>{...}</tool_call> is how a call looks'"
    call = ToolCall("call_0", "write_file", {"path": "d.py", "content": doc})
    text = get_format("qwen3_coder").render([call]) + "\n" + _XML_B
    assert parse_tool_calls(text, "qwen3_coder", id_factory=ids()).calls == [
        call, ToolCall("call_1", "b", {"y": "2"})]


def test_xml_tool_definitions_whose_parameters_are_not_objects_declare_no_types():
    text = "<tool_call><function=f><parameter=a>1</parameter></function></tool_call>"
    for params in ({"type": "object", "properties": ["a"]}, ["a"], "object",
                   {"properties": {"a": None, "b": {"type": "integer"}}}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        assert parse_tool_calls("plain answer", "qwen3_coder", tools).calls == []
        (call,) = parse_tool_calls(text, "qwen3_coder", tools).calls
        assert call.arguments == {"a": "1"}


# -- OpenAI API tool_calls and the registry -----------------------------------------------------


def test_from_openai():
    calls = from_openai([
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{bad"}},
        {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
        {"id": "c4", "type": "function", "function": {"arguments": "{}"}},
    ])
    assert calls[0] == ToolCall("c1", "f", {"a": 1})
    assert all(isinstance(c, ToolCallError) for c in calls[1:])
    assert calls[1].id == "c2" and calls[1].name == "g"
    # entries of other shapes are errors too, not exceptions
    odd = from_openai(["read_file", None, {"id": "c5", "function": "read_file"},
                       {"id": "c6", "function": {"name": "f", "arguments": '{"x": NaN}'}}])
    assert [type(c) for c in odd] == [ToolCallError] * 4
    assert "must be an object with a \"function\" object" in odd[2].message
    assert "NaN is not JSON" in odd[3].message


def test_from_openai_refuses_numbers_too_large_for_json():
    def call(args):
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}

    too_large = from_openai([call('{"x": 1e999}'), call({"x": float("inf")}),
                             call({"x": [float("nan")]})])
    assert [type(c) for c in too_large] == [ToolCallError] * 3
    assert "1e999 is a number too large for JSON" in too_large[0].message
    assert "inf is not a JSON number" in too_large[1].message
    assert "nan is not a JSON number" in too_large[2].message


def test_to_openai_shape():
    d = ToolCall("c", "f", {"a": "é"}).to_openai()
    assert d == {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "é"}'}}


def test_unknown_format_is_named():
    with pytest.raises(UnknownToolCallFormat, match="nope"):
        parse_tool_calls("x", "nope")
