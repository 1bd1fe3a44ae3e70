"""Corpus readers: every source becomes a stream of `Document`s.

Four kinds of source, one function each, all lazy (a generator) so a large corpus is never held in
memory: a directory of source files, a git repository (only tracked files, at HEAD), JSONL files
and parquet / Hugging Face dataset folders read locally through pyarrow. `read_source` dispatches on
a `SourceConfig`, which is what TOML configs name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

DEFAULT_CODE_EXTS = (".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".rs", ".go", ".js", ".ts", ".java",
                     ".sh", ".toml", ".md", ".rst", ".txt", ".cfg", ".json", ".yaml", ".yml")


@dataclass
class Document:
    """One unit of training text. `source` is a stable id used for dedup reports and held-out
    splits: a path or row key relative to the folder the source names (its name included), so
    the same data gives the same ids, and the same split, wherever it lies on a machine."""

    text: str
    source: str
    meta: dict[str, object] = field(default_factory=dict)


class SourceConfig(BaseModel):
    """Where a corpus comes from."""

    kind: Literal["dir", "git", "jsonl", "parquet"] = Field(
        description="dir: a directory tree of files; git: tracked files of a repository; "
        "jsonl: one JSON object per line; parquet: a .parquet file or a folder of them "
        "(a locally saved HF dataset)."
    )
    path: str = Field(description="File or folder. `stdlib` and `site-packages` are aliases for "
                      "this interpreter's standard library and installed packages, also as the "
                      "start of a path (`site-packages/rich`). `stdlib` is the library's own "
                      "modules only: the site-packages or dist-packages folder inside its folder "
                      "is not read (dir sources).")
    exts: list[str] = Field(default_factory=lambda: [".py"],
                            description="File name endings kept by dir/git readers, each with "
                            "its dot (`.py`, `.d.ts`).")
    text_field: str = Field("text", description="Column/key holding the text (jsonl/parquet).")
    exclude: list[str] = Field(default_factory=list,
                               description="Path substrings to skip (dir/git readers).")
    split: str | None = Field(None, min_length=1,
                              description="jsonl/parquet folders: read only this split's files "
                              "(`train` for `data/train-00000-of-00002.parquet`, `train.jsonl` "
                              "or `train/`; `train_sft` for `train_sft-0.parquet`; `*`: every "
                              "file). Required where a folder holds test, validation, dev or "
                              "eval files.")
    max_files: int | None = Field(None, ge=0, description="Stop after this many documents.")

    @model_validator(mode="after")
    def _split_of_files(self) -> SourceConfig:
        if self.split is not None and self.kind not in ("jsonl", "parquet"):
            raise ValueError(f"split: only jsonl and parquet sources have splits, not {self.kind}")
        return self

    @field_validator("exts")
    @classmethod
    def _dotted(cls, exts: list[str]) -> list[str]:
        bad = [e for e in exts if not e.startswith(".") or len(e) < 2]
        if bad:
            raise ValueError(f"each extension starts with a dot ('.py'), got {bad}")
        return exts


# folders inside the standard library's folder that hold installed packages, not the library
_INSTALLED = frozenset({"site-packages", "dist-packages"})


def resolve_path(path: str) -> Path:
    """Expand the `stdlib` / `site-packages` aliases (alone or as a path's first part): the real
    code corpora on any machine. `stdlib`'s folder holds site-packages too: `read_source` skips
    it (`_dirs_not_read`)."""
    import sysconfig

    head, _, rest = path.partition("/")
    alias = {"stdlib": "stdlib", "site-packages": "purelib"}.get(head)
    if alias is not None:
        return Path(sysconfig.get_paths()[alias]) / rest
    return Path(path).expanduser()


def _dirs_not_read(path: str) -> frozenset[str]:
    """Names of the folders whose trees a dir source of ``path`` does not read: for the `stdlib`
    alias, the installed packages' folders within it (`_INSTALLED`), so that it reads the
    standard library alone."""
    return _INSTALLED if path.partition("/")[0] == "stdlib" else frozenset()


def _read_text(p: Path, max_bytes: int | None = None,
               skipped: Counter[str] | None = None) -> str | None:
    """A text file's text: None for a binary file, one that is not UTF-8, or one past
    ``max_bytes`` as read (a size the file system reports may be 0, as /proc's are)."""
    try:
        with p.open("rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except OSError:
        return None
    if _too_long(len(data), max_bytes, skipped):
        return None
    return _text(data, skipped)


def _text(data: bytes, skipped: Counter[str] | None) -> str | None:
    """A file's bytes as text, without a byte order mark (a copy saved with one is the same
    text), or None for a binary file (``skipped["binary"]``) or one that is not UTF-8
    (``skipped["not_utf8"]``)."""
    why = "binary" if b"\x00" in data[:4096] else None
    if why is None:
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError:
            why = "not_utf8"
    if skipped is not None:
        skipped[why] += 1
    return None


def _named(path: Path) -> str:
    """The name of the folder or file a source names, as written (a link is not followed:
    its target's name may differ from machine to machine)."""
    return Path(os.path.abspath(path)).name


def _key(f: Path, asked: Path) -> str:
    """A data file's name from the path a source names: that folder's name and the file's
    place in it, or the file's folder and name."""
    if asked.is_dir():
        return f"{_named(asked)}/{f.relative_to(asked)}"
    return f"{_named(f.parent)}/{f.name}"


def read_dir(root: str | Path, exts: tuple[str, ...] | list[str] = (".py",),
             exclude: list[str] | None = None, max_bytes: int | None = None,
             skipped: Counter[str] | None = None,
             skip_dirs: frozenset[str] = frozenset()) -> Iterator[Document]:
    """Regular files under `root` whose names end with one of `exts`, in sorted order so runs
    are reproducible, but for those in a folder named in ``skip_dirs`` (below `root`). A link
    is not followed (a tree's link may point anywhere on the machine); a name that is not UTF-8
    is skipped (``skipped["bad_name"]``), a file over ``max_bytes`` (``skipped["too_long"]``),
    and a binary file or one not UTF-8 (`_text`)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"source.path: {root} is not a directory")
    wanted = tuple(exts)
    exclude = exclude or []
    for p in sorted(root.rglob("*")):
        if not p.name.endswith(wanted) or p.is_symlink() or not p.is_file():
            continue
        rel = str(p.relative_to(root))
        if any(x in rel for x in exclude) or "__pycache__" in rel:
            continue
        if not skip_dirs.isdisjoint(p.relative_to(root).parts[:-1]):
            continue
        if not _utf8(rel, skipped):
            continue
        if _too_long(p.stat().st_size, max_bytes, skipped):
            continue
        text = _read_text(p, max_bytes, skipped)
        if text is not None:
            yield Document(text=text, source=f"{_named(root)}/{rel}", meta={"path": rel})


def read_git(repo: str | Path, exts: tuple[str, ...] | list[str] = (".py",),
             exclude: list[str] | None = None, max_bytes: int | None = None,
             skipped: Counter[str] | None = None) -> Iterator[Document]:
    """Tracked files of a git repository as of HEAD (untracked and ignored files are skipped:
    build outputs and vendored junk usually live there), regular files only (a tracked link's
    blob is its target's name, not text). Files are skipped, and counted in ``skipped``, as
    `read_dir` skips them; one over ``max_bytes`` unread."""
    repo = Path(repo)
    try:
        # HEAD's tree, not the index: a file staged for deletion is still in HEAD, a staged new
        # one is not; from a subdirectory, its files only, named relative to it
        out = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "-z", "-l", "HEAD"],
                             check=True, capture_output=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        raise ValueError(f"source.path: {repo} is not a git repository with a commit") from e
    wanted = tuple(exts)
    exclude = exclude or []
    sizes: dict[str, int] = {}
    for entry in filter(None, out.split(b"\0")):  # "<mode> <type> <object> <size>\t<name>"
        info, _, name = entry.partition(b"\t")
        mode, _, _, size = info.split()
        if mode in (b"100644", b"100755"):  # not a link (120000) or a submodule (160000)
            sizes[name.decode("utf-8", "surrogateescape")] = int(size)
    files = [x for x in sorted(sizes) if x.endswith(wanted) and not any(e in x for e in exclude)
             and _utf8(x, skipped)]
    for rel in files:
        if _too_long(sizes[rel], max_bytes, skipped):
            continue
        # "./": relative to the directory asked for (a repository's subdirectory), as ls-tree
        # lists them, not to the repository's root
        blob = subprocess.run(["git", "-C", str(repo), "show", f"HEAD:./{rel}"],
                              capture_output=True)
        text = _text(blob.stdout, skipped) if blob.returncode == 0 else None
        if text is None:
            continue
        yield Document(text=text, source=f"{_named(repo)}:{rel}",
                       meta={"path": rel, "repo": str(repo)})


def _utf8(name: str, skipped: Counter[str] | None) -> bool:
    """Whether a file name (decoded with surrogateescape) is UTF-8: a document's id is."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        if skipped is not None:
            skipped["bad_name"] += 1
        return False
    return True


def _too_long(size: int, max_bytes: int | None, skipped: Counter[str] | None) -> bool:
    if max_bytes is None or size <= max_bytes:
        return False
    if skipped is not None:
        skipped["too_long"] += 1
    return True


# How a dataset's files name their split: a folder (`test/`), or a word of a file's name
# (`train.jsonl`, `test-00000-of-00001.parquet`, `python_valid_0.jsonl`), in any case.
_SPLITS = ("train", "test", "validation", "valid", "val", "dev", "eval")
_HELD_OUT = frozenset(_SPLITS) - {"train"}
_WORD = re.compile(r"[^-_.]+")


def _split_of(rel: Path) -> str | None:
    for part in rel.parts[:-1]:
        if part.lower() in _SPLITS:
            return part.lower()
    named = {w.lower() for w in _WORD.findall(rel.name.rsplit(".", 1)[0])} & set(_SPLITS)
    return named.pop() if len(named) == 1 else None


def data_files(path: Path, ext: str, split: str | None = None) -> list[Path]:
    """The ``ext`` files a jsonl/parquet source reads: ``path`` itself, or those under the
    folder of ``split``: a split's name (`_split_of`), or the start of file names
    (``train_sft`` for `train_sft-0.parquet`), or "*" for every file. A folder with a held-out
    split's files (test, validation, dev, eval) is refused without ``split``: read whole, they
    would be trained on."""
    if not path.is_dir():
        if split is not None:
            raise ValueError(f"source.split: {path} is one file, not a folder of splits")
        return [path]
    # files only: a folder may be named like one (Spark's `code.parquet/`), and the files in it
    # are matched themselves
    files = sorted(f for f in path.rglob(f"*{ext}") if f.is_file())
    if not files:
        raise FileNotFoundError(f"source.path: no {ext} files under {path}")
    if split == "*":
        return files
    splits = {f: _split_of(f.relative_to(path)) for f in files}
    named = sorted({s for s in splits.values() if s is not None})
    if split is None:
        if held := [s for s in named if s in _HELD_OUT]:
            raise ValueError(f"source.path: {path} holds {', '.join(held)} split files: name "
                             "the split to read with source.split (\"*\" reads every file)")
        return files
    chosen = [f for f in files if splits[f] == split.lower() or f.name.startswith(split)
              and f.name[len(split):][:1] in ("-", "_", ".")]
    if not chosen:
        raise FileNotFoundError(f"source.split: no {split!r} {ext} files under {path} (splits "
                                f"there: {', '.join(named) or 'none named'})")
    return chosen


def read_jsonl(path: str | Path, text_field: str = "text",
               split: str | None = None) -> Iterator[Document]:
    """One document per line of a file, or of each .jsonl file under a folder (of ``split``:
    `data_files`); other keys are kept as metadata."""
    path = Path(path)
    for f in data_files(path, ".jsonl", split):
        key = _key(f, path)
        for line, where, row in json_objects(f):
            if text_field not in row:
                raise ValueError(f"{where}: missing text_field {text_field!r}")
            text = row.pop(text_field)
            if text is None:  # as the parquet reader does: no text, no document
                continue
            if not isinstance(text, str):
                raise ValueError(f"{where}: text_field {text_field!r} must be a string, "
                                 f"got {type(text).__name__}")
            if not _utf8(text, None):
                raise ValueError(f"{where}: text_field {text_field!r} holds a lone "
                                 "surrogate (an escape such as \\ud800): not text")
            yield Document(text=text, source=f"{key}:{line}", meta=row)


def json_objects(f: Path) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, "file:line", object) for each line of a JSONL file but blank ones; a line
    that is not UTF-8, not JSON or no object is a ValueError naming it. A byte order mark may
    open the file."""
    with f.open("rb") as fh:
        for i, raw in enumerate(fh):
            where = f"{f}:{i + 1}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8-sig" if i == 0 else "utf-8"))
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a JSON object expected, got {type(row).__name__}")
            yield i + 1, where, row


def read_parquet(path: str | Path, text_field: str = "text",
                 split: str | None = None) -> Iterator[Document]:
    """A parquet file, or a folder of them (of ``split``: `data_files`; how hub snapshots
    store data), read batch by batch through pyarrow."""
    import pyarrow.parquet as pq

    path = Path(path)
    for f in data_files(path, ".parquet", split):
        key = _key(f, path)
        pf = pq.ParquetFile(f)
        if text_field not in pf.schema_arrow.names:
            raise ValueError(f"{f}: missing text_field {text_field!r} "
                             f"(columns: {pf.schema_arrow.names})")
        n = 0
        for batch in pf.iter_batches(batch_size=1024):
            cols: dict[str, list[object]] = {}
            for name, col in zip(batch.schema.names, batch.columns, strict=True):
                try:
                    cols[name] = col.to_pylist()
                except UnicodeDecodeError:  # (a writer need not check a string column)
                    raise ValueError(f"{f}: rows {n} to {n + batch.num_rows - 1}: column "
                                     f"{name!r} holds a string that is not UTF-8") from None
            texts = cols.pop(text_field)
            for j, text in enumerate(texts):
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise ValueError(f"{f}: row {n + j}: text_field {text_field!r} must be a "
                                     f"string, got {type(text).__name__}")
                meta = {k: v[j] for k, v in cols.items()}
                yield Document(text=text, source=f"{key}:{n + j}", meta=meta)
            n += len(texts)


def read_source(cfg: SourceConfig, max_bytes: int | None = None,
                skipped: Counter[str] | None = None) -> Iterator[Document]:
    """The source's documents; files over ``max_bytes`` are skipped unread (dir and git)."""
    path = resolve_path(cfg.path)
    if cfg.kind == "dir":
        it = read_dir(path, cfg.exts, cfg.exclude, max_bytes, skipped, _dirs_not_read(cfg.path))
    elif cfg.kind == "git":
        it = read_git(path, cfg.exts, cfg.exclude, max_bytes, skipped)
    elif cfg.kind == "jsonl":
        it = read_jsonl(path, cfg.text_field, cfg.split)
    else:
        it = read_parquet(path, cfg.text_field, cfg.split)
    for i, doc in enumerate(it):
        if cfg.max_files is not None and i >= cfg.max_files:
            return
        yield doc
