"""Exact and near-duplicate removal.

Exact: a hash of the whitespace-normalised text. Near: MinHash signatures over word n-gram shingles,
banded LSH to find candidate pairs, then the signature agreement (an unbiased estimate of Jaccard
similarity) decides. The first document of each duplicate cluster is kept, so the result depends
only on input order. Hashes are crc32-based, not Python's `hash`, so they are stable across runs.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, Field, model_validator

from codedojo.data.readers import Document

_MERSENNE = (1 << 31) - 1
_WORD = re.compile(r"\w+|[^\w\s]")
RECALL = 0.9  # at least, of the pairs at the threshold that LSH proposes (`lsh_bands`)


class DedupConfig(BaseModel):
    exact: bool = Field(True, description="Drop documents whose normalised text was already seen.")
    near: bool = Field(True, description="Drop MinHash near-duplicates.")
    threshold: float = Field(0.8, ge=0.0, le=1.0, description="Jaccard similarity above which "
                             "two documents are near-duplicates.")
    num_perm: int = Field(128, ge=8, description="MinHash permutations (= bands * rows).")
    bands: int | None = Field(None, ge=1, description="LSH bands; more bands find lower "
                              "similarities. None: chosen for `threshold` (`lsh_bands`).")
    shingle: int = Field(5, ge=1, description="Word n-gram size of a shingle.")

    @model_validator(mode="after")
    def _bands_divide(self) -> DedupConfig:
        # refused as the config loads, not after the whole corpus is read
        if self.bands is not None and self.num_perm % self.bands:
            raise ValueError("dedup.num_perm must be a multiple of dedup.bands")
        return self


def normalized_hash(text: str) -> str:
    """The text's hash with trailing spaces and blank lines left out; indentation counts (two
    Python files that differ only in it are different programs)."""
    lines = (line.rstrip() for line in text.splitlines())
    return hashlib.sha1("\n".join(line for line in lines if line).encode()).hexdigest()


def shingles(text: str, n: int) -> np.ndarray:
    """Distinct crc32 hashes of word n-grams (uint64 to leave room for the permutation math)."""
    words = _WORD.findall(text)
    if len(words) < n:
        grams = [" ".join(words)]
    else:
        grams = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    return np.unique(np.fromiter((zlib.crc32(g.encode()) for g in grams), dtype=np.uint64))


class MinHasher:
    """h_i(x) = (a_i * x + b_i) mod p with p = 2^31 - 1; x < 2^32 and a_i < 2^31 keep the product
    inside uint64."""

    def __init__(self, num_perm: int = 128, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _MERSENNE, size=num_perm, dtype=np.uint64)
        self.b = rng.integers(0, _MERSENNE, size=num_perm, dtype=np.uint64)

    def signature(self, sh: np.ndarray) -> np.ndarray:
        # (S, 1) * (P,) -> (S, P); min over shingles
        h = (sh[:, None] * self.a[None, :] + self.b[None, :]) % _MERSENNE
        return h.min(axis=0).astype(np.uint32)


def jaccard(a: str, b: str, n: int = 5) -> float:
    """Exact Jaccard similarity of two texts' shingle sets (the slow reference for MinHash)."""
    sa, sb = set(shingles(a, n).tolist()), set(shingles(b, n).tolist())
    return len(sa & sb) / max(1, len(sa | sb))


@dataclass
class DedupStats:
    seen: int = 0
    exact_dupes: int = 0
    near_dupes: int = 0


def lsh_bands(threshold: float, num_perm: int) -> int:
    """The bands of ``num_perm`` = bands x rows for near-duplicates at ``threshold``: LSH
    proposes a pair of similarity s with probability 1 - (1 - s^rows)^bands; the most rows
    (the fewest pairs proposed below the threshold) that still propose one at it with
    probability `RECALL`. (Fixed bands propose little below their own threshold: 16 x 8
    proposes a pair at 0.5 with probability 0.06.) A low threshold costs comparisons: at 0.5
    (64 x 2) a pair at 0.1 is proposed with probability 0.47, so near dedup of many similar
    texts grows toward all pairs."""
    splits = [b for b in range(1, num_perm + 1) if num_perm % b == 0]  # bands, rows falling
    return next((b for b in splits
                 if 1 - (1 - threshold ** (num_perm // b)) ** b >= RECALL), num_perm)


def kept_originals(texts: list[str], cfg: DedupConfig) -> list[int]:
    """For each text, the index of the earlier kept text it nearly duplicates, or itself when
    it is kept: a text goes only for one at or above the threshold that stays. (Clustering
    every similar pair would chain: in a series of edits A, B, C, D, E each near the next, E
    went with A though unlike it.) LSH proposes the kept texts to compare; the signatures'
    agreement decides."""
    bands = cfg.bands or lsh_bands(cfg.threshold, cfg.num_perm)
    rows = cfg.num_perm // bands
    hasher = MinHasher(cfg.num_perm)
    sigs = np.stack([hasher.signature(shingles(t, cfg.shingle)) for t in texts]) if texts else \
        np.zeros((0, cfg.num_perm), np.uint32)
    buckets: list[dict[bytes, list[int]]] = [defaultdict(list) for _ in range(bands)]
    out: list[int] = []
    for i in range(len(texts)):
        keys = [sigs[i, b * rows:(b + 1) * rows].tobytes() for b in range(bands)]
        proposed = sorted({k for b, key in enumerate(keys) for k in buckets[b].get(key, ())})
        like = next((k for k in proposed if float((sigs[i] == sigs[k]).mean()) >= cfg.threshold),
                    None)
        out.append(i if like is None else like)
        if like is None:  # kept: a text later ones are compared with
            for b, key in enumerate(keys):
                buckets[b][key].append(i)
    return out


def dedup(docs: Iterable[Document], cfg: DedupConfig | None = None,
          stats: DedupStats | None = None) -> Iterator[Document]:
    """Exact dedup streams; near dedup needs all signatures, so it materialises the documents."""
    cfg = cfg or DedupConfig()
    stats = stats if stats is not None else DedupStats()
    seen: set[str] = set()
    kept: list[Document] = []
    for d in docs:
        stats.seen += 1
        if cfg.exact:
            h = normalized_hash(d.text)
            if h in seen:
                stats.exact_dupes += 1
                continue
            seen.add(h)
        kept.append(d)
    if not cfg.near:
        yield from kept
        return
    original = kept_originals([d.text for d in kept], cfg)
    for i, d in enumerate(kept):
        if original[i] == i:
            yield d
        else:
            stats.near_dupes += 1
