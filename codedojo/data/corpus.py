"""A corpus recipe end to end: read sources -> filter -> dedup -> held-out split -> token shards.

The held-out split is by a hash of the document's source id, so the same file lands on the same
side on every run and on every machine, and eval loss is measured on code never trained on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from codedojo.data.dedup import DedupConfig, DedupStats, dedup
from codedojo.data.filters import FilterConfig, apply_filters
from codedojo.data.readers import Document, SourceConfig, read_source
from codedojo.data.shards import TextEncoder, tokenize_to_shards


class CorpusConfig(BaseModel):
    sources: list[SourceConfig] = Field(description="Where the documents come from.")
    filters: FilterConfig = Field(default_factory=FilterConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    holdout_frac: float = Field(0.05, ge=0.0, lt=1.0, description="Share of documents held out "
                                "for eval loss (by hash of their source id).")
    max_docs: int | None = Field(None, ge=0,
                                 description="Cap on documents after filtering and dedup.")
    max_train_tokens: int | None = Field(None, ge=1, description="Cap on training tokens "
                                         "written (None: no cap).")


def is_heldout(source: str, frac: float) -> bool:
    h = int.from_bytes(hashlib.sha1(source.encode()).digest()[:8], "big")
    return h / 2**64 < frac


@dataclass
class CorpusStats:
    read: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    dedup: DedupStats = field(default_factory=DedupStats)
    train_docs: int = 0
    eval_docs: int = 0
    # documents written without bytes the tokenizer has no token for (`tokenize_to_shards`)
    dropped_bytes_docs: int = 0


def clean_documents(cfg: CorpusConfig, stats: CorpusStats | None = None) -> list[Document]:
    stats = stats if stats is not None else CorpusStats()

    def counted() -> Iterator[Document]:
        for i, src in enumerate(cfg.sources):
            # a file of more than 4 bytes a character's limit is too long in any encoding:
            # skipped unread, and counted as read and rejected, as the filter would have
            skipped: Counter[str] = Counter()
            try:
                for d in read_source(src, 4 * cfg.filters.max_chars, skipped):
                    stats.read += 1
                    if src.kind in ("dir", "git"):  # a file, joined with its folder's others
                        d.meta["source_index"] = i  # by `concat_by_dir`
                    yield d
            finally:
                stats.read += skipped.total()
                stats.rejected.update(skipped)

    docs = dedup(apply_filters(counted(), cfg.filters, stats.rejected), cfg.dedup, stats.dedup)
    return list(itertools.islice(docs, cfg.max_docs))


def split_documents(docs: Iterable[Document], frac: float) -> tuple[list[Document], list[Document]]:
    train, held = [], []
    for d in docs:
        (held if is_heldout(d.source, frac) else train).append(d)
    return train, held


def concat_by_dir(docs: Iterable[Document], min_chars: int, max_chars: int) -> Iterator[Document]:
    """Long documents for the long-context stage: files of one directory of one source joined
    (each prefixed by its path), the way repository-level context looks to a coding model.
    A file is a document with the ``source_index`` (its source's place in the corpus config)
    that `clean_documents` records; any other document, such as a JSONL or parquet row (whose
    rows may come from many repositories), stands alone."""
    groups: dict[tuple[int, str], list[Document]] = {}
    for d in docs:
        index, path = d.meta.get("source_index"), d.meta.get("path")
        if isinstance(index, int) and isinstance(path, str) and d.source.endswith(path):
            key = d.source[:-len(path)] + posixpath.dirname(path)  # "repo/src", "repo:src"
        else:
            index, key = -1, d.source
        groups.setdefault((index, key), []).append(d)
    for index, key in sorted(groups):
        runs: list[list[str]] = [[]]
        size = 0
        for d in groups[index, key]:
            chunk = f"# file: {d.meta.get('path', d.source)}\n{d.text}\n"
            if size + len(chunk) > max_chars and size >= min_chars:
                runs.append([])
                size = 0
            runs[-1].append(chunk)
            size += len(chunk)
        if size < min_chars:
            runs.pop()
        # never over max_chars, each its own id (two sources' folders may share a name)
        name = key if index < 0 else f"{index}:{key}"
        for n, parts in enumerate(runs, start=1):
            yield Document("".join(parts)[:max_chars], f"{name}#{n}", {"path": key})


def build_corpus(cfg: CorpusConfig, tokenizer: TextEncoder, out_dir: str | Path, vocab_size: int,
                 eos_id: int | None) -> tuple[Path, Path, CorpusStats, list[Document]]:
    """Writes `out_dir/train` and `out_dir/eval` shard directories; returns the training
    documents too, for derived sets (long-document concatenations, SFT examples)."""
    stats = CorpusStats()
    train, held = split_documents(clean_documents(cfg, stats), cfg.holdout_frac)
    if not train or not held:
        raise ValueError(f"corpus: {len(train)} training / {len(held)} held-out documents; "
                         "add sources or change holdout_frac")
    stats.train_docs, stats.eval_docs = len(train), len(held)
    out = Path(out_dir)
    tr = tokenize_to_shards(train, tokenizer, out / "train", vocab_size, eos_id,
                            max_tokens=cfg.max_train_tokens)
    ev = tokenize_to_shards(held, tokenizer, out / "eval", vocab_size, eos_id)
    stats.dropped_bytes_docs = sum(json.loads((p / "index.json").read_text())
                                   .get("docs_with_dropped_bytes", 0) for p in (tr, ev))
    return tr, ev, stats, train
