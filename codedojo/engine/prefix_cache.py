"""Keys and values of finished sequences, kept so that a later prompt starting with the same
tokens is prefilled from where they part.

An agent loop sends the whole conversation again every turn, and a GRPO group sends one prompt
several times: without reuse each of them is prefilled from the first token. The engine puts
a sequence here when it retires (its tokens and their keys/values, copied out of its cache
slot) and looks a new prompt up before prefilling it. Entries are evicted least recently used
first, to keep at most ``max_tokens`` tokens. Entries hold one weight version's keys and values:
the engine clears the cache when the weights change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)  # entries are compared by identity
class Entry:
    ids: torch.Tensor  # (n,) int64: the tokens whose keys/values are held
    k: torch.Tensor  # (layers, kv_heads, n, head_dim)
    v: torch.Tensor
    routed_experts: torch.Tensor | None = None  # (n, MoE layers, top_k), when routing is recorded


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """The number of leading tokens two id sequences share."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix cache max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.entries: list[Entry] = []  # least recently used first
        self.tokens = 0  # held in all entries

    def lookup(self, ids: torch.Tensor) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``ids`` and that length (None, 0 when
        none shares a token); the entry becomes the most recently used."""
        best, n = None, 0
        for e in self.entries:
            m = common_prefix(e.ids, ids)
            if m > n:
                best, n = e, m
        if best is not None:
            self.entries.remove(best)
            self.entries.append(best)
        return best, n

    def put(self, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            routed_experts: torch.Tensor | None = None) -> None:
        """Keep a sequence (its tensors are held as given: pass copies). An entry that is a
        prefix of it is dropped; one it is a prefix of makes it redundant."""
        n = len(ids)
        if n == 0 or n > self.max_tokens:
            return
        for e in list(self.entries):
            m = common_prefix(e.ids, ids)
            if m == n:  # already held, in full
                return
            if m == len(e.ids):  # the new sequence extends it
                self._drop(e)
        while self.tokens + n > self.max_tokens:
            self._drop(self.entries[0])
        self.entries.append(Entry(ids, k, v, routed_experts))
        self.tokens += n

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0

    def _drop(self, e: Entry) -> None:
        self.entries.remove(e)
        self.tokens -= len(e.ids)
