"""Prompts that start with tokens another sequence holds are prefilled from where they part: the
next turn of a conversation, the members of a group sharing a prompt. Reuse must not change a
token or a logprob."""

from __future__ import annotations

import pytest
import torch

from codedojo.engine.engine import PREFIX_MIN_TOKENS, Engine
from codedojo.engine.prefix_cache import PrefixCache
from codedojo.engine.reference import greedy_reference
from codedojo.engine.types import Completion, SamplingParams
from codedojo.model.config import ModelConfig
from codedojo.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [(7 * i) % 250 + 3 for i in range(40)]


@pytest.fixture()
def model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig.tiny(tie_embeddings=False)).eval()
    with torch.no_grad():
        m.output.weight.mul_(30)  # type: ignore[union-attr]
    return m


def sampled(seed: int, n: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed)


def same(a: Completion, b: Completion) -> bool:
    return (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)


@pytest.mark.parametrize("fuse", [True, False], ids=["kernels", "op-by-op"])
def test_the_next_turn_prefills_only_what_is_new(model: Transformer, fuse: bool) -> None:
    model.fuse = fuse
    engine, fresh = Engine(model, max_batch=2), Engine(model, max_batch=2, prefix_cache_tokens=0)
    first = engine.generate([PROMPT], sampled(1))[0]
    # the conversation goes on: the reply's first 8 tokens, then a new user turn
    turn = PROMPT + first.token_ids[:8] + [9, 8, 7, 6, 5]
    again = engine.generate([turn], sampled(2))[0]
    assert again.cached_tokens == len(PROMPT) + 8
    alone = fresh.generate([turn], sampled(2))[0]
    if fuse:  # the kernels' results do not depend on how a sequence was split into passes
        assert same(again, alone)
    else:  # BLAS makes no such promise
        assert again.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(alone.logprobs),
                              atol=1e-5)


def test_a_group_sharing_a_prompt_prefills_it_once(model: Transformer) -> None:
    params = [sampled(s) for s in range(4)]
    group = Engine(model, max_batch=4).generate([PROMPT] * 4, params)
    assert [c.cached_tokens for c in group] == [0] + [len(PROMPT) - 1] * 3
    fresh = Engine(model, max_batch=1, prefix_cache_tokens=0)
    for c, p in zip(group, params, strict=True):
        assert same(c, fresh.generate([PROMPT], p)[0])
    assert len({tuple(c.token_ids) for c in group}) > 1  # the seeds still differ


@pytest.mark.parametrize("fuse", [True, False], ids=["kernels", "op-by-op"])
def test_reused_and_fresh_prompts_prefill_in_one_batch(model: Transformer, fuse: bool) -> None:
    """Rows that start at different positions (one after a reused prefix, one from the first
    token) in the same prefill pass."""
    model.fuse = fuse
    engine = Engine(model, max_batch=3)
    first = engine.generate([PROMPT], sampled(1))[0]
    prompts = [PROMPT + first.token_ids[:3] + [4, 5], [11, 12, 13] * 5]
    params = [sampled(2), sampled(3)]
    both = engine.generate(prompts, params)
    assert [c.cached_tokens for c in both] == [len(PROMPT) + 3, 0]
    fresh = Engine(model, max_batch=1, prefix_cache_tokens=0)
    for c, p, sp in zip(both, prompts, params, strict=True):
        alone = fresh.generate([p], sp)[0]
        assert c.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(alone.logprobs),
                              atol=0 if fuse else 1e-5)


def test_a_batch_is_split_where_padding_would_run_past_the_context(model: Transformer) -> None:
    """A reused prompt's row padded to a fresh prompt's width would run past max_seq_len."""
    engine = Engine(model, max_batch=2, max_seq_len=64)
    first = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0))[0]
    prompts = [PROMPT + first.token_ids[:6], list(range(5, 45))]
    out = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert out[0].cached_tokens == len(PROMPT) + 6 - 1
    for c, p in zip(out, prompts, strict=True):
        assert c.token_ids == greedy_reference(model, p, 4)


def test_a_prompt_continuing_a_running_sequence_reuses_its_output_too(
        model: Transformer) -> None:
    engine = Engine(model, max_batch=2)
    running = engine.submit(PROMPT, SamplingParams(max_tokens=20, temperature=0))
    for _ in range(5):
        engine.step()
    turn = PROMPT + running.token_ids[:3] + [4]
    late = engine.submit(turn, SamplingParams(max_tokens=6, temperature=0))
    while not (running.done.is_set() and late.done.is_set()):
        engine.step()
    assert late.cached_tokens == len(PROMPT) + 3
    assert late.token_ids == greedy_reference(model, turn, 6)


def test_short_shared_prefixes_are_prefilled_again(model: Transformer) -> None:
    engine = Engine(model, max_batch=2)
    engine.generate([PROMPT], sampled(1))
    short = PROMPT[: PREFIX_MIN_TOKENS - 1] + [1, 2, 3]
    assert engine.generate([short], sampled(1))[0].cached_tokens == 0


def test_new_weights_drop_cached_prefixes(model: Transformer) -> None:
    engine = Engine(model, max_batch=2)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    engine.generate([PROMPT], greedy)
    assert engine.prefix_cache.tokens > 0
    engine.load_weights({k: v * 1.5 for k, v in model.state_dict().items() if "wqkv" in k}, 1)
    assert engine.prefix_cache.tokens == 0
    after = engine.generate([PROMPT + [4]], greedy)[0]
    assert after.cached_tokens == 0
    assert after.token_ids == greedy_reference(model, PROMPT + [4], 8)


def test_keys_of_replaced_weights_are_not_shared_even_under_the_same_version(
        model: Transformer) -> None:
    engine = Engine(model, max_batch=2)
    greedy = SamplingParams(max_tokens=20, temperature=0)
    running = engine.submit(PROMPT, greedy)
    engine.step()  # prefilled, decoding
    engine.load_weights({k: v * 1.5 for k, v in model.state_dict().items() if "wqkv" in k},
                        version=engine.weight_version)  # the same number pushed again
    late = engine.submit(PROMPT + [4], SamplingParams(max_tokens=8, temperature=0))
    while not (running.done.is_set() and late.done.is_set()):
        engine.step()
    assert late.cached_tokens == 0
    assert late.token_ids == greedy_reference(model, PROMPT + [4], 8)
    # kept: the late request's sequence; not the one that straddled the push
    assert engine.prefix_cache.tokens == len(PROMPT) + 1 + 7


def test_prefix_cache_keeps_the_most_recent_within_its_budget() -> None:
    kv = torch.zeros(2, 1, 1, 4)
    cache = PrefixCache(max_tokens=100)

    def put(ids: list[int]) -> None:
        t = torch.tensor(ids)
        cache.put(t, kv.expand(2, 1, len(ids), 4), kv.expand(2, 1, len(ids), 4))

    put(list(range(40)))
    put(list(range(50)))  # extends the first: replaces it
    assert cache.tokens == 50 and len(cache.entries) == 1
    put(list(range(30)))  # a prefix of one held: nothing new
    assert cache.tokens == 50
    put(list(range(100, 140)))
    entry, n = cache.lookup(torch.tensor([*range(45), 7]))
    assert n == 45 and entry is not None and len(entry.ids) == 50  # now the most recent
    put(list(range(200, 230)))  # over budget: the least recently used goes
    assert cache.tokens == 80
    assert cache.lookup(torch.tensor(list(range(100, 140))))[1] == 0
    assert cache.lookup(torch.tensor(list(range(10))))[1] == 10
    put(list(range(1000, 1101)))  # larger than the whole budget: not kept
    assert cache.tokens == 80
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(-1)
