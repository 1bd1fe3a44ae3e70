"""`read_toml`: one error, naming the file, for whatever keeps a config from being read."""

from __future__ import annotations

import re

import pytest

from codedojo.configfile import plain_name, read_toml


def test_a_config_file_that_cannot_be_read_is_named_with_why(tmp_path):
    (tmp_path / "ok.toml").write_text('[a]\nb = "c"\n')
    (tmp_path / "bad.toml").write_text("[a\n")
    (tmp_path / "latin.toml").write_bytes(b'a = "caf\xe9"\n')
    assert read_toml(tmp_path / "ok.toml") == {"a": {"b": "c"}}
    for name, why in [("missing.toml", "no such file"), ("bad.toml", "not TOML"),
                      ("latin.toml", "not UTF-8 text (byte 8)"), ("", "a directory")]:
        path = tmp_path / name
        with pytest.raises(ValueError, match="^" + re.escape(f"{path}: {why}")):
            read_toml(path)


def test_a_plain_name_is_one_path_component_and_no_more():
    for name in ("run-1", "v0.2_fix", "A" * 100):
        assert plain_name(name) == name
    for name in ("", ".", "..", ".hidden", "a/b", "a b", "caf\u00e9", "x\n", "A" * 101):
        with pytest.raises(ValueError, match="is not a plain name"):
            plain_name(name)
    assert plain_name("A" * 101, max_length=None) == "A" * 101
