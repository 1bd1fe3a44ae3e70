"""Weighted mixtures of token sources.

Weights are token shares, not document shares (a source of long files should not win just by
having fewer, longer documents). Selection is deterministic: the next document comes from the
source furthest below its target share, and each source walks a seeded permutation of its
documents, starting a fresh permutation (a new epoch of that source) when it runs out. Small
sources are thus upsampled, large ones subsampled, and the realised shares track the weights to
within one document.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, Field, field_validator

from codedojo.data.shards import TokenShards


class MixtureSource(BaseModel):
    name: str = Field(description="Label used in reports.")
    path: str = Field(description="A shard directory written by `tokenize_to_shards`.")
    weight: float = Field(1.0, gt=0, allow_inf_nan=False,
                          description="Relative share of tokens drawn from here.")
    min_tokens: int = Field(0, ge=0, description="Skip documents shorter than this (e.g. the "
                            "long-document side of a long-context mix).")
    context_tokens: int = Field(0, ge=0, description="Leading tokens of each document that are "
                                "context only: never a trained target (the prompt of a "
                                "self-generated continuation).")
    whole: bool = Field(False, description="Its documents are packed whole: one that the rest "
                        "of a row cannot hold starts the next row (as a document with a loss "
                        "mask is). For documents whose every position must see the same "
                        "context as when they were made: a continuation and its prompt.")

    @field_validator("path")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v:
            raise ValueError("path must not be empty")
        return v


@dataclass
class MixedDoc:
    tokens: np.ndarray  # (n,) int64
    mask: np.ndarray | None  # (n,) uint8 per-token loss mask, None = train on all
    source: int
    start: int = 0  # where the document starts in its source's token stream
    whole: bool = False  # never split across rows (`MixtureSource.whole`)


def mix(sources: list[MixtureSource], total_tokens: int, seed: int = 0,
        shards: list[TokenShards] | None = None) -> Iterator[MixedDoc]:
    """Documents drawn to `total_tokens` with the sources' token shares."""
    if not sources:
        raise ValueError("mixture: at least one source is required")
    shards = shards or [TokenShards(s.path) for s in sources]
    rng = np.random.default_rng(seed)
    eligible: list[np.ndarray] = []
    for s, sh in zip(sources, shards, strict=True):
        idx = np.nonzero(sh.doc_lengths() >= s.min_tokens)[0]
        if idx.size == 0:
            raise ValueError(f"mixture source {s.name!r}: no document has >= {s.min_tokens} tokens")
        eligible.append(idx)
    w = np.array([s.weight for s in sources], dtype=np.float64)
    w /= w.sum()
    taken = np.zeros(len(sources), dtype=np.float64)
    orders = [rng.permutation(e) for e in eligible]
    cursors = [0] * len(sources)
    total = 0
    while total < total_tokens:
        # Furthest below target share; ties go to the earlier source.
        k = int(np.argmax(w * (total + 1) - taken))
        if cursors[k] >= len(orders[k]):
            orders[k] = rng.permutation(eligible[k])
            cursors[k] = 0
        i = int(orders[k][cursors[k]])
        cursors[k] += 1
        toks = shards[k].doc(i)
        taken[k] += toks.size
        total += toks.size
        mask = shards[k].mask(i)
        if sources[k].context_tokens:
            mask = np.ones(toks.size, np.uint8) if mask is None else mask.copy()
            mask[: sources[k].context_tokens] = 0
        yield MixedDoc(tokens=toks, mask=mask, source=k, start=shards[k].doc_start(i),
                       whole=sources[k].whole)
