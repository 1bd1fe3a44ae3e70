"""The key/value cache's bookkeeping: arguments naming no slot, or tokens a slot does not hold,
are refused before anything changes."""

from __future__ import annotations

import pytest
import torch

from codedojo.model.config import ModelConfig
from codedojo.model.kv_cache import KVCache

CFG = ModelConfig.tiny()


def _cache() -> KVCache:
    c = KVCache(CFG, n_slots=3, max_len=64, initial_len=8)
    c.lengths = [3, 5, 0]
    c.k[:, 0, :, 3:] = 7.0  # stale rows past slot 0's three tokens
    return c


def test_an_empty_initial_capacity_is_refused() -> None:
    # (it would never grow: reserve doubles the capacity)
    with pytest.raises(ValueError, match="^initial_len must be >= 1, got 0$"):
        KVCache(CFG, n_slots=1, max_len=64, initial_len=0)
    c = KVCache(CFG, n_slots=1, max_len=64, initial_len=1)
    c.reserve(5)
    assert c.capacity == 8


def test_copy_refuses_more_tokens_than_the_source_holds() -> None:
    c = _cache()
    for n in (6, 100, -1):
        with pytest.raises(ValueError, match=rf"^n {n} outside \[0, 3\] for slot 0$"):
            c.copy(0, 2, n)
    assert c.lengths == [3, 5, 0] and c.capacity == 8
    c.copy(0, 2, 3)
    assert c.lengths == [3, 5, 3] and torch.equal(c.k[:, 2, :, :3], c.k[:, 0, :, :3])


@pytest.mark.parametrize("call", [
    lambda c, s: c.truncate(s, 0),
    lambda c, s: c.reset(s),
    lambda c, s: c.export(s, 0),
    lambda c, s: c.copy(s, 2, 0),
    lambda c, s: c.copy(0, s, 0),
    lambda c, s: c.load(s, *c.export(0, 3)),
    lambda c, s: c.keep(s, 0, []),
    lambda c, s: c.move(s, 2),
    lambda c, s: c.move(0, s),
])
@pytest.mark.parametrize("slot", [-1, 3])
def test_every_method_taking_a_slot_refuses_one_the_cache_has_not(call, slot) -> None:
    c = _cache()
    with pytest.raises(ValueError, match=rf"^slot {slot} outside \[0, 3\)$"):
        call(c, slot)
    assert c.lengths == [3, 5, 0]


def test_load_refuses_keys_and_values_of_another_shape() -> None:
    c = _cache()
    k, v = c.export(1, 5)
    for bad_k, bad_v in ((k[0], v[0]), (k, v[:, :, :4]), (k[:, :1], v[:, :1])):
        with pytest.raises(ValueError, match="^load: keys .* must both be"):
            c.load(2, bad_k, bad_v)
    assert c.lengths == [3, 5, 0]
    c.load(2, k, v)
    assert c.lengths == [3, 5, 5] and torch.equal(c.v[:, 2, :, :5], v)
