"""codebase_search with the real embedding model (served on the host, files read from the sandbox)."""

from __future__ import annotations

import hashlib
import re
import time

import numpy as np
import pytest

from codedojo.harness import embeddings
from codedojo.harness.embeddings import CodebaseIndex, chunk_file
from codedojo.harness.tools.base import ToolContext
from codedojo.harness.toolset import EnvToolConfig, ToolRegistry, ToolSession


def test_chunking_follows_definitions():
    text = "import os\n\n" + "".join(f"def f{i}():\n" + "    x = 1\n" * 9 + "\n" for i in range(3))
    chunks = chunk_file("/workspace/m.py", text)
    assert [c.text.splitlines()[0] for c in chunks] == ["import os", "def f1():", "def f2():"]
    assert chunks[0].start_line == 1 and chunks[-1].end_line == len(text.splitlines()) - 1  # blank line dropped
    assert all(c.key for c in chunks) and len({c.key for c in chunks}) == len(chunks)


@pytest.mark.slow
def test_codebase_search_finds_code_by_meaning_and_caches_by_content(sandbox, tmp_path):
    index = CodebaseIndex()
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig()), ToolContext(sandbox=sandbox, search=index))
    try:
        r = s.call("codebase_search", {"query": "which items are running low on quantity"})
        assert not r.is_error, r.content
        assert r.content.startswith("/workspace/inventory/stock.py:17-19 (score ")
        assert "def low_stock(items, threshold):" in r.content.splitlines()[1]
        cached = index.cached
        assert cached > 0
        # Unchanged files are not embedded again; an edit embeds only the changed chunk.
        s.call("codebase_search", {"query": "add stock to an item"})
        assert index.cached == cached
        s.call("write", {"file_path": "inventory/report.py",
                         "contents": "def print_report(items):\n    for i in items:\n        print(i.name, i.qty)\n"})
        r = s.call("codebase_search", {"query": "print a report of items", "target_directories": ["inventory"]})
        assert r.content.startswith("/workspace/inventory/report.py:1-3")
        assert index.cached == cached + 1
        for dirs in (["no_such_dir"], ["inventory", "no_such_dir"]):  # not "No results."
            r = s.call("codebase_search", {"query": "stock", "target_directories": dirs})
            assert r.is_error and r.content == "Error: path not found: /workspace/no_such_dir"
        hits = index.search(sandbox, "tests", ["/workspace/tests"])
        assert hits and all(h.path.startswith("/workspace/tests/") for h in hits)
        # The vector cache survives a restart of the service.
        index.save(tmp_path / "vectors.npz")
        fresh = CodebaseIndex(index.embedder)
        fresh.load(tmp_path / "vectors.npz")
        assert fresh.cached == index.cached
        assert [h.path for h in fresh.search(sandbox, "print a report")] == [h.path for h in index.search(sandbox, "print a report")]
    finally:
        s.close()


def test_codebase_search_not_configured_is_an_error_result(session):
    r = session.call("codebase_search", {"query": "anything"})
    assert r.is_error and "not available" in r.content


class SlowEmbedder:
    """Vectors from a hash of the text, a fifth of a second per call."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, texts):
        self.calls += 1
        time.sleep(0.2)
        rows = [np.frombuffer(hashlib.sha256(t.encode()).digest(), np.uint8) for t in texts]
        v = np.asarray(rows, np.float32).reshape(len(texts), -1) - 127.5
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_codebase_search_stops_at_its_time_limit_and_goes_on_from_there(sandbox, monkeypatch):
    monkeypatch.setattr(embeddings, "EMBED_BATCH", 2)
    index = CodebaseIndex(SlowEmbedder())
    total = len(index.chunks(sandbox, ["/workspace"]))
    assert total > 6
    cfg = EnvToolConfig(timeouts={"codebase_search": 0.3})
    s = ToolSession(ToolRegistry().resolve(cfg), ToolContext(sandbox=sandbox, search=index))
    try:
        r = s.call("codebase_search", {"query": "low stock"})
        m = re.search(r"timed out after 0.3s with (\d+) of (\d+) chunks indexed", r.content)
        assert r.is_error and m, r.content
        assert 0 < int(m[1]) < int(m[2]) == total
        assert index.cached == int(m[1])  # the vectors made are kept
        while (r := s.call("codebase_search", {"query": "low stock"})).is_error:
            assert "call it again" in r.content
        assert index.cached == total and r.content.count("(score ") == min(8, total)
    finally:
        s.close()


def test_the_vector_cache_keeps_the_most_recently_used(sandbox):
    """A job over many repositories keeps at most ``max_cached`` vectors, dropping the least
    recently used; a search over more chunks than that still ranks them all."""
    embedder = SlowEmbedder()
    index = CodebaseIndex(embedder, max_cached=3)
    total = len(index.chunks(sandbox, ["/workspace"]))
    assert total > 3
    hits = index.search(sandbox, "low stock", k=total)
    assert len(hits) == total and index.cached == 3
    warm = CodebaseIndex(embedder, max_cached=total)
    assert [h.path for h in warm.search(sandbox, "low stock", k=total)] == [h.path for h in hits]


def test_chunk_line_numbers_are_grep_s():
    text = "import os\nimport re\n\x0c\n\nX = 1\n" + "".join(
        f"def f{i}():\n" + "    x = 1\n" * 9 for i in range(2))
    chunks = chunk_file("/workspace/m.py", text)
    assert [(c.start_line, c.text.split("\n")[0]) for c in chunks] == [
        (1, "import os"), (6, "def f0():"), (16, "def f1():")]


def test_past_the_file_limit_code_is_indexed_before_prose_and_data(sandbox, monkeypatch):
    sandbox.exec("mkdir -p a_fixtures && for i in 1 2 3; do echo '{}' > a_fixtures/$i.json; done")
    monkeypatch.setattr(embeddings, "MAX_FILES", 3)
    files, left_out = CodebaseIndex(SlowEmbedder())._files(sandbox, ["/workspace"], None)
    assert files == ["/workspace/inventory/__init__.py", "/workspace/inventory/stock.py",
                     "/workspace/tests/test_stock.py"]
    assert left_out == 5  # README.md, pyproject.toml and the three .json


def test_a_missing_target_directory_is_named_by_the_search_itself(sandbox, monkeypatch):
    """No sandbox round trip per root before the search: the listing meets a missing root."""
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig()),
                    ToolContext(sandbox=sandbox, search=CodebaseIndex(SlowEmbedder())))
    stats = []
    monkeypatch.setattr(sandbox, "stat", lambda p: stats.append(p))
    try:
        r = s.call("codebase_search", {"query": "stock", "target_directories": ["inventory"]})
        assert not r.is_error and r.content.startswith("/workspace/inventory/"), r.content
        for dirs in (["no_such_dir"], ["inventory", "no_such_dir"]):
            r = s.call("codebase_search", {"query": "stock", "target_directories": dirs})
            assert r.is_error and r.content == "Error: path not found: /workspace/no_such_dir"
        for dirs in (["README.md/x"], ["inventory", "README.md/x"]):  # (no directory on the way)
            r = s.call("codebase_search", {"query": "stock", "target_directories": dirs})
            assert r.is_error and r.content == "Error: path not found: /workspace/README.md/x"
        assert stats == []
    finally:
        s.close()


def test_a_search_past_the_file_limit_says_how_many_files_it_left_out(sandbox, monkeypatch):
    monkeypatch.setattr(embeddings, "MAX_FILES", 2)
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig()),
                    ToolContext(sandbox=sandbox, search=CodebaseIndex(SlowEmbedder())))
    try:
        r = s.call("codebase_search", {"query": "stock"})
        assert not r.is_error, r.content
        # (5 files: the 3 .py, README.md, pyproject.toml)
        assert r.content.endswith(
            "\n\n[only part of the code was searched: 3 files were left out past the index's "
            "limit of 2 files; pass target_directories to search the rest]")
        r = s.call("codebase_search", {"query": "stock", "target_directories": ["inventory"]})
        assert "only part" not in r.content
    finally:
        s.close()


def test_the_index_leaves_out_what_gitignore_does(sandbox):
    sandbox.write_file("/workspace/.gitignore", b"*.json\nsecret_*.py\n")
    sandbox.write_file("/workspace/inventory/secret_keys.py", b"KEY = 1\n")
    sandbox.write_file("/workspace/inventory/cache.json", b"{}\n")
    chunks = CodebaseIndex(SlowEmbedder()).chunks(sandbox, ["/workspace"])
    assert sorted({c.path for c in chunks}) == [
        "/workspace/README.md", "/workspace/inventory/__init__.py",
        "/workspace/inventory/stock.py", "/workspace/pyproject.toml",
        "/workspace/tests/test_stock.py"]


def test_overlapping_target_directories_find_each_hit_once(sandbox):
    """A directory named twice, or inside another named, is searched once."""
    assert embeddings.outermost(["/w/a", "/w/a/", "/w/ab", "/w", "/w/a/b.py", "/x"]) == [
        "/w", "/x"]
    assert embeddings.outermost(["/w/ab", "/w/a"]) == ["/w/ab", "/w/a"]
    s = ToolSession(ToolRegistry().resolve(EnvToolConfig()),
                    ToolContext(sandbox=sandbox, search=CodebaseIndex(SlowEmbedder())))
    try:
        r = s.call("codebase_search", {"query": "stock", "target_directories": [
            "inventory", "inventory/", "/workspace", "inventory/stock.py"]})
        heads = re.findall(r"^(/workspace/\S+:\d+-\d+) \(score ", r.content, re.M)
        assert not r.is_error and heads and len(heads) == len(set(heads)), r.content
    finally:
        s.close()
