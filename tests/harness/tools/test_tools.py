"""Every tool against a real sandbox, through its schema (ToolSession validates arguments)."""

from __future__ import annotations

import re

import pytest

from codedojo.harness.tools.base import ToolContext
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, ToolSession


def ok(session, name, **args) -> str:
    r = session.call(name, args)
    assert not r.is_error, r.content
    assert r.tool == name and r.version
    return r.content


def err(session, name, **args) -> str:
    r = session.call(name, args)
    assert r.is_error, r.content
    assert r.content.startswith("Error:")
    return r.content


def test_read_file(session):
    out = ok(session, "read_file", target_file="inventory/stock.py")
    assert "    19|    return [i.name for i in items if i.qty < threshold]" in out
    part = ok(session, "read_file", target_file="/workspace/inventory/stock.py", offset=18, limit=2)
    assert part.splitlines()[0].startswith("    18|") and "[lines 18-19 of 27]" in part
    assert "    27|" in ok(session, "read_file", target_file="inventory/stock.py", offset=-1)
    # 0, as a 0-based habit has it: the first line
    assert ok(session, "read_file", target_file="inventory/stock.py", offset=0, limit=2) == \
        ok(session, "read_file", target_file="inventory/stock.py", offset=1, limit=2)
    assert "file not found" in err(session, "read_file", target_file="nope.py")
    assert "binary file" in err(session, "read_file", target_file="data.bin")
    assert "past the end" in err(session, "read_file", target_file="README.md", offset=100)
    assert "missing required argument 'target_file'" in err(session, "read_file")
    assert "must be >= 1" in err(session, "read_file", target_file="README.md", limit=0)


def test_list_dir(session):
    out = ok(session, "list_dir", target_directory=".")
    lines = out.splitlines()
    assert lines[0] == "/workspace/"
    assert "  - inventory/" in lines and "  - tests/" in lines and "  - README.md (63 bytes)" in lines
    assert lines.index("  - inventory/") < lines.index("  - README.md (63 bytes)")  # dirs first
    out = ok(session, "list_dir", target_directory="/workspace", ignore_globs=["*.md", ".git"])
    assert "README.md" not in out and ".git" not in out and "pyproject.toml" in out
    assert "directory not found" in err(session, "list_dir", target_directory="missing")


def test_glob_file_search(session):
    assert ok(session, "glob_file_search", glob_pattern="*.py").splitlines() == [
        "/workspace/inventory/__init__.py", "/workspace/inventory/stock.py", "/workspace/tests/test_stock.py"]
    assert ok(session, "glob_file_search", glob_pattern="test_*.py", target_directory="tests") == \
        "/workspace/tests/test_stock.py"
    assert "No files matching" in ok(session, "glob_file_search", glob_pattern="*.rs")
    # absolute patterns: under the search root, anchored there
    assert ok(session, "glob_file_search", glob_pattern="/workspace/inventory/*.py").splitlines() == [
        "/workspace/inventory/__init__.py", "/workspace/inventory/stock.py"]
    assert ok(session, "glob_file_search", glob_pattern="/workspace/tests/test_*.py",
              target_directory="tests") == "/workspace/tests/test_stock.py"
    assert ok(session, "glob_file_search", glob_pattern="/workspace/**/stock.py") == \
        "/workspace/inventory/stock.py"


def test_grep(session):
    out = ok(session, "grep", pattern=r"def \w+\(items")
    assert "/workspace/inventory/stock.py:13:def total_value(items):" in out
    files = set(ok(session, "grep", pattern="qty", output_mode="files_with_matches").splitlines())
    assert files == {"/workspace/inventory/stock.py", "/workspace/tests/test_stock.py"}
    counts = ok(session, "grep", pattern="qty", path="inventory", output_mode="count")
    assert counts == "/workspace/inventory/stock.py:6"
    ctx = ok(session, "grep", pattern="KeyError", **{"-B": 1}, glob="*.py")
    assert "stock.py-26-            return i" in ctx and "stock.py:27:    raise KeyError(name)" in ctx
    assert "bolt" in ok(session, "grep", pattern="BOLT", **{"-i": True})
    assert ok(session, "grep", pattern="zzz_nothing") == "No matches found."
    multi = ok(session, "grep", pattern=r"class Item:\n\s+name", multiline=True)
    assert "class Item:" in multi
    limited = ok(session, "grep", pattern="i", head_limit=3)
    assert len(limited.splitlines()) == 4 and "more lines not shown" in limited
    assert "regex parse error" in err(session, "grep", pattern="(unclosed")
    assert "-i' must be of type boolean" in err(session, "grep", pattern="x", **{"-i": "yes"})
    # A pattern that looks like a flag is still a pattern.
    assert ok(session, "grep", pattern="--version") == "No matches found."


def test_a_path_the_search_cannot_read_is_noted_beside_what_it_found(session):
    ok(session, "run_terminal_cmd", command="mkdir secret && touch secret/x.py && chmod 000 secret")
    out = ok(session, "grep", pattern="def total_value")
    assert out.startswith("/workspace/inventory/stock.py:13:def total_value(items):")
    assert out.endswith("[not searched: /workspace/secret: Permission denied (os error 13)]")
    assert "[not searched: " in ok(session, "grep", pattern="zzz_nothing")
    files = ok(session, "glob_file_search", glob_pattern="*.py").splitlines()
    assert files[0] == "/workspace/inventory/__init__.py" and files[-1].startswith("[not searched")
    assert ok(session, "read_lints").startswith("No lint errors in ")


def test_an_edit_that_fails_is_not_noted_as_made(session):
    assert "is a directory" in err(session, "write", file_path="inventory", contents="x")
    err(session, "search_replace", file_path="/proc/x/y", old_string="", new_string="x")
    assert session.ctx.state.get("edited", []) == []
    ok(session, "write", file_path="new.py", contents="X = 1\n")
    assert session.ctx.state["edited"] == ["/workspace/new.py"]


def test_a_file_too_large_to_read_whole_is_refused_unread(session, monkeypatch):
    """Directly or through a link: the file tools do not take gigabytes into the host."""
    from codedojo.harness.tools import files

    monkeypatch.setattr(files, "MAX_TEXT_BYTES", 1000)
    ok(session, "run_terminal_cmd", command="seq 1 1000 > big.log && ln -s big.log link.log")
    read = []
    real = session.ctx.sandbox.read_file

    def read_file(p, max_bytes=None):
        data = real(p, max_bytes)
        read.append(p)
        return data

    monkeypatch.setattr(session.ctx.sandbox, "read_file", read_file)
    for path in ("big.log", "link.log"):
        assert "is 3893 bytes, more than the file tools read" in err(
            session, "read_file", target_file=path, limit=5)
        assert "more than the file tools read" in err(
            session, "search_replace", file_path=path, old_string="1\n", new_string="2\n")
    assert read == []  # (the sandbox refused each before reading it)
    assert ok(session, "read_file", target_file="inventory/__init__.py")
    ok(session, "run_terminal_cmd", command="seq 1 1000 | sed 's/^/x = /' > big.py")
    assert "more than the file tools read" in err(session, "read_lints", paths=["big.py"])
    assert ok(session, "read_lints", paths=["/workspace"]).startswith("No lint errors in 3 ")
    assert "/workspace/big.py" not in read


def test_an_edit_of_a_crlf_file_matches_lines_as_shown_and_keeps_their_endings(session,
                                                                               sandbox):
    sandbox.write_file("w.py", b"def f():\r\n    x = 1\r\n    return x\r\n")
    shown = ok(session, "read_file", target_file="w.py")
    assert "     2|    x = 1\n     3|    return x" in shown
    ok(session, "search_replace", file_path="w.py", old_string="    x = 1\n    return x\n",
       new_string="    x = 2\n    y = 3\n    return x + y\n")
    assert sandbox.read_file("w.py") == (b"def f():\r\n    x = 2\r\n    y = 3\r\n"
                                         b"    return x + y\r\n")


def test_search_replace(session, sandbox):
    out = ok(session, "search_replace", file_path="inventory/stock.py",
             old_string="i.qty < threshold", new_string="i.qty <= threshold")
    assert "Replaced 1 occurrence" in out
    assert b"i.qty <= threshold" in sandbox.read_file("/workspace/inventory/stock.py")
    assert "occurs 6 times" in err(session, "search_replace", file_path="inventory/stock.py",
                                   old_string="qty", new_string="quantity")
    ok(session, "search_replace", file_path="inventory/stock.py", old_string="qty", new_string="quantity",
       replace_all=True)
    assert b"qty" not in sandbox.read_file("/workspace/inventory/stock.py")
    assert "not found" in err(session, "search_replace", file_path="inventory/stock.py",
                              old_string="no such text", new_string="x")
    assert "identical" in err(session, "search_replace", file_path="README.md", old_string="a", new_string="a")
    assert "Created" in ok(session, "search_replace", file_path="docs/new.md", old_string="", new_string="hi\n")
    assert sandbox.read_file("/workspace/docs/new.md") == b"hi\n"
    # The paths edited are noted, once each (read_lints lints them by default).
    assert session.ctx.state["edited"] == ["/workspace/inventory/stock.py",
                                           "/workspace/docs/new.md"]


def test_write_and_delete_file(session, sandbox):
    assert "Wrote 6 bytes" in ok(session, "write", file_path="pkg/deep/mod.py", contents="x = 1\n")
    assert sandbox.read_file("/workspace/pkg/deep/mod.py") == b"x = 1\n"
    ok(session, "write", file_path="README.md", contents="replaced\n")
    assert sandbox.read_file("/workspace/README.md") == b"replaced\n"
    assert "Deleted" in ok(session, "delete_file", target_file="README.md")
    assert "file not found" in err(session, "delete_file", target_file="README.md")
    assert "is a directory" in err(session, "delete_file", target_file="inventory")
    kinds = {c.path: c.kind for c in sandbox.changes()}
    assert kinds["/workspace/README.md"] == "deleted" and kinds["/workspace/pkg/deep/mod.py"] == "added"
    assert "missing required argument 'contents'" in err(session, "write", file_path="a.py")
    # Escaping the sandbox is the sandbox's call; the tool reports it as an error.
    r = session.call("write", {"file_path": "/proc/1/nope", "contents": "x"})
    assert r.is_error


def test_run_terminal_cmd(session):
    out = ok(session, "run_terminal_cmd", command="cd inventory && export MARK=42 && echo hi && echo warn >&2")
    assert out == "exit code: 0\nhi\nstderr:\nwarn"
    assert ok(session, "run_terminal_cmd", command="(exit 3)") == "exit code: 3"
    out = ok(session, "run_terminal_cmd", command="pwd; echo $MARK")
    assert out == "exit code: 0\n/workspace/inventory\n42"  # the shell persists
    out = ok(session, "run_terminal_cmd", command="cd /workspace && python3 -m pytest -q -p no:cacheprovider tests")
    assert "exit code: 1" in out and "1 failed, 2 passed" in out
    timed = err(session, "run_terminal_cmd", command="echo before; sleep 10", timeout=1)
    assert "timed out after 1s" in timed and "before" in timed
    assert ok(session, "run_terminal_cmd", command="pwd") == "exit code: 0\n/workspace"  # fresh shell
    bg = ok(session, "run_terminal_cmd", command="echo from-bg; sleep 30", is_background=True)
    assert "Started in the background" in bg
    log = session.ctx.state["background"][-1]["log"]
    assert "from-bg" in ok(session, "run_terminal_cmd", command=f"sleep 0.3; cat {log}")
    assert "command is empty" in err(session, "run_terminal_cmd", command="  ")


def test_a_background_job_outlives_a_later_timeout_in_the_shells_directory_and_variables(
        session):
    """Started where the shell is, with what it exported; a later command that times out
    restarts the shell, not the server."""
    ok(session, "run_terminal_cmd", command="cd inventory && export PORT=8123 && LOCAL=1")
    ok(session, "run_terminal_cmd", command='echo "$PWD $PORT ${LOCAL:-unset}"; sleep 300',
       is_background=True)
    job = session.ctx.state["background"][-1]
    err(session, "run_terminal_cmd", command="sleep 10", timeout=1)
    out = ok(session, "run_terminal_cmd", command=f"kill -0 {job['pid']} && cat {job['log']}")
    assert out == "exit code: 0\n/workspace/inventory 8123 unset"


def test_long_output_is_truncated_with_a_marker(sandbox):
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig(max_output_chars=500)), ToolContext(sandbox=sandbox))
    r = s.call("run_terminal_cmd", {"command": "seq 1 5000"})
    assert r.truncated and len(r.content) < 600 and "[output truncated:" in r.content
    assert r.content.rstrip().endswith("5000")
    s.close()


def test_a_file_outside_the_workspace_is_linted_apart_from_one_of_the_same_path_inside():
    from codedojo.harness.lint import ruff_check

    found = ruff_check({"/tmp/a.py": "import os\n", "/workspace/tmp/a.py": "import sys\n"})
    assert sorted((d.path, d.message) for d in found) == [
        ("/tmp/a.py", "`os` imported but unused"),
        ("/workspace/tmp/a.py", "`sys` imported but unused")]


def test_ruff_reads_the_repositorys_settings_alone_and_no_host_file(tmp_path, monkeypatch):
    """A repository's `extend` names a file on the host, where ruff runs: it is not read (ruff
    quoted it back in its error); settings found above the copies (a /tmp/ruff.toml) or the
    user's are not read either; the repository's own, from the file ruff would take, are."""
    import tempfile

    from codedojo.harness.lint import ruff_check

    secret = tmp_path / "host.txt"
    secret.write_text("HOST_SECRET = oops\n")
    code = {"/workspace/a.py": "import os\n\nx = 'a line of forty-one characters.........'\n"}
    for config in ({"ruff.toml": f'extend = "{secret}"\nline-length = 40\n'},
                   {"pyproject.toml": f'[tool.ruff]\nextend = "{secret}"\nline-length = 40\n'}):
        with_e501 = {k: v + ("[lint]\n" if k == "ruff.toml" else "[tool.ruff.lint]\n")
                     + 'extend-select = ["E501"]\n' for k, v in config.items()}
        found = ruff_check(code, with_e501)
        assert sorted(d.code for d in found) == ["E501", "F401"], found
    # The first of ruff's names wins; a pyproject.toml with no ruff settings is not one.
    found = ruff_check(code, {".ruff.toml": "line-length = 40\n[lint]\nselect = ['E501']\n",
                              "ruff.toml": "[lint]\nselect = ['F401']\n"})
    assert [d.code for d in found] == ["E501"]
    assert [d.code for d in ruff_check(code, {"pyproject.toml": "[project]\nname = 'x'\n"})
            ] == ["F401"]
    with pytest.raises(ValueError, match="the repository's ruff.toml is not TOML"):
        ruff_check(code, {"ruff.toml": "extend = \n"})
    # The Python version the repository requires is the one its rules judge by.
    alias = {"/workspace/m.py": "from typing import TypeAlias\n\nX: TypeAlias = int\n"}
    project = '[project]\nname = "x"\nrequires-python = ">=3.12"\n'
    for config in ({"pyproject.toml": project + '[tool.ruff.lint]\nselect = ["UP"]\n'},
                   {"pyproject.toml": project, "ruff.toml": '[lint]\nselect = ["UP"]\n'}):
        assert [d.code for d in ruff_check(alias, config)] == ["UP040"], config
    # Settings above the copies on the host do not count.
    (tmp_path / "ruff.toml").write_text("[lint]\nselect = ['ALL']\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert [d.code for d in ruff_check(code)] == ["F401"]


def test_the_end_of_an_output_past_the_sandboxs_cap_is_seen(session):
    """A test run's summary is its last line: kept when megabytes came before it."""
    out = ok(session, "run_terminal_cmd", command="seq 1 400000; echo 'FINAL: 3 failed'")
    assert out.endswith("400000\nFINAL: 3 failed\n"
                        "[output past the sandbox's limit: its middle was cut]")


def test_read_lints(session):
    assert ok(session, "read_lints", paths=["inventory"]) == "No lint errors in 2 files."
    ok(session, "write", file_path="inventory/bad.py", contents="import os\nimport sys\n\nprint(sys.argv)\n")
    out = ok(session, "read_lints")  # default: the files the agent edited
    assert out.splitlines()[0] == "/workspace/inventory/bad.py:1:8: F401 `os` imported but unused"
    assert "1 lint error(s)." in out
    # The repository's own ruff settings apply (pyproject: line-length = 100, E501 not selected by default).
    assert "path not found" in err(session, "read_lints", paths=["nope.py"])


def test_todo_write(session):
    out = ok(session, "todo_write", merge=False, todos=[
        {"id": "1", "content": "find the bug", "status": "in_progress"}, {"id": "2", "content": "fix it"}])
    assert out == "[~] 1: find the bug\n[ ] 2: fix it\n(0/2 done)"
    out = ok(session, "todo_write", merge=True, todos=[{"id": "1", "status": "completed"}, {"id": "3", "content": "test"}])
    assert out.splitlines()[0] == "[x] 1: find the bug" and "(1/3 done)" in out
    assert session.state()["todos"][2] == {"id": "3", "content": "test", "status": "pending"}
    assert "status" in err(session, "todo_write", merge=True, todos=[{"id": "1", "status": "later"}])
    assert "'content' is required" in err(session, "todo_write", merge=False, todos=[{"id": "9"}])


def test_web_fetch_without_egress_has_no_network(session):
    out = err(session, "web_fetch", url="http://example.com/")
    assert "egress proxy" in out
    assert "absolute http(s) URL" in err(session, "web_fetch", url="file:///etc/passwd")


def test_unknown_tool_and_bad_json_are_results_not_exceptions(session):
    r = session.call("rm_rf", {})
    assert r.is_error and "unknown tool 'rm_rf'" in r.content
    r = session.call("read_file", '{"target_file": ')
    assert r.is_error and "not valid JSON" in r.content
    assert session.call("read_file", '{"target_file": "README.md"}').is_error is False


@pytest.mark.parametrize("strictness,expect_error", [("strict", True), ("lenient", False)])
def test_strictness_per_environment(sandbox, strictness, expect_error):
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig(strictness=strictness)), ToolContext(sandbox=sandbox))
    r = s.call("read_file", {"target_file": "README.md", "limit": "1", "explanation": "looking"})
    assert r.is_error is expect_error, r.content
    if not expect_error:
        assert r.content.startswith("     1|# inventory")
    s.close()


def test_per_tool_timeout_from_the_environment_caps_the_model(sandbox):
    cfg = EnvToolConfig(timeouts={"run_terminal_cmd": 1.0})
    s = ToolSession(ToolRegistry().resolve(cfg), ToolContext(sandbox=sandbox))
    r = s.call("run_terminal_cmd", {"command": "sleep 5", "timeout": 100})
    assert r.is_error and "timed out after 1s" in r.content and r.duration_s < 4
    s.close()


def test_search_replace_leaves_bytes_that_are_not_utf8_as_they_were(session, sandbox):
    latin1 = "# Auteur: François\nX = 1\n".encode("latin-1")
    sandbox.write_file("/workspace/legacy.py", latin1)
    assert "Auteur: Fran\ufffdois" in ok(session, "read_file", target_file="legacy.py")
    ok(session, "search_replace", file_path="legacy.py", old_string="X = 1", new_string="X = 2")
    assert sandbox.read_file("/workspace/legacy.py") == latin1.replace(b"X = 1", b"X = 2")
    assert "not all UTF-8" in err(session, "search_replace", file_path="legacy.py",
                                  old_string="Fran\ufffdois", new_string="Francois")


def test_read_file_numbers_lines_as_grep_does(session, sandbox):
    """A form feed (PEP 8's page break) or U+2028 is no line break to grep, nor to read_file."""
    sandbox.write_file("/workspace/paged.py",
                       "import os\n\x0c\ndef f():\n    s = 'a\u2028b'\r\n    return 1  # target\n"
                       .encode())
    where = ok(session, "grep", pattern="target", path="paged.py", output_mode="content")
    line = int(re.search(r"(\d+):\s+return 1", where).group(1))
    assert line == 5, where
    shown = ok(session, "read_file", target_file="paged.py", offset=line, limit=1)
    assert shown.splitlines()[0] == "     5|    return 1  # target"
    assert ok(session, "read_file", target_file="paged.py", offset=4, limit=1).startswith(
        "     4|    s = 'a\u2028b'\n")  # its "\r" is not shown


def test_a_listing_past_the_sandboxs_cap_has_no_cut_line_or_cut_path_among_its_paths():
    from codedojo.harness.ripgrep import rg_lines
    from codedojo.sandbox.base import ExecResult, cut_line

    out = "/w/a.py\n/w/b.p" + f"\n{cut_line(12345)}\n" + "y.py\n/w/c.py\n"
    lines, _ = rg_lines(ExecResult(0, out, "", truncated=True))
    assert lines == ["/w/a.py", "/w/c.py"]


def test_every_tools_output_is_text_the_next_prompt_can_carry(session):
    """A file name that is not UTF-8 (the model can make one) is listed with U+FFFD, by every
    tool alike, not as a lone surrogate that failed the next prompt's encoding."""
    ok(session, "run_terminal_cmd", command="touch $'caf\\xe9.py'")
    outputs = [ok(session, "list_dir", target_directory="."),
               ok(session, "glob_file_search", glob_pattern="caf*.py"),
               ok(session, "run_terminal_cmd", command="ls caf*")]
    for out in outputs:
        out.encode("utf-8")  # (a lone surrogate raises)
        assert "caf\ufffd.py" in out


def test_a_glob_narrows_a_search_and_never_widens_it_past_gitignore(session, sandbox):
    """rg's --glob would list what .gitignore leaves out (a '*.log', a whole ignored build/,
    even .git for '*'); a glob only chooses among the files a search without it sees."""
    sandbox.write_file("/workspace/.gitignore", b"build/\n*.log\ngenerated.py\n")
    for path in ("build/lib/x.py", "app.log", "inventory/generated.py", "inventory/notes.txt"):
        sandbox.write_file(f"/workspace/{path}", b"import os  # needle\n")
    seen = {"/workspace/inventory/notes.txt"}
    assert ok(session, "grep", pattern="needle", glob="*.log") == "No matches found."
    for glob in ("*", "**", "**/*", "*.{py,txt}", "!*.md"):
        out = ok(session, "grep", pattern="needle", glob=glob, output_mode="files_with_matches")
        assert set(out.splitlines()) == seen, glob
        files = ok(session, "glob_file_search", glob_pattern=glob).splitlines()
        assert not any("/build/" in f or f.endswith(("app.log", "generated.py")) or "/.git/" in f
                       for f in files), (glob, files)
    assert ok(session, "grep", pattern="needle", glob="**/*.py") == "No matches found."
    assert "No files matching" in ok(session, "glob_file_search", glob_pattern="*.log")
    assert ok(session, "glob_file_search", glob_pattern="*.py").splitlines() == [
        "/workspace/inventory/__init__.py", "/workspace/inventory/stock.py",
        "/workspace/tests/test_stock.py"]
    assert ok(session, "read_lints", paths=["/workspace"]) == "No lint errors in 3 files."
    # A path named is searched whatever ignores it (as rg does), through a glob too.
    assert ok(session, "grep", pattern="needle", path="app.log", glob="*.py") == \
        "1:import os  # needle"
    assert ok(session, "grep", pattern="needle", path="build", glob="*.py") == \
        "/workspace/build/lib/x.py:1:import os  # needle"
    # rg's glob syntax and errors
    assert ok(session, "grep", pattern="def low_stock", glob="inventory/{stock,x}.py") == \
        "/workspace/inventory/stock.py:17:def low_stock(items, threshold):"
    assert ok(session, "grep", pattern="qty", glob="!inventory/**",
              output_mode="files_with_matches") == "/workspace/tests/test_stock.py"
    assert "unclosed alternate group" in err(session, "grep", pattern="x", glob="{a,b")
    assert "unclosed character class" in err(session, "glob_file_search", glob_pattern="[ab")


def test_a_glob_finds_files_however_long_the_whole_trees_listing(provider, repo_image):
    """The listing a glob narrows is the whole tree's: past what a command's output may be (a
    large repository), the files the glob chooses are all still found."""
    import dataclasses

    from codedojo.sandbox.base import SandboxSpec
    from tests.harness.conftest import LIMITS, SANDBOX_ENV

    limits = dataclasses.replace(LIMITS, max_output_bytes=4096)
    sb = provider.create(SandboxSpec(image=repo_image, limits=limits, env=SANDBOX_ENV))
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig()), ToolContext(sandbox=sb))
    try:
        sb.exec("mkdir -p data && for i in $(seq 1000 1400); do echo x > data/note_$i.txt; done"
                " && echo 'needle = 1' > data/note_1200.py")
        assert sb.exec("rg --files --sort path").truncated  # (were it read whole: cut)
        assert "/workspace/data/note_1200.py" in ok(s, "glob_file_search", glob_pattern="*.py")
        assert ok(s, "grep", pattern="needle", glob="*.py") == \
            "/workspace/data/note_1200.py:1:needle = 1"
    finally:
        s.close()
        sb.destroy()


def test_a_glob_search_needs_no_room_on_the_sandbox_disk(session, sandbox):
    """The two listings a glob narrows meet in the sandbox without a file written: a full disk
    (a big build) takes nothing from the answer."""
    sandbox.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>/dev/null; "
                 "dd if=/dev/zero of=/workspace/fill bs=1M count=200 2>/dev/null", timeout=60)
    assert sandbox.exec("echo x > /tmp/probe").exit_code != 0  # (full)
    assert ok(session, "glob_file_search", glob_pattern="*.py").splitlines() == [
        "/workspace/inventory/__init__.py", "/workspace/inventory/stock.py",
        "/workspace/tests/test_stock.py"]


def test_a_match_on_a_line_longer_than_the_sandboxs_cap_is_found_and_a_cut_output_said(
        provider, repo_image):
    """A minified bundle's one line of megabytes is shown up to `MAX_COLUMNS` (it was cut by
    the sandbox with what was beside it: "No matches found."); an output the sandbox did cut
    says so, and that the lines it counts are fewer than there are."""
    import dataclasses

    from codedojo.sandbox.base import SandboxSpec
    from tests.harness.conftest import LIMITS, SANDBOX_ENV

    limits = dataclasses.replace(LIMITS, max_output_bytes=4096)
    sb = provider.create(SandboxSpec(image=repo_image, limits=limits, env=SANDBOX_ENV))
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig()), ToolContext(sandbox=sb))
    try:
        sb.write_file("/workspace/app.min.js", ("var a=" + "x," * 5000 + "needle();\n").encode())
        out = ok(s, "grep", pattern="needle", path="app.min.js")
        assert out.startswith("1:var a=x,x,") and len(out) < 1000, out[:200]
        sb.write_file("/workspace/many.txt", b"needle\n" * 2000)
        out = ok(s, "grep", pattern="needle", path="many.txt", head_limit=3)
        assert out.splitlines()[:3] == ["1:needle", "2:needle", "3:needle"]
        assert re.fullmatch(r"\.\.\. \[at least \d+ more lines not shown: rg's output passed "
                            r"the sandbox's limit and its middle was cut; narrow the search\]",
                            out.splitlines()[3]), out
        assert "middle was cut" in ok(s, "grep", pattern="needle", path="many.txt",
                                      head_limit=5000)
    finally:
        s.close()
        sb.destroy()


def test_grep_shows_a_line_as_one_whatever_separators_it_holds(session, sandbox):
    """Only "\\n" ends a line for rg: a form feed, U+2028, a group separator or a lone "\\r"
    inside a matched line leave it one line; a CRLF line is shown without its "\\r"."""
    sandbox.write_file("/workspace/odd.txt", "a needle\u2028b\x1dc\x0cd\re\nf needle\r\n".encode())
    out = ok(session, "grep", pattern="needle", path="odd.txt")
    assert out.split("\n") == ["1:a needle\u2028b\x1dc\x0cd\re", "2:f needle"]
    assert ok(session, "grep", pattern="needle", path="odd.txt", head_limit=1) == \
        "1:a needle\u2028b\x1dc\x0cd\re\n... [1 more lines not shown; raise head_limit or " \
        "narrow the search]"


def test_a_glob_is_read_from_the_path_searched_with_or_without_dot_slash_or_root(session):
    """grep reads its glob from its path, as glob_file_search reads its from its directory;
    both take a leading "./" and an absolute glob under the search root as anchored there."""
    stock = "/workspace/inventory/stock.py"
    assert ok(session, "glob_file_search", glob_pattern="./*.py") == "No files matching " \
        "'./*.py' under /workspace."  # (the root's own: none; "*.py" alone: any depth)
    assert ok(session, "glob_file_search", glob_pattern="./inventory/s*.py") == stock
    assert ok(session, "glob_file_search", glob_pattern="./stock.py",
              target_directory="inventory") == stock
    for glob in ("./inventory/*.py", "/workspace/inventory/s*.py", "inventory/stock.py"):
        assert ok(session, "grep", pattern="def low_stock", glob=glob,
                  output_mode="files_with_matches") == stock, glob
    for glob in ("stock.py", "./stock.py", "/workspace/inventory/stock.py", "s*.py"):
        assert ok(session, "grep", pattern="def low_stock", path="inventory", glob=glob,
                  output_mode="files_with_matches") == stock, glob
    assert ok(session, "grep", pattern="def low_stock", path="inventory",
              glob="inventory/stock.py") == "No matches found."  # (read from the path)


def test_a_shell_that_exits_by_itself_says_so(session):
    """`exit`, or `set -e` on a failing command, ends the persistent shell: the answer says
    the next command starts afresh, as it does after a timeout."""
    note = "[the shell exited: the next command runs in a new one (cwd and variables reset)]"
    ok(session, "run_terminal_cmd", command="cd inventory && export MARK=1")
    assert ok(session, "run_terminal_cmd", command="echo bye; exit 3") == \
        f"exit code: 3\nbye\n{note}"
    assert ok(session, "run_terminal_cmd", command="pwd; echo ${MARK:-unset}") == \
        "exit code: 0\n/workspace\nunset"  # (no note: this one did not end it)
    assert ok(session, "run_terminal_cmd", command="set -e; false; echo no") == \
        f"exit code: 1\n{note}"
    assert ok(session, "run_terminal_cmd", command="(exit 4)") == "exit code: 4"


def test_an_edit_of_a_file_of_mixed_line_endings_matches_lines_as_shown(session, sandbox):
    """read_file shows each line without the "\\r" before its "\\n", in a file that mixes
    CRLF and LF lines too: an edit of several lines matches them so, and each line replaced
    keeps its own ending."""
    sandbox.write_file("/workspace/notes.txt", b"alpha\r\nbeta\r\ngamma\ndelta\n")
    assert ok(session, "read_file", target_file="notes.txt").splitlines()[:3] == [
        "     1|alpha", "     2|beta", "     3|gamma"]
    ok(session, "search_replace", file_path="notes.txt", old_string="alpha\nbeta\ngamma\n",
       new_string="ALPHA\nBETA\nGAMMA\nMORE\n")
    assert sandbox.read_file("/workspace/notes.txt") == \
        b"ALPHA\r\nBETA\r\nGAMMA\nMORE\ndelta\n"
    ok(session, "search_replace", file_path="notes.txt", old_string="delta\n", new_string="d\n")
    assert sandbox.read_file("/workspace/notes.txt").endswith(b"MORE\nd\n")
    assert "not found" in err(session, "search_replace", file_path="notes.txt",
                              old_string="ALPHA\nGAMMA", new_string="x")
    # an occurrence of either endings counts: as shown, "a\nb" is there twice
    sandbox.write_file("/workspace/twice.txt", b"a\r\nb\r\nX\na\nb\nY\n")
    assert "occurs 2 times" in err(session, "search_replace", file_path="twice.txt",
                                   old_string="a\nb", new_string="Q")
    assert ok(session, "search_replace", file_path="twice.txt", old_string="a\nb",
              new_string="Q", replace_all=True).startswith("Replaced 2 occurrences")
    assert sandbox.read_file("/workspace/twice.txt") == b"Q\r\nX\nQ\nY\n"


def test_read_lints_follows_a_link_to_a_directory(session):
    ok(session, "run_terminal_cmd", command="ln -s inventory alias && ln -s stock.py "
       "inventory/link.py")
    assert ok(session, "read_lints", paths=["alias"]).startswith("No lint errors in ")
    ok(session, "write", file_path="inventory/bad.py", contents="import os\n")
    assert ok(session, "read_lints", paths=["alias"]).splitlines()[0] == \
        "/workspace/alias/bad.py:1:8: F401 `os` imported but unused"
    assert ok(session, "read_lints", paths=["inventory/link.py"]) == \
        "No lint errors in 1 file."  # (a link to a file: linted as one)


def test_html_is_text_with_its_body_entities_once_and_code_indented():
    from codedojo.harness.tools.web import html_to_text

    # HTML5 lets a page leave out </head>: its body is still there (the title is not).
    assert html_to_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>API</title>"
                        "<body><h1>requests.get</h1><p>Sends a GET request.</p></body>"
                        "</html>") == "requests.get\n\nSends a GET request."
    assert html_to_text("<p>Write &amp;lt;b&amp;gt; for a tag, &amp;amp; for &amp;</p>") == \
        "Write &lt;b&gt; for a tag, &amp; for &"
    assert html_to_text("<p>a   lot\tof  space</p><pre>def f(x):\n    if x:\n"
                        "        return 1\n</pre>tail") == \
        "a lot of space\n\ndef f(x):\n    if x:\n        return 1\n\ntail"
    assert html_to_text("<p>a <b> b</b> c</p>") == "a b c"  # (spaces across tags collapse)


def test_a_bad_url_or_a_missing_directory_is_named(session):
    """Not the catch-all of a tool's own bugs ("ValueError: ..."), nor the sandbox's cwd."""
    assert err(session, "web_fetch", url="http://[::1/") == \
        "Error: url is not a valid URL (Invalid IPv6 URL): 'http://[::1/'"
    assert err(session, "glob_file_search", glob_pattern="*.py", target_directory="missing") \
        == "Error: directory not found: /workspace/missing"
    assert err(session, "glob_file_search", glob_pattern="*.py",
               target_directory="README.md") == "Error: not a directory: /workspace/README.md"
