"""Tokenization into sharded token files.

Layout of a shard directory::

    index.json            {"dtype": "uint16", "eos_id": 0, "shards": [{"file", "docs", "tokens"}],
                           "docs_with_dropped_bytes": 0}
    shard_00000.bin       raw token ids, documents back to back (numpy memmap)
    shard_00000.idx.npy   int64 offsets, docs + 1 entries: document i is bin[off[i]:off[i+1]]
    shard_00000.mask.npy  optional uint8 per-token loss mask (SFT), same length as the .bin

Document boundaries are kept exactly, so packing can restart positions and block attention at
them. The tokenizer is anything with `encode(text) -> list[int]`; the data package does not care
which one. One that also has `dropped_bytes(text)` (the bytes of the text no token stands for,
which `encode` drops: `codedojo.model.tokenizer`) has the documents that lost some counted in
index.json (`docs_with_dropped_bytes`), since their ids no longer spell their text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from codedojo.data.readers import Document
from codedojo.paths import write_atomic, write_synced


class TextEncoder(Protocol):
    def encode(self, text: str, special: bool = True) -> list[int]: ...


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


class ShardWriter:
    """Appends documents (token arrays, optionally with loss masks) and rolls to a new shard file
    every `shard_tokens` tokens. `close()` writes index.json last, so a half-written directory is
    never mistaken for a finished one."""

    def __init__(self, out_dir: str | Path, vocab_size: int, eos_id: int | None,
                 shard_tokens: int = 1 << 24):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # an earlier directory's index goes first: a writer that dies before close() leaves
        # no index, never an old one over new shards
        (self.dir / "index.json").unlink(missing_ok=True)
        self.dtype = _dtype_for(vocab_size)
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, object]] = []
        self._buf: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._has_mask = False
        self._n = 0
        # more figures for index.json (`tokenize_to_shards`'s count of documents that lost bytes)
        self.notes: dict[str, int] = {}

    def add(self, ids: np.ndarray | list[int], mask: np.ndarray | list[int] | None = None) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            return
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        if mask is not None:
            m = np.asarray(mask, dtype=np.uint8)
            if m.shape != arr.shape:
                raise ValueError("mask must have one entry per token")
            self._has_mask = True
        else:
            m = np.ones_like(arr, dtype=np.uint8)
        self._buf.append(arr.astype(self.dtype))
        self._mask.append(m)
        self._n += arr.size
        if self._n >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        name = f"shard_{len(self.shards):05d}"
        data = np.concatenate(self._buf)
        write_synced(self.dir / f"{name}.bin", data.tofile)
        offsets = np.zeros(len(self._buf) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([b.size for b in self._buf])
        write_synced(self.dir / f"{name}.idx.npy", lambda f: np.save(f, offsets))
        if self._has_mask:
            mask = np.concatenate(self._mask)
            write_synced(self.dir / f"{name}.mask.npy", lambda f: np.save(f, mask))
        self.shards.append({"file": f"{name}.bin", "docs": len(self._buf), "tokens": int(data.size),
                            "mask": self._has_mask})
        self._buf, self._mask, self._n = [], [], 0

    def close(self) -> Path:
        self._flush()
        index = {"dtype": self.dtype.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                 "shards": self.shards, **self.notes}
        write_atomic(self.dir / "index.json", json.dumps(index, indent=1))
        return self.dir


def document_ids(tokenizer: TextEncoder, text: str, eos_id: int | None) -> list[int]:
    """A document's ids as a corpus holds them: its text all text (one that spells a control
    token does not get that token), then EOS."""
    return tokenizer.encode(text, special=False) + ([] if eos_id is None else [eos_id])


def tokenize_to_shards(docs: Iterable[Document], tokenizer: TextEncoder, out_dir: str | Path,
                       vocab_size: int, eos_id: int | None, shard_tokens: int = 1 << 24,
                       max_tokens: int | None = None) -> Path:
    """Encode each document, append EOS (so the model learns where files end), write shards.
    A document's text is all text: one that spells a control token (`<|im_end|>` in a file
    about chat templates) does not put that token, the end of a turn, inside the document.
    Documents that lose bytes the tokenizer has no token for are written as encoded, and
    counted in index.json's ``docs_with_dropped_bytes`` (when the tokenizer can say which)."""
    w = ShardWriter(out_dir, vocab_size, eos_id, shard_tokens)
    dropped = getattr(tokenizer, "dropped_bytes", None)
    if dropped is not None:
        w.notes["docs_with_dropped_bytes"] = 0
    total = 0
    for d in docs:
        ids = document_ids(tokenizer, d.text, eos_id)
        if dropped is not None and dropped(d.text):
            w.notes["docs_with_dropped_bytes"] += 1
        w.add(ids)
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return w.close()


class TokenShards:
    """Read side: random access to documents across shards, memory-mapped."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        index_file = self.dir / "index.json"
        if not index_file.exists():
            raise FileNotFoundError(f"{self.dir}: no index.json (not a finished shard directory)")
        self.index = json.loads(index_file.read_text())
        self.eos_id: int | None = self.index.get("eos_id")
        dtype = np.dtype(self.index["dtype"])
        self._data: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        self._masks: list[np.ndarray | None] = []
        for s in self.index["shards"]:
            stem = str(s["file"])[: -len(".bin")]
            self._data.append(np.memmap(self.dir / s["file"], dtype=dtype, mode="r"))
            self._offsets.append(np.load(self.dir / f"{stem}.idx.npy"))
            # the index says whether a shard has a mask (a file left by an earlier write is not)
            self._masks.append(np.load(self.dir / f"{stem}.mask.npy", mmap_mode="r")
                               if s.get("mask") else None)
            self._check(s, self._data[-1], self._offsets[-1], self._masks[-1])
        counts = [len(o) - 1 for o in self._offsets]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # each shard's first token in the directory's token stream (shards back to back)
        self._token_starts = np.concatenate(
            [[0], np.cumsum([int(o[-1]) for o in self._offsets])]).astype(np.int64)

    def _check(self, shard: dict, data: np.ndarray, offsets: np.ndarray,
               mask: np.ndarray | None) -> None:
        """A shard's files hold what the index says (a file cut short, or written over, is
        refused here rather than read as shorter documents)."""
        tokens, docs = int(shard["tokens"]), int(shard["docs"])
        found = {"tokens": len(data), "documents": len(offsets) - 1,
                 "last offset": int(offsets[-1]) if len(offsets) else -1,
                 "mask entries": tokens if mask is None else len(mask)}
        wanted = {"tokens": tokens, "documents": docs, "last offset": tokens,
                  "mask entries": tokens}
        bad = [f"{k} {found[k]} (the index says {wanted[k]})" for k in found
               if found[k] != wanted[k]]
        if bad or (len(offsets) and (offsets[0] != 0 or np.any(np.diff(offsets) < 0))):
            raise ValueError(f"{self.dir / str(shard['file'])}: does not match index.json: "
                             + ("; ".join(bad) or "offsets out of order"))

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_tokens(self) -> int:
        return int(sum(int(o[-1]) for o in self._offsets))

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        return s, i - int(self._starts[s])

    def doc(self, i: int) -> np.ndarray:
        s, j = self._locate(i)
        off = self._offsets[s]
        return np.asarray(self._data[s][off[j]:off[j + 1]], dtype=np.int64)

    def doc_start(self, i: int) -> int:
        """Where document i starts in the token stream (the shards back to back)."""
        s, j = self._locate(i)
        return int(self._token_starts[s] + self._offsets[s][j])

    def mask(self, i: int) -> np.ndarray | None:
        s, j = self._locate(i)
        m = self._masks[s]
        if m is None:
            return None
        off = self._offsets[s]
        return np.asarray(m[off[j]:off[j + 1]], dtype=np.uint8)

    def doc_lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(o) for o in self._offsets]) if self._offsets else \
            np.zeros(0, np.int64)
