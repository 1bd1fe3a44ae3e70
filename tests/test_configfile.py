"""`read_toml`: one error, naming the file, for whatever keeps a config from being read."""

from __future__ import annotations

import re

import pytest

from codedojo.configfile import read_toml


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
