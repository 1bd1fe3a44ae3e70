"""A key/value cache for continuous batching: fixed slots, each holding one sequence, with its own
length. Storage grows (by doubling) up to ``max_len`` so a 16-slot cache for long contexts costs
memory only when sequences actually get long.

A forward pass works on a contiguous range of slots (a ``CacheView``). The engine keeps its live
sequences packed at the front (``move`` fills a hole when one finishes), so a decode step reads
``k[:, :n]`` as a plain slice: no gather copies per layer. Positions beyond a slot's length hold
stale values; the per-row mask hides them, which also makes ``truncate`` (speculative rollback)
free.

A pass can also hold a tree of new tokens in one slot (``parents``: several continuations of
the sequence, as speculative decoding drafts them): they are stored one after another, and each
is placed and masked as if its ancestors among them were the only tokens after the slot's
past. ``keep`` then moves the branch that was accepted down over the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from codedojo.model.config import ModelConfig


def tree_positions(past: int, parents: Sequence[int]) -> list[int]:
    """The positions of a tree of new tokens after ``past`` stored ones: ``parents[i]`` is the
    index of token i's parent among them (before i), or -1 for a token that follows the past
    directly; each token sits one position after its parent."""
    pos: list[int] = []
    for i, up in enumerate(parents):
        if not -1 <= up < i:
            raise ValueError(f"parents: token {i}'s parent {up} is not an earlier token or -1")
        pos.append(past if up < 0 else pos[up] + 1)
    return pos


def check_tree(parents: Sequence[int], T: int, rows: int) -> None:
    """Refuse ``parents`` that do not make a tree of a pass's T new tokens in one row."""
    if rows != 1 or len(parents) != T:
        raise ValueError(f"parents: {len(parents)} for {T} new tokens in {rows} rows (a tree "
                         "lives in one row)")
    tree_positions(0, parents)


class KVCache:
    """Per-layer keys/values, shape (layers, slots, kv_heads, capacity, head_dim)."""

    def __init__(self, cfg: ModelConfig, n_slots: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 initial_len: int = 256) -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        if initial_len < 1:  # (storage grows by doubling, which an empty start never does)
            raise ValueError(f"initial_len must be >= 1, got {initial_len}")
        self.n_layers, self.n_slots, self.max_len = cfg.n_layers, n_slots, max_len
        self._shape = (cfg.n_layers, n_slots, cfg.n_kv_heads, 0, cfg.hd)
        self.dtype, self.device = dtype, torch.device(device)
        self.lengths = [0] * n_slots  # tokens stored per slot
        self.k = self.v = torch.empty(0)
        self._alloc(min(initial_len, max_len))

    def _alloc(self, capacity: int) -> None:
        L, N, K, _, D = self._shape
        k = torch.zeros(L, N, K, capacity, D, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.k.numel():
            old = self.k.shape[3]
            k[:, :, :, :old] = self.k
            v[:, :, :, :old] = self.v
        self.k, self.v = k, v

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, length: int) -> None:
        """Make room for ``length`` tokens in every slot."""
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the cache's max_len "
                             f"{self.max_len}")
        if length > self.capacity:
            cap = self.capacity
            while cap < length:
                cap *= 2
            self._alloc(min(cap, self.max_len))

    def _slot(self, slot: int) -> int:
        """``slot``, refused unless it is one of the cache's slots (a negative index would
        name a slot from the end)."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} outside [0, {self.n_slots})")
        return slot

    def _held(self, slot: int, n: int, what: str = "n") -> None:
        """Refuse ``n`` tokens of ``slot`` unless the slot holds that many (past its length it
        holds stale rows)."""
        self._slot(slot)
        if not 0 <= n <= self.lengths[slot]:
            raise ValueError(f"{what} {n} outside [0, {self.lengths[slot]}] for slot {slot}")

    def view(self, start: int, stop: int | None = None) -> CacheView:
        """The slots [start, stop) for one forward pass."""
        stop = start + 1 if stop is None else stop
        if not 0 <= start < stop <= self.n_slots:
            raise ValueError(f"slots [{start}, {stop}) outside [0, {self.n_slots})")
        return CacheView(self, start, stop)

    def truncate(self, slot: int, length: int) -> None:
        """Forget everything after the first ``length`` tokens of ``slot``."""
        self._held(slot, length, "length")
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        self.lengths[self._slot(slot)] = 0

    def export(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of the first ``n`` tokens ``slot`` holds, (layers,
        kv_heads, n, head_dim) each."""
        self._held(slot, n)
        return self.k[:, slot, :, :n].clone(), self.v[:, slot, :, :n].clone()

    def copy(self, src: int, dst: int, n: int) -> None:
        """Make slot ``dst`` hold the first ``n`` tokens of slot ``src`` and nothing after."""
        self._held(src, n)
        self.load(dst, self.k[:, src, :, :n], self.v[:, src, :, :n])

    def load(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Make ``slot`` hold the given keys and values (as ``export`` gives them) and nothing
        after them."""
        self._slot(slot)
        L, _, K, _, D = self._shape
        if k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (L, K, D) or v.shape != k.shape:
            raise ValueError(f"load: keys {tuple(k.shape)} and values {tuple(v.shape)} must both "
                             f"be (layers {L}, kv_heads {K}, n, head_dim {D})")
        n = k.shape[2]
        self.reserve(n)
        self.k[:, slot, :, :n] = k
        self.v[:, slot, :, :n] = v
        self.lengths[slot] = n

    def keep(self, slot: int, start: int, positions: Sequence[int]) -> None:
        """Make ``slot`` hold its first ``start`` tokens followed by the tokens stored at
        ``positions`` (increasing, each at ``start`` or after), and nothing after them: the
        branch of a tree pass that was accepted, moved down over the rest."""
        n = self.lengths[self._slot(slot)]
        if not 0 <= start <= n or any(not start <= p < n for p in positions) or any(
                a >= b for a, b in zip(positions, positions[1:], strict=False)):
            raise ValueError(f"keep: positions {list(positions)} must increase within "
                             f"[{start}, {n}) of slot {slot}")
        for i, p in enumerate(positions):
            if p != start + i:
                self.k[:, slot, :, start + i] = self.k[:, slot, :, p]
                self.v[:, slot, :, start + i] = self.v[:, slot, :, p]
        self.lengths[slot] = start + len(positions)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into ``dst`` (used to keep live slots contiguous)."""
        self._slot(dst)
        if self._slot(src) == dst:
            return
        self.copy(src, dst, self.lengths[src])
        self.lengths[src] = 0


class CacheView:
    """Slots [start, stop) of a cache, as seen by one forward pass over T new tokens."""

    def __init__(self, cache: KVCache, start: int, stop: int) -> None:
        self.cache, self.start, self.stop = cache, start, stop
        self._write: torch.Tensor | None = None
        self._past: list[int] = []
        self._extent = 0

    def advance(self, T: int) -> list[int]:
        """Reserve room for T new tokens per slot and advance the lengths; return the lengths
        before (the first new token's position in each slot). Called once per forward pass,
        before the layers (``prepare`` does, for the layers run op by op)."""
        c = self.cache
        past = c.lengths[self.start : self.stop]
        self._past, self._extent = past, max(past) + T
        c.reserve(self._extent)
        for i, n in enumerate(past):
            c.lengths[self.start + i] = n + T
        return past

    def prepare(self, T: int, parents: Sequence[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``advance``, then the new tokens' positions (B, T) and the attention mask
        (B, 1, T, S) for the layers run op by op. None where no mask is needed: one new token
        a slot at the same position (every key visible), or several in slots that were empty
        (plain causal attention, which ``scaled_dot_product_attention`` runs without a mask:
        a 4096-token prompt of SmolLM2-135M spends 0.17 s a layer in attention instead of 0.4
        with the mask). ``parents`` (one slot): the new tokens are a tree (`tree_positions`);
        they are stored one after another, and the positions returned are their places in
        the tree, each seeing the past before its first ancestor here, its ancestors and
        itself."""
        if parents is not None:
            check_tree(parents, T, self.stop - self.start)
        past = self.advance(T)
        dev = self.cache.device
        pos = torch.tensor(past, device=dev)[:, None] + torch.arange(T, device=dev)[None, :]
        self._write = pos
        if parents is not None:
            place = tree_positions(past[0], parents)
            seen = torch.zeros(T, self._extent, dtype=torch.bool, device=dev)
            for i, up in enumerate(parents):
                if up < 0:
                    seen[i, :place[i]] = True
                else:
                    seen[i] = seen[up]
                seen[i, past[0] + i] = True
            return torch.tensor([place], device=dev), seen[None, None]
        mask: torch.Tensor | None = None
        if (T > 1 and max(past) > 0) or min(past) != max(past):
            keys = torch.arange(self._extent, device=dev)
            mask = (keys[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # (B, 1, T, S)
        return pos, mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, K, T, hd) at this pass's positions; return all keys/values so far
        (B, K, S, hd) for these slots."""
        c, s0, s1 = self.cache, self.start, self.stop
        kc, vc = c.k[layer, s0:s1], c.v[layer, s0:s1]  # (B, K, cap, hd) views
        T = k.shape[2]
        past = self._past
        if min(past) == max(past):  # all rows write the same span: a slice copy
            p = past[0]
            kc[:, :, p : p + T] = k
            vc[:, :, p : p + T] = v
        else:
            idx = self._write[:, None, :, None].expand_as(k)  # type: ignore[index]
            kc.scatter_(2, idx, k)
            vc.scatter_(2, idx, v)
        return kc[:, :, : self._extent], vc[:, :, : self._extent]
