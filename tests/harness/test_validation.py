import pytest

from codedojo.harness.tools import DEFAULT_TOOLS, ToolError, tool_schema, truncate, validate_args
from codedojo.harness.tools.grep import GREP
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, parse_arguments


def test_every_schema_is_a_valid_openai_function():
    names = set()
    for tool in DEFAULT_TOOLS:
        s = tool_schema(tool)
        assert s["type"] == "function"
        fn = s["function"]
        assert fn["name"] == tool.name and fn["description"]
        params = fn["parameters"]
        assert params["type"] == "object"
        assert set(params["required"]) <= set(params["properties"])
        for prop in params["properties"].values():
            assert prop.get("type") in ("string", "integer", "number", "boolean", "array", "object")
        names.add(tool.name)
    assert names == {
        "read_file", "list_dir", "glob_file_search", "grep", "codebase_search", "search_replace",
        "write", "delete_file", "run_terminal_cmd", "read_lints", "todo_write", "web_fetch",
    }


def test_strict_and_lenient_validation():
    schema = GREP.parameters
    with pytest.raises(ToolError, match="missing required argument 'pattern'"):
        validate_args({}, schema)
    with pytest.raises(ToolError, match="unknown argument 'bogus'"):
        validate_args({"pattern": "x", "bogus": 1}, schema)
    with pytest.raises(ToolError, match="argument '-A' must be of type integer"):
        validate_args({"pattern": "x", "-A": "2"}, schema)
    with pytest.raises(ToolError, match="output_mode"):
        validate_args({"pattern": "x", "output_mode": "lines"}, schema)
    with pytest.raises(ToolError, match="'-i' must be of type boolean"):
        validate_args({"pattern": "x", "-i": 1}, schema)
    ok = validate_args({"pattern": "x", "-A": "2", "-i": "true", "bogus": 1}, schema, lenient=True)
    assert ok == {"pattern": "x", "-A": 2, "-i": True}


def test_nested_items_are_checked():
    from codedojo.harness.tools.todo import TODO_WRITE

    with pytest.raises(ToolError, match=r"todos\[0\].status"):
        validate_args({"merge": False, "todos": [{"id": "1", "status": "later"}]}, TODO_WRITE.parameters)


def test_truncation_keeps_head_and_tail_with_marker():
    text = "".join(f"line {i}\n" for i in range(10_000))
    out, cut = truncate(text, 1000)
    assert cut and len(out) < 1100
    assert out.startswith("line 0\n") and out.rstrip().endswith("line 9999")
    assert "[output truncated:" in out
    assert truncate("short", 1000) == ("short", False)


def test_parse_arguments():
    assert parse_arguments('{"a": 1}') == ({"a": 1}, None)
    # JSON no writer takes back is an error, not an exception or a NaN passed on
    for raw, why in (('{"n": NaN}', "NaN is not JSON"), ('{"s": "\\ud83d"}', "lone surrogate"),
                     ('{"n": ' + "1" * 5000 + "}", "Exceeds the limit"),
                     ("[" * 100_000, "nesting too deep")):
        assert parse_arguments(raw)[0] is None and why in parse_arguments(raw)[1]
    assert parse_arguments("") == ({}, None)
    args, err = parse_arguments('{"a": ')
    assert args is None and "not valid JSON" in err
    args, err = parse_arguments("[1]")
    assert args is None and "JSON object" in err


def test_registry_config_errors_name_the_field():
    reg = ToolRegistry()
    with pytest.raises(ValueError, match="tools: unknown tool 'nope'"):
        reg.resolve(EnvToolConfig(tools=["nope"]))
    with pytest.raises(ValueError, match="versions.grep: unknown version '9'"):
        reg.resolve(EnvToolConfig(tools=["grep"], versions={"grep": "9"}))
    with pytest.raises(ValueError, match="strictness"):
        EnvToolConfig(strictness="loose")


def test_a_registered_version_is_not_replaced_by_other_code():
    from dataclasses import replace

    reg = ToolRegistry()
    first = reg.register(GREP)  # the same object again: the latest once more
    assert first > 0 and reg.resolve(EnvToolConfig(tools=["grep"])).tools["grep"] is GREP
    other = replace(GREP, fn=lambda ctx, args: "something else")
    with pytest.raises(ValueError, match="tool 'grep' version '1' is already registered"):
        reg.register(other)
    assert reg.resolve(EnvToolConfig(tools=["grep"])).tools["grep"] is GREP
    assert reg.register(replace(other, version="2")) == first + 1


def test_env_config_from_toml(tmp_path):
    p = tmp_path / "env.toml"
    p.write_text('tools = ["read_file", "grep"]\nstrictness = "lenient"\n[timeouts]\ngrep = 5.0\n')
    cfg = EnvToolConfig.from_toml(p)
    ts = ToolRegistry().resolve(cfg)
    assert list(ts.tools) == ["read_file", "grep"] and cfg.timeouts["grep"] == 5.0
    assert [s["function"]["name"] for s in ts.schemas()] == ["read_file", "grep"]


@pytest.mark.parametrize("lenient", [False, True])
def test_a_number_that_is_not_finite_is_refused(lenient):
    """`NaN` is valid to Python's JSON reader, and passes every comparison: as a command's
    timeout it held no limit at all."""
    from codedojo.harness.tools.terminal import RUN_TERMINAL_CMD

    schema = RUN_TERMINAL_CMD.parameters
    for raw in ('{"command": "sleep 9", "timeout": NaN}', '{"command": "x", "timeout": Infinity}'):
        assert "is not JSON" in parse_arguments(raw)[1]  # refused as it is read
    for args in ({"command": "sleep 9", "timeout": float("nan")},  # sent as an object
                 {"command": "x", "timeout": float("inf")}, {"command": "x", "timeout": "nan"}):
        if not lenient and isinstance(args["timeout"], str):
            continue  # a string is refused by type already
        with pytest.raises(ToolError, match="argument 'timeout' must be a finite number"):
            validate_args(args, schema, lenient=lenient)
    assert validate_args({"command": "x", "timeout": 5}, schema, lenient=lenient)["timeout"] == 5


def test_an_integer_too_large_for_a_float_is_checked_without_a_crash():
    """(`math.isfinite(10**400)` raises OverflowError; as a command's timeout, a number no
    float holds failed the tool as it ran.)"""
    from codedojo.harness.tools.terminal import RUN_TERMINAL_CMD

    with pytest.raises(ToolError, match="argument 'timeout' must be a finite number"):
        validate_args({"command": "x", "timeout": 10**400}, RUN_TERMINAL_CMD.parameters)
    assert validate_args({"command": "x", "timeout": 10**300}, RUN_TERMINAL_CMD.parameters)


def test_null_for_an_optional_argument_is_left_out_in_lenient_mode():
    from codedojo.harness.tools.files import READ_FILE

    args = {"target_file": "a.py", "offset": None}
    assert validate_args(args, READ_FILE.parameters, lenient=True) == {"target_file": "a.py"}
    with pytest.raises(ToolError, match="argument 'offset' must be of type integer"):
        validate_args(args, READ_FILE.parameters)
    with pytest.raises(ToolError, match="argument 'target_file' must be of type string"):
        validate_args({"target_file": None}, READ_FILE.parameters, lenient=True)


@pytest.mark.parametrize("value", ["--5", "²", "1_0", "+"])
def test_lenient_integers_that_are_no_integers_name_the_argument(value):
    with pytest.raises(ToolError, match="argument '-A' must be of type integer"):
        validate_args({"pattern": "x", "-A": value}, GREP.parameters, lenient=True)
    assert validate_args({"pattern": "x", "-A": " +3 "}, GREP.parameters, lenient=True)["-A"] == 3


def test_env_config_limits_and_pins_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"timeouts: \['run_termnal_cmd'\] not among the tools"):
        EnvToolConfig(tools=["read_file"], timeouts={"run_termnal_cmd": 900})
    with pytest.raises(ValueError, match=r"versions: \['grep'\] not among the tools"):
        EnvToolConfig(tools=["read_file"], versions={"grep": "1"})
    for bad in (-1, 0, float("nan"), float("inf"), 30 * 24 * 3600):  # (a month: a mistake)
        with pytest.raises(ValueError, match="timeouts.read_file"):
            EnvToolConfig(tools=["read_file"], timeouts={"read_file": bad})
    with pytest.raises(ValueError, match="default_timeout_s"):
        EnvToolConfig(default_timeout_s=float("nan"))
