"""Packing documents into fixed-length rows, with document boundaries kept.

A row holds `seq_len + 1` tokens (inputs are row[:-1], targets row[1:]) and, per token, a segment
id: which document of the row it belongs to. From the segment ids a batch gets

* `doc_ids`   (B, T) so the model's attention is block-diagonal: no token sees another document;
* `positions` (B, T) restarting at 0 at each document start, as if the document were alone;
* `loss_mask` (B, T) true only where the target is the next token *of the same document* (and, for
  SFT, a token the chat renderer marked as trained).

Together these make a document's loss identical packed or alone (tested). A document longer than
a row is split; each piece restarts its positions, and the next opens with the token that ended
the last (there only a target), so that every next-token pair of the document is trained once.
Padding (only in the last row) has segment -1 and is never trained.

Packed with ``origins``, a row also records where each token came from in its source's token
stream, so that per-token vectors stored beside a source (``features.py``: the frozen model's
hidden states of self-generated text) reach the batch as ``hidden``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from codedojo.data.features import TokenFeatures
from codedojo.data.mixture import MixedDoc
from codedojo.paths import staged_dir


@dataclass
class Packed:
    tokens: np.ndarray  # (N, L+1) int32
    segments: np.ndarray  # (N, L+1) int32, -1 = padding
    mask: np.ndarray  # (N, L+1) uint8 per-token trainability from the source (SFT masks)
    origin: np.ndarray | None = None  # (N, L+1) int64 position in the source's stream, -1 = pad

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1] - 1)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def save(self, path: str | Path) -> None:
        """Write the rows to the directory ``path``, whole or not at all (a directory half
        written by a killed process is replaced)."""
        with staged_dir(path, replace=True) as tmp:
            np.save(tmp / "tokens.npy", self.tokens)
            np.save(tmp / "segments.npy", self.segments)
            if self.origin is not None:
                np.save(tmp / "origin.npy", self.origin)
            np.save(tmp / "mask.npy", self.mask)  # its presence marks a finished directory

    @classmethod
    def load(cls, path: str | Path) -> Packed:
        path = Path(path)
        origin = path / "origin.npy"
        return cls(np.load(path / "tokens.npy", mmap_mode="r"),
                   np.load(path / "segments.npy", mmap_mode="r"),
                   np.load(path / "mask.npy", mmap_mode="r"),
                   np.load(origin, mmap_mode="r") if origin.exists() else None)

    def rows(self, idx: np.ndarray) -> Packed:
        """The rows ``idx`` (a copy)."""
        return Packed(self.tokens[idx], self.segments[idx], self.mask[idx],
                      None if self.origin is None else self.origin[idx])


def pack(docs: Iterable[MixedDoc | np.ndarray], seq_len: int, pad_id: int = 0,
         max_rows: int | None = None, allow_split: bool = True,
         origins: bool = False) -> Packed:
    """Greedy in-order packing: documents are concatenated and cut into rows of seq_len + 1.
    With allow_split=False a document that does not fit in the rest of a row starts a new row
    (the rest is padding); only documents longer than a row are still split. A document with a
    loss mask (a conversation; a continuation after its context), or from a source that keeps
    its documents whole, is always packed so: cut in two, its answer would be learnt in the
    next row without what it answers. ``origins``
    (documents from a mixture, one source) records each token's place in that source."""
    if seq_len < 1:
        raise ValueError("seq_len must be >= 1")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    width = seq_len + 1
    rows_t: list[np.ndarray] = []
    rows_s: list[np.ndarray] = []
    rows_m: list[np.ndarray] = []
    rows_o: list[np.ndarray] = []
    cur_t = np.full(width, pad_id, np.int32)
    cur_s = np.full(width, -1, np.int32)
    cur_m = np.zeros(width, np.uint8)
    cur_o = np.full(width, -1, np.int64)
    fill, seg = 0, 0

    def flush() -> None:
        nonlocal cur_t, cur_s, cur_m, cur_o, fill, seg
        rows_t.append(cur_t)
        rows_s.append(cur_s)
        rows_m.append(cur_m)
        rows_o.append(cur_o)
        cur_t = np.full(width, pad_id, np.int32)
        cur_s = np.full(width, -1, np.int32)
        cur_m = np.zeros(width, np.uint8)
        cur_o = np.full(width, -1, np.int64)
        fill, seg = 0, 0

    sources: set[int] = set()
    for d in docs:
        toks = d.tokens if isinstance(d, MixedDoc) else np.asarray(d)
        masked = isinstance(d, MixedDoc) and d.mask is not None
        whole = masked or (isinstance(d, MixedDoc) and d.whole)
        m = d.mask if masked else np.ones(len(toks), np.uint8)  # type: ignore[union-attr]
        if len(m) != len(toks):
            raise ValueError(f"pack: a document's loss mask has {len(m)} entries for its "
                             f"{len(toks)} tokens")
        if origins:
            if not isinstance(d, MixedDoc):
                raise ValueError("pack: origins need documents from a mixture (MixedDoc)")
            sources.add(d.source)
            if len(sources) > 1:
                raise ValueError("pack: origins name places in one source; the documents "
                                 "come from several")
            at = d.start + np.arange(len(toks), dtype=np.int64)
        start = 0
        if (whole or not allow_split) and fill > 0 and len(toks) > width - fill:
            flush()
            if max_rows is not None and len(rows_t) >= max_rows:
                break
        while start < len(toks):
            take = min(width - fill, len(toks) - start)
            cur_t[fill:fill + take] = toks[start:start + take]
            cur_s[fill:fill + take] = seg
            cur_m[fill:fill + take] = m[start:start + take]
            if origins:
                cur_o[fill:fill + take] = at[start:start + take]
            fill += take
            start += take
            seg += 1
            if fill == width:
                flush()
                if max_rows is not None and len(rows_t) >= max_rows:
                    break
                if start < len(toks):  # (the cut token, only a target there, is the next
                    start -= 1  # row's first input: no next-token pair is lost at the cut)
        if max_rows is not None and len(rows_t) >= max_rows:
            break
    if fill > 0 and (max_rows is None or len(rows_t) < max_rows):
        flush()
    if not rows_t:
        raise ValueError("pack: no documents")
    return Packed(np.stack(rows_t), np.stack(rows_s), np.stack(rows_m),
                  np.stack(rows_o) if origins else None)


def positions_from_segments(seg: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids -> (B, T) positions restarting at 0 where the segment changes."""
    B, T = seg.shape
    idx = torch.arange(T, device=seg.device).expand(B, T)
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    # index of the most recent segment start at or before each position
    last_start = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - last_start


def make_batch(tokens: np.ndarray, segments: np.ndarray, mask: np.ndarray,
               features: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Rows (B, L+1) -> model inputs and targets (each (B, L)); ``features`` (B, L+1, D)
    the tokens' stored vectors, given as ``hidden`` (B, L, D) for the inputs."""
    # np.array copies: rows may be read-only memmap views
    t = torch.as_tensor(np.array(tokens), dtype=torch.long)
    s = torch.as_tensor(np.array(segments), dtype=torch.long)
    m = torch.as_tensor(np.array(mask), dtype=torch.bool)
    inp_s = s[:, :-1]
    loss_mask = (s[:, 1:] == inp_s) & (inp_s >= 0) & m[:, 1:]
    return {
        "tokens": t[:, :-1],
        "targets": t[:, 1:],
        "positions": positions_from_segments(inp_s),
        "doc_ids": inp_s,
        "loss_mask": loss_mask,
        **({} if features is None else {"hidden": features[:, :-1]}),
    }


class PackedLoader:
    """Batches of packed rows in a seeded order per epoch. Its whole state is (epoch, position),
    so a resumed run sees exactly the batches it would have seen.

    Data parallel (``world`` ranks): every rank draws the same order and takes every
    ``world``-th row of it from its ``rank``, so in an epoch the ranks' rows are disjoint and
    each rank has as many (the last ``len % world`` of the order wait for the next epoch).

    ``features``: vectors stored beside the rows' source (the rows packed with origins); each
    batch then carries the inputs' vectors as ``hidden``."""

    def __init__(self, packed: Packed, batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world: int = 1, features: TokenFeatures | None = None):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not one of {world} ranks")
        if features is not None and packed.origin is None:
            raise ValueError("features: the rows were packed without origins")
        self.features = features
        if len(packed) // world < batch_size:
            raise ValueError(f"only {len(packed)} packed rows for batch_size {batch_size}"
                             + (f" on each of {world} ranks" if world > 1 else ""))
        self.packed, self.batch_size, self.seed, self.shuffle = packed, batch_size, seed, shuffle
        self.rank, self.world = rank, world
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> np.ndarray:
        n = len(self.packed)
        order = (np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        return order[: n - n % self.world][self.rank::self.world]

    @property
    def epoch_rows(self) -> np.ndarray:
        """This rank's rows of the current epoch, in the order it reads them (a copy)."""
        return self._order.copy()

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self.pos + self.batch_size > len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._make_order()
        rows = np.sort(self._order[self.pos:self.pos + self.batch_size])
        self.pos += self.batch_size
        p = self.packed.rows(rows)
        feats = None
        if self.features is not None:
            assert p.origin is not None
            feats = self.features.gather(p.origin)
        return make_batch(p.tokens, p.segments, p.mask, feats)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
