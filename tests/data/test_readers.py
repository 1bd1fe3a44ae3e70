from __future__ import annotations

import json
import shutil
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codedojo.data.readers import (
    SourceConfig,
    read_dir,
    read_git,
    read_jsonl,
    read_parquet,
    read_source,
)


def test_read_dir_filters_extensions_and_binary(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.txt").write_text("notes")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("y = 2\n")
    (tmp_path / "sub" / "bin.py").write_bytes(b"\x00\x01binary")
    docs = list(read_dir(tmp_path, [".py"]))
    assert [d.meta["path"] for d in docs] == ["a.py", "sub/c.py"]
    assert docs[1].text == "y = 2\n"


def test_read_git_only_tracked_files_at_head(tmp_path):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, env=env)
    (tmp_path / "t.py").write_text("tracked = True\n")
    (tmp_path / "u.py").write_text("untracked = True\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "t.py"], check=True, env=env)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-qm", "x"], check=True, env=env)
    (tmp_path / "t.py").write_text("changed after commit\n")
    docs = list(read_git(tmp_path))
    assert [(d.meta["path"], d.text) for d in docs] == [("t.py", "tracked = True\n")]
    with pytest.raises(ValueError, match="source.path"):
        list(read_git(tmp_path / "nope"))
    # a subdirectory of a repository: its own files, not the root's of the same names
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "t.py").write_text("inner = True\n")
    (tmp_path / "src" / "v.py").write_text("v = 1\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "src"], check=True, env=env)
    subprocess.run(["git", "-C", str(tmp_path), "commit", "-qm", "y"], check=True, env=env)
    docs = list(read_git(tmp_path / "src"))
    assert [(d.meta["path"], d.text) for d in docs] == [("t.py", "inner = True\n"),
                                                         ("v.py", "v = 1\n")]



def test_read_git_reads_regular_files_of_head_not_links_or_the_index(tmp_path):
    """A tracked link's blob is its target's name, not a document; a file staged for deletion
    is still in HEAD, and a file staged but not committed is not."""
    import os

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                        *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "real.py").write_text("def f():\n    return 1\n")
    os.symlink("/etc/passwd.py", tmp_path / "link.py")
    os.symlink("real.py", tmp_path / "alias.py")
    git("add", ".")
    git("commit", "-qm", "x")
    git("rm", "-q", "--cached", "real.py")
    (tmp_path / "new.py").write_text("staged = True\n")
    git("add", "new.py")
    assert [(d.meta["path"], d.text) for d in read_git(tmp_path)] == [
        ("real.py", "def f():\n    return 1\n")]

def test_read_jsonl_and_parquet(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"content": "def f(): pass", "lang": "py"}) + "\n\n"
                 + json.dumps({"content": "int main(){}", "lang": "c"}) + "\n")
    docs = list(read_jsonl(f, "content"))
    assert [d.text for d in docs] == ["def f(): pass", "int main(){}"]
    assert docs[1].meta == {"lang": "c"}
    with pytest.raises(ValueError, match="text_field 'text'"):
        list(read_jsonl(f))
    # odd lines: named by file and line; a null text is no document, as in parquet
    odd = tmp_path / "odd.jsonl"
    for content, message in ((b'"a text"\n', r"odd.jsonl:1: a JSON object expected, got str"),
                             (b'{"text": "ok"}\n{"text": "\xff"}\n', r"odd.jsonl:2: not UTF-8")):
        odd.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            list(read_jsonl(odd))
    odd.write_bytes(b'{"text": null}\n{"text": "kept"}\n')
    assert [d.text for d in read_jsonl(odd)] == ["kept"]
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"text": ["a = 1", None, "b = 2"], "repo": ["r1", "r2", "r3"]}),
                   tmp_path / "ds" / "train-00000.parquet")
    docs = list(read_source(SourceConfig(kind="parquet", path=str(tmp_path / "ds"))))
    assert [(d.text, d.meta["repo"]) for d in docs] == [("a = 1", "r1"), ("b = 2", "r3")]
    with pytest.raises(ValueError, match="missing text_field"):
        list(read_parquet(tmp_path / "ds", "code"))


def test_stdlib_alias_reads_real_code():
    docs = list(read_source(SourceConfig(kind="dir", path="stdlib", max_files=3)))
    assert len(docs) == 3 and all(d.source.endswith(".py") for d in docs)


def test_an_alias_starts_a_path():
    docs = list(read_source(SourceConfig(kind="dir", path="stdlib/json")))
    assert docs and all(d.source.startswith("json/") for d in docs)
    assert {d.meta["path"] for d in docs} >= {"__init__.py", "decoder.py"}


def test_the_same_data_in_another_place_gets_the_same_ids_and_split(tmp_path):
    """Ids name a document from the folder a source names, so moving the data (another
    machine, another checkout) keeps every document on its side of the held-out split."""
    import shutil

    from codedojo.data.corpus import split_documents

    first = tmp_path / "a" / "corpus"
    first.mkdir(parents=True)
    for i in range(40):
        (first / f"m{i}.py").write_text(f"x = {i}\n")
    (first / "rows.jsonl").write_text('{"text": "r1"}\n{"text": "r2"}\n')
    moved = shutil.copytree(first, tmp_path / "elsewhere" / "deeper" / "corpus")
    for kind in ("dir", "jsonl"):
        ids = [[d.source for d in read_source(SourceConfig(kind=kind, path=str(root)))]
               for root in (first, moved)]
        assert ids[0] == ids[1] and len(set(ids[0])) == len(ids[0]) > 1
    assert read_source(SourceConfig(kind="dir", path=str(moved))).__next__().source == \
        "corpus/m0.py"
    (tmp_path / "link").symlink_to(first)  # named by the link, not by where it points
    assert next(read_source(SourceConfig(kind="dir", path=str(tmp_path / "link")))).source == \
        "link/m0.py"
    rows = next(read_source(SourceConfig(kind="jsonl", path=str(first / "rows.jsonl"))))
    assert rows.source == "corpus/rows.jsonl:1"  # a file source: its folder's name too
    splits = [split_documents(read_source(SourceConfig(kind="dir", path=str(root))), 0.25)
              for root in (first, moved)]
    assert [[d.source for d in part] for part in splits[0]] == \
        [[d.source for d in part] for part in splits[1]]
    assert all(splits[0])  # both sides have documents





def test_a_parquet_string_that_is_not_utf8_is_named_by_file_rows_and_column(tmp_path):
    text = pa.array([b"ok text", b"caf\xe9 latin-1"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"n": [1, 2], "text": text}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: rows 0 to 1: column 'text' holds a "
                                         "string that is not UTF-8"):
        list(read_parquet(tmp_path / "bad.parquet"))

@pytest.mark.parametrize("kind", ["dir", "git"])
def test_a_byte_order_mark_is_not_part_of_a_files_text(tmp_path, kind):
    """A source file saved with a BOM is the same text as one without (exact dedup finds the
    copies; `ast.parse` takes it); a JSONL file may start with one."""
    from codedojo.data.dedup import DedupConfig, dedup

    src = 'def add(a, b):\n    """Add two numbers."""\n    return a + b\n'
    (tmp_path / "a.py").write_bytes(b"\xef\xbb\xbf" + src.encode())
    (tmp_path / "b.py").write_text(src)
    if kind == "git":
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                        "commit", "-qm", "x"], check=True)
    docs = list(read_source(SourceConfig(kind=kind, path=str(tmp_path))))
    assert [d.text for d in docs] == [src, src]
    assert [d.meta["path"] for d in dedup(docs, DedupConfig(near=False))] == ["a.py"]
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    assert [d.text for d in read_jsonl(rows)] == ["a", "b"]

@pytest.mark.parametrize("kind", ["dir", "git"])
def test_binary_and_non_utf8_files_are_counted_as_read_and_rejected(tmp_path, kind):
    from codedojo.data.corpus import CorpusConfig, CorpusStats, clean_documents

    body = "def f(x):\n    return x + 1  # a plain python function body here\n" * 3
    (tmp_path / "ok.py").write_text(body)
    (tmp_path / "latin1.py").write_bytes(("# caf\xe9\n" + body).encode("latin-1"))
    (tmp_path / "bin.py").write_bytes(b"\x00\x01" + body.encode())
    if kind == "git":
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                        "commit", "-qm", "x"], check=True)
    stats = CorpusStats()
    docs = clean_documents(CorpusConfig(sources=[{"kind": kind, "path": str(tmp_path)}]), stats)
    assert [d.meta["path"] for d in docs] == ["ok.py"]
    assert stats.read == 3 and stats.rejected == {"binary": 1, "not_utf8": 1}

@pytest.mark.parametrize("kind", ["dir", "git"])
def test_a_file_too_long_for_the_filters_is_skipped_unread(tmp_path, monkeypatch, kind):
    """A file over 4 bytes a character of `filters.max_chars` cannot pass the filters: it is
    counted as read and rejected "too_long", as before, but never read into memory (a data
    file of gigabytes under a source tree). One at the bound is read, and judged as ever."""
    from codedojo.data import readers
    from codedojo.data.corpus import CorpusConfig, CorpusStats, clean_documents

    src = tmp_path / "src"
    src.mkdir()
    lines = [f"value_{i} = {i} * {i} + {i}\n" for i in range(40)]
    (src / "a.py").write_text("".join(lines[:20]))
    (src / "b.py").write_text("".join(lines[20:]))
    (src / "c.py").write_text("x = 'é'\n" + "#" * 2000)  # 2,009 bytes, 2,008 characters
    (src / "data.py").write_text("blob = 1\n" * 5000)  # 45,000 bytes
    if kind == "git":
        subprocess.run(["git", "init", "-q", str(src)], check=True)
        subprocess.run(["git", "-C", str(src), "add", "."], check=True)
        subprocess.run(["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t",
                        "commit", "-qm", "x"], check=True)
    opened = []
    real_read, real_run = readers._read_text, subprocess.run
    monkeypatch.setattr(readers, "_read_text",
                        lambda p, *a: opened.append(p.name) or real_read(p, *a))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: (
        opened.append(cmd[-1].rsplit("/", 1)[-1]) if "show" in cmd else None) or
        real_run(cmd, **kw))
    cfg = CorpusConfig(sources=[SourceConfig(kind=kind, path=str(src))],
                       filters={"max_chars": 503, "max_line_len": 5000,
                                "max_mean_line_len": 5000})
    stats = CorpusStats()
    docs = clean_documents(cfg, stats)
    assert sorted(opened) == ["a.py", "b.py", "c.py"]  # 2,009 bytes <= 4 x 503: read
    assert [d.meta["path"] for d in docs] == ["a.py", "b.py"]
    assert stats.read == 4 and stats.rejected == {"too_long": 2}


def test_long_documents_keep_to_their_length_and_have_ids_of_their_own():
    from codedojo.data.corpus import concat_by_dir
    from codedojo.data.readers import Document

    def file(text: str, path: str) -> Document:
        return Document(text, path, {"path": path, "source_index": 0})

    docs = [file("x" * 200, f"pkg/m{i}.py") for i in range(3)] + [file("y" * 10, "pkg/n.py")]
    out = list(concat_by_dir(docs, 30, 150))
    assert out and all(len(d.text) <= 150 for d in out)
    assert len({d.source for d in out}) == len(out) == 3


def test_data_that_is_not_what_its_reader_needs_is_named_by_file_and_line(tmp_path):
    from codedojo.data.sft import read_sft_jsonl

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "ok"}\n{"text": {"code": "x = 1"}}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: text_field 'text' must be a string"):
        list(read_jsonl(rows))
    sft = tmp_path / "sft.jsonl"
    for line, why in (("{not json", r"sft.jsonl:1: not valid JSON"),
                      ("[1]", r"sft.jsonl:1: a JSON object expected"),
                      ('{"messages": [["user", "hi"]]}', r"messages\[0\] must be an object"),
                      ('{"messages": [{"role": "assistant", "content": "a"}], "tools": "no"}',
                       r"field 'tools' must be a list of objects")):
        sft.write_text(line + "\n")
        with pytest.raises(ValueError, match=why):
            list(read_sft_jsonl(sft))
    with pytest.raises(ValueError, match="max_files"):
        SourceConfig(kind="dir", path=".", max_files=-1)
    from codedojo.data.corpus import CorpusConfig

    for cap in (0, -1):
        with pytest.raises(ValueError, match="max_train_tokens"):
            CorpusConfig(sources=[{"kind": "dir", "path": "."}], max_train_tokens=cap)


def test_a_tree_cannot_read_what_lies_outside_it(tmp_path):
    """A link in a tree (a cloned repository's) to a file elsewhere, or to /proc, whose size
    reads as 0, is not followed; nor are names that are not UTF-8 taken as ids."""
    import os
    from collections import Counter

    secret = tmp_path / "secret.txt"
    secret.write_text("AWS_SECRET=hunter2\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ok.txt").write_text("fine\n")
    (repo / "notes.txt").symlink_to(secret)
    (repo / "maps.txt").symlink_to("/proc/self/maps")
    (repo / "types.d.ts").write_text("type A = 1\n")
    open(os.path.join(os.fsencode(repo), b"caf\xe9.txt"), "w").write("latin-1 name\n")
    skipped: Counter[str] = Counter()
    docs = list(read_dir(repo, [".txt", ".d.ts"], max_bytes=1000, skipped=skipped))
    assert [d.meta["path"] for d in docs] == ["ok.txt", "types.d.ts"]
    assert skipped == {"bad_name": 1}
    with pytest.raises(ValueError, match=r"starts with a dot \('.py'\), got \['py'\]"):
        SourceConfig(kind="dir", path=".", exts=["py"])


def test_a_git_name_that_is_not_utf8_is_skipped_not_the_repository(tmp_path):
    import os
    from collections import Counter

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    open(os.path.join(os.fsencode(tmp_path), b"caf\xe9.py"), "w").write("y = 2\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "x"], check=True)
    skipped: Counter[str] = Counter()
    assert [d.meta["path"] for d in read_git(tmp_path, skipped=skipped)] == ["a.py"]
    assert skipped == {"bad_name": 1}


def test_jsonl_folders_are_read_whole_and_text_must_be_text(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rows.jsonl").write_text('{"text": "a"}\n{"text": "b\\ud800"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: text_field 'text' holds a lone "
                                         "surrogate"):
        list(read_jsonl(tmp_path))
    (tmp_path / "sub" / "rows.jsonl").write_text('{"text": "a"}\n')
    assert [d.text for d in read_jsonl(tmp_path)] == ["a"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .jsonl files under"):
        list(read_jsonl(tmp_path / "empty"))


def test_directories_of_two_sources_are_not_joined():
    from codedojo.data.corpus import concat_by_dir
    from codedojo.data.readers import Document

    docs = [Document("x" * 40, f"{repo}{sep}{p}", {"path": p, "source_index": i}) for i, (repo, sep)
            in enumerate((("repoA", "/"), ("repoB", ":"))) for p in ("setup.py", "src/x.py")]
    out = {d.source: d.text.count("# file:") for d in concat_by_dir(docs, 10, 1000)}
    assert out == {"0:repoA/#1": 1, "0:repoA/src#1": 1, "1:repoB:#1": 1, "1:repoB:src#1": 1}


def test_long_documents_join_files_of_one_folder_of_one_source_only(tmp_path):
    """Two sources whose folders share a name are two groups, and rows of a JSONL file (here
    from two repositories, with a path column as code datasets have) are never joined."""
    from codedojo.data.corpus import CorpusConfig, clean_documents, concat_by_dir

    for name in ("a", "b"):
        (tmp_path / name / "pkg").mkdir(parents=True)
        for m in ("m1", "m2"):
            (tmp_path / name / "pkg" / f"{m}.py").write_text(f"# {name} {m}\n" + "x = 1\n" * 20)
    rows = [{"text": f"# {r}\n" + "y = 2\n" * 20, "repo": r, "path": "src/main.py"}
            for r in ("alice/one", "bob/two")]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = CorpusConfig(sources=[{"kind": "dir", "path": str(tmp_path / n / "pkg")} for n in "ab"]
                       + [{"kind": "jsonl", "path": str(tmp_path / "code.jsonl")}],
                       dedup={"exact": False, "near": False})
    out = {d.source: d.text for d in concat_by_dir(clean_documents(cfg), 10, 10_000)}
    assert sorted(out) == ["0:pkg/#1", "1:pkg/#1", f"{tmp_path.name}/code.jsonl:1#1",
                           f"{tmp_path.name}/code.jsonl:2#1"]
    assert "# a m1" in out["0:pkg/#1"] and "# a m2" in out["0:pkg/#1"]
    assert "# b " not in out["0:pkg/#1"]
    assert "bob/two" not in out[f"{tmp_path.name}/code.jsonl:1#1"]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_folder_of_several_splits_reads_the_one_named(tmp_path, kind):
    """A hub snapshot's folder holds its train and test files side by side: read whole, the
    test split would be trained on. A folder with held-out files is read only for the split
    the source names (or "*"); a split is a folder, or a word of a file's name."""
    def write(rel: str, text: str) -> None:
        f = tmp_path / "ds" / f"{rel}.{kind}"
        f.parent.mkdir(parents=True, exist_ok=True)
        if kind == "jsonl":
            f.write_text(json.dumps({"text": text}) + "\n")
        else:
            pq.write_table(pa.table({"text": [text]}), f)

    write("data/train-00000-of-00002", "t0")
    write("data/train-00001-of-00002", "t1")
    write("data/test-00000-of-00001", "held out")
    write("Validation/part0", "v")
    write("extra/python_VAL_0", "v2")  # (a word of the name, in any case)
    write("extra/training_notes", "n")  # (no split's name: "training" is no "train")

    def texts(**split: str) -> list[str]:
        cfg = SourceConfig(kind=kind, path=str(tmp_path / "ds"), **split)
        return [d.text for d in read_source(cfg)]

    with pytest.raises(ValueError, match=r"holds test, val, validation split files: name"):
        texts()
    assert texts(split="train") == ["t0", "t1"]
    assert texts(split="validation") == ["v"] and texts(split="val") == ["v2"]
    assert len(texts(split="*")) == 6
    with pytest.raises(FileNotFoundError, match=r"no 'dev' .* \(splits there: test, train, "):
        texts(split="dev")
    (tmp_path / "ds" / "data" / f"test-00000-of-00001.{kind}").unlink()
    shutil.rmtree(tmp_path / "ds" / "Validation")
    (tmp_path / "ds" / "extra" / f"python_VAL_0.{kind}").unlink()
    assert texts() == ["t0", "t1", "n"]  # (train and unnamed files: nothing held out)
    write("chat/train_sft-0", "sft")
    write("chat/train_gen-0", "gen")
    assert texts(split="train_sft") == ["sft"]  # (the start of the files' names)
    one_file = SourceConfig(kind=kind, path=str(tmp_path / "ds" / "extra" /
                                                f"training_notes.{kind}"), split="train")
    with pytest.raises(ValueError, match="is one file, not a folder of splits"):
        list(read_source(one_file))
    with pytest.raises(ValueError, match="only jsonl and parquet sources have splits, not dir"):
        SourceConfig(kind="dir", path=str(tmp_path), split="train")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_folder_named_like_a_data_file_is_read_for_the_files_in_it(tmp_path, kind):
    """Spark and Dask write a dataset as a folder of part files (`code.parquet/part-0.parquet`):
    the folder is no file to open, its part files are read."""
    part = tmp_path / "corpus" / f"code.{kind}" / f"part-00000.snappy.{kind}"
    part.parent.mkdir(parents=True)
    if kind == "jsonl":
        part.write_text(json.dumps({"text": "def f(): pass"}) + "\n")
    else:
        pq.write_table(pa.table({"text": ["def f(): pass"]}), part)
    docs = list(read_source(SourceConfig(kind=kind, path=str(tmp_path / "corpus"))))
    assert [d.source for d in docs] == [f"corpus/code.{kind}/part-00000.snappy.{kind}:"
                                        f"{1 if kind == 'jsonl' else 0}"]


def test_the_stdlib_alias_reads_the_standard_library_not_the_packages_installed_in_it(
        tmp_path, monkeypatch):
    """lib/python3.X holds site-packages (or dist-packages): most of its files are third-party
    code, which the `site-packages` alias names; `stdlib` leaves them out."""
    lib = tmp_path / "lib" / "python3.11"
    for rel in ("json/__init__.py", "site-packages/rich/console.py",
                "dist-packages/numpy/core.py", "site-packages/pkg/site-packages/x.py"):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text("x = 1\n")
    (lib / "os.py").write_text("y = 2\n")
    monkeypatch.setattr("sysconfig.get_paths", lambda: {"stdlib": str(lib),
                                                        "purelib": str(lib / "site-packages")})

    def sources(path: str) -> list[str]:
        return [d.source for d in read_source(SourceConfig(kind="dir", path=path))]

    assert sources("stdlib") == ["python3.11/json/__init__.py", "python3.11/os.py"]
    assert sources("stdlib/json") == ["json/__init__.py"]
    assert sources("site-packages/rich") == ["rich/console.py"]
    assert len(sources(str(lib))) == 5  # (a folder named as it is: all of it)
