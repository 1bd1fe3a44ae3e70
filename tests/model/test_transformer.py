"""The decoder on a tiny config: cache paths equal the full forward, packed-document masking,
hidden state / head split, input checks."""

from __future__ import annotations

import pytest
import torch

from codedojo.model.config import ModelConfig
from codedojo.model.kv_cache import KVCache
from codedojo.model.transformer import Transformer
from tests.ops.conftest import needs_kernel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny()).eval()


def test_prefill_then_decode_with_cache_matches_full_forward(tiny: Transformer) -> None:
    tokens = torch.randint(0, 256, (1, 10))
    full = tiny(tokens)
    cache = KVCache(tiny.cfg, n_slots=2, max_len=64, initial_len=4)  # forces growth
    pre = tiny(tokens[:, :6], cache=cache.view(1))
    steps = [tiny(tokens[:, i : i + 1], cache=cache.view(1)) for i in range(6, 10)]
    got = torch.cat([pre] + steps, dim=1)
    assert torch.allclose(got, full, atol=1e-5)
    assert cache.lengths == [0, 10]


def test_ragged_batch_decode_matches_each_sequence_alone(tiny: Transformer) -> None:
    seqs = [torch.randint(0, 256, (1, n)) for n in (3, 9, 5)]
    cache = KVCache(tiny.cfg, n_slots=3, max_len=64)
    for slot, s in enumerate(seqs):
        tiny(s[:, :-1], cache=cache.view(slot))
    last = torch.cat([s[:, -1:] for s in seqs])  # (3, 1)
    batched = tiny(last, cache=cache.view(0, 3))[:, -1]
    for i, s in enumerate(seqs):
        assert torch.allclose(batched[i], tiny(s)[0, -1], atol=1e-5)


def test_truncate_and_move_keep_the_cache_consistent(tiny: Transformer) -> None:
    a, b = torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 5))
    cache = KVCache(tiny.cfg, n_slots=2, max_len=32)
    tiny(a, cache=cache.view(0))
    cache.truncate(0, 4)  # roll back the last four (as speculative decoding does)
    tiny(b, cache=cache.view(1))
    cache.move(1, 0)
    assert cache.lengths == [5, 0]
    nxt = torch.randint(0, 256, (1, 1))
    got = tiny(nxt, cache=cache.view(0))[0, -1]
    assert torch.allclose(got, tiny(torch.cat([b, nxt], 1))[0, -1], atol=1e-5)
    with pytest.raises(ValueError, match="length"):
        cache.truncate(0, 99)


# A tree after a 5-token prefix: the last real token (0), three continuations of it (1-3), two
# after the first (4, 5) and one after the second (6).
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2]


def test_a_tree_pass_gives_each_node_what_its_branch_gives_alone(tiny: Transformer) -> None:
    """Each node of a tree pass (op by op here; `tests/ops` for the kernels) gets the logits
    its branch would decoded as the whole sequence, though the nodes are stored one after
    another; `keep` then leaves the cache the accepted branch alone would."""
    tiny.fuse = False
    try:
        prefix = torch.randint(0, 256, (1, 5))
        nodes = torch.randint(0, 256, (1, len(TREE_PARENTS)))
        cache = KVCache(tiny.cfg, n_slots=1, max_len=32)
        tiny(prefix, cache=cache.view(0))
        tree = tiny(nodes, cache=cache.view(0), parents=TREE_PARENTS)[0]
        assert cache.lengths == [5 + len(TREE_PARENTS)]
        for i in range(len(TREE_PARENTS)):
            branch = [i]
            while TREE_PARENTS[branch[0]] >= 0:
                branch.insert(0, TREE_PARENTS[branch[0]])
            alone = tiny(torch.cat([prefix, nodes[:, branch]], 1))[0, -1]
            assert torch.allclose(tree[i], alone, atol=1e-5), i
        cache.keep(0, 5, [5, 6, 10])  # the branch 0 -> 1 -> 5
        assert cache.lengths == [8]
        nxt = torch.randint(0, 256, (1, 1))
        got = tiny(nxt, cache=cache.view(0))[0, -1]
        want = tiny(torch.cat([prefix, nodes[:, [0, 1, 5]], nxt], 1))[0, -1]
        assert torch.allclose(got, want, atol=1e-5)
    finally:
        tiny.fuse = True


def test_tree_passes_refuse_what_they_cannot_place(tiny: Transformer) -> None:
    cache = KVCache(tiny.cfg, n_slots=2, max_len=32)
    tiny(torch.randint(0, 256, (1, 4)), cache=cache.view(0))
    with pytest.raises(ValueError, match="parent 2 is not an earlier token"):
        tiny(torch.randint(0, 256, (1, 3)), cache=cache.view(0), parents=[-1, 2, 0])
    with pytest.raises(ValueError, match="parents: 2 for 3 new tokens"):
        tiny(torch.randint(0, 256, (1, 3)), cache=cache.view(0), parents=[-1, 0])
    with pytest.raises(ValueError, match="must increase within"):
        cache.keep(0, 2, [3, 3])
    with pytest.raises(ValueError, match="must increase within"):
        cache.keep(0, 2, [1])


def test_doc_ids_block_attention_across_documents(tiny: Transformer) -> None:
    a, b = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 7))
    packed = torch.cat([a, b], 1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.tensor([list(range(5)) + list(range(7))])
    out = tiny(packed, doc_ids=doc_ids, positions=positions)
    assert torch.allclose(out[:, :5], tiny(a), atol=1e-5)
    assert torch.allclose(out[:, 5:], tiny(b), atol=1e-5)
    # without the mask the second document sees the first, and its logits change
    assert not torch.allclose(tiny(packed, positions=positions)[:, 5:], tiny(b), atol=1e-3)


def test_return_hidden_and_head_compose_to_logits(tiny: Transformer) -> None:
    tokens = torch.randint(0, 256, (2, 6))
    logits, hidden = tiny(tokens, return_hidden=True)
    assert logits.dtype == torch.float32 and logits.shape == (2, 6, 256)
    assert hidden.shape == (2, 6, 64)
    assert torch.allclose(tiny.head(hidden), logits)
    assert torch.allclose(tiny(tokens, last_only=True), logits[:, -1:])
    # greedy picks, a few positions at a time: the logits' argmax, over a sub-vocabulary too
    assert torch.equal(tiny.greedy(hidden, chunk=5), logits.argmax(-1))
    sub = torch.tensor([3, 17, 40, 41, 200])
    assert torch.equal(tiny.greedy(hidden, sub, chunk=4), logits[..., sub].argmax(-1))


def test_untied_model_with_attention_bias_runs_and_trains() -> None:
    torch.manual_seed(0)
    m = Transformer(ModelConfig.tiny(tie_embeddings=False, attn_bias=True))
    assert m.output is not None and m.layers[0].attn.wqkv.bias is not None
    tokens = torch.randint(0, 256, (2, 8))
    loss = torch.nn.functional.cross_entropy(m(tokens)[:, :-1].reshape(-1, 256),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    assert m.layers[0].attn.wqkv.weight.grad is not None
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform init


def test_bad_inputs_name_the_field(tiny: Transformer) -> None:
    tokens = torch.randint(0, 256, (1, 4))
    with pytest.raises(ValueError, match="positions"):
        tiny(tokens, positions=torch.tensor([[0, 1, 2, 999]]))
    with pytest.raises(ValueError, match="doc_ids"):
        tiny(tokens, doc_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig.tiny(n_heads=4, n_kv_heads=3)


def test_positions_outside_the_rope_table_are_refused() -> None:
    """A negative position would wrap to the table's end (its last rotation)."""
    model = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=16)).eval()
    tokens = torch.zeros(1, 4, dtype=torch.long)
    for bad in ([-1, 0, 1, 2], [0, 1, 2, 16]):
        with pytest.raises(ValueError, match=r"positions: -?\d+\.\.\d+ outside \[0, "
                                             r"max_seq_len 16\)"):
            model(tokens, positions=torch.tensor([bad]))


def test_a_pass_past_max_seq_len_leaves_the_cache_as_it_was() -> None:
    """Refused before the cache counts its tokens (the op-by-op path: here unfused), so the
    sequence goes on from where it was."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=16)).eval()
    model.fuse = False
    cache = KVCache(model.cfg, 1, 16)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 10)), cache=cache.view(0, 1))
        with pytest.raises(ValueError, match="positions: 19 >= max_seq_len 16"):
            model(torch.randint(0, 64, (1, 10)), cache=cache.view(0, 1))
    assert list(cache.lengths) == [10]


@pytest.mark.parametrize("fuse", [False, True])
def test_a_tree_pass_needs_room_for_its_depth_not_its_width(fuse: bool) -> None:
    """Four alternatives for the next token all sit at one position: after 14 tokens of a
    16-token window they fit, op by op as in the fused pass; a branch of three does not."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=64, max_seq_len=16)).eval()
    model.fuse = fuse
    prefix, nodes = torch.randint(0, 64, (1, 14)), torch.randint(0, 64, (1, 4))
    cache = KVCache(model.cfg, 1, 32)
    with torch.no_grad():
        model(prefix, cache=cache.view(0))
        tree = model(nodes, cache=cache.view(0), parents=[-1, -1, -1, -1])[0]
        for i in range(4):
            alone = model(torch.cat([prefix, nodes[:, i : i + 1]], 1))[0, -1]
            assert torch.allclose(tree[i], alone, atol=1e-5), i
        cache.truncate(0, 14)
        with pytest.raises(ValueError, match="positions: 16 >= max_seq_len 16"):
            model(nodes[:, :3], cache=cache.view(0), parents=[-1, 0, 1])
    assert cache.lengths == [14]


@needs_kernel
def test_weights_changed_has_the_kernels_read_weights_their_counters_did_not_see() -> None:
    """A fused AdamW step and writes through ``.data`` leave the weights' version counters
    alone; after `weights_changed` the fused passes compute with the weights now in place."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny()).eval()
    tokens = torch.randint(0, 256, (2, 5))

    def decoded(fuse: bool) -> torch.Tensor:
        model.fuse = fuse
        try:
            with torch.no_grad():
                return model(tokens, cache=KVCache(model.cfg, 2, 16).view(0, 2))
        finally:
            model.fuse = True

    decoded(True)  # packs the weights as they are
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    model(tokens).square().mean().backward()
    opt.step()
    model.weights_changed()
    torch.testing.assert_close(decoded(True), decoded(False), rtol=1e-4, atol=1e-4)
    model.layers[0].attn.wqkv.weight.data.mul_(2.0)
    model.weights_changed()
    torch.testing.assert_close(decoded(True), decoded(False), rtol=1e-4, atol=1e-4)
