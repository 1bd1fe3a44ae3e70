from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from codedojo.engine.speculative import (
    DraftHead,
    DraftTree,
    HiddenHistory,
    MTPDrafter,
    SpeculativeSession,
    TransformerTarget,
    accept_drafts,
    plain_generate,
    replay_greedy,
    speculative_generate,
    target_probs,
)
from codedojo.model.config import ModelConfig
from codedojo.model.mtp import MTP
from codedojo.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

def _setup(vocab: int = 5, seed: int = 0, scale: float = 3.0, taps: tuple[int, ...] = ()):
    """A one-layer model and its drafter; with ``taps``, a two-layer one whose drafter's
    modules read those layers (their projections away from zero too)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.tiny(vocab_size=vocab, dim=16, n_layers=2 if taps else 1, n_heads=2,
                           n_kv_heads=1, ffn_dim=32, n_mtp=2, max_seq_len=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # peakier, but not degenerate, next-token distributions
        model.tok_embeddings.weight.mul_(scale / 0.02 * 0.05)
    mtp = MTP(cfg, taps=taps).eval()
    with torch.no_grad():  # make the drafts disagree often
        for p in mtp.parameters():
            p.add_(0.3 * torch.randn_like(p))
    target = TransformerTarget(model, taps=taps)
    return target, MTPDrafter(mtp, DraftHead(model))


def test_greedy_speculative_equals_plain_greedy():
    target, drafter = _setup(vocab=32, seed=1)
    prompt = [3, 7, 1, 4]
    plain = plain_generate(target, prompt, 40)
    res = speculative_generate(target, drafter, prompt, 40)
    assert res.tokens == plain
    assert res.stats.target_passes < 40 or res.stats.accepted == 0
    assert res.stats.emitted == res.stats.accepted + res.stats.rounds
    for n in (0, 1):  # (the reference as the engine: no more tokens than asked for)
        assert plain_generate(target, prompt, n) == plain[:n]
        assert speculative_generate(target, drafter, prompt, n).tokens == plain[:n]


def test_bfloat16_drafts_for_a_float32_target_keep_greedy_output():
    """Drafts in bfloat16 (half the bytes a draft reads) verified by a float32 target: the
    output is still plain greedy decoding, and the drafts really ran in bfloat16."""
    target, drafter = _setup(vocab=32, seed=1)
    model, bf16 = target.model, torch.bfloat16
    drafter = MTPDrafter(drafter.mtp.to(bf16), DraftHead(model, dtype=bf16))
    assert all(t.dtype == bf16 for t in drafter.head.tensors())
    prompt = [3, 7, 1, 4]
    res = speculative_generate(target, drafter, prompt, 40)
    assert res.tokens == plain_generate(target, prompt, 40)
    assert res.stats.accepted > 0
    assert drafter.caches[0].k.dtype == bf16 and drafter.hidden[1][0:1].dtype == bf16


@pytest.mark.parametrize("fuse", [True, False])
def test_greedy_tree_speculation_equals_plain_greedy(fuse: bool):
    """Rounds over a draft tree emit plain greedy decoding's tokens, through the kernels and
    op by op, and catch the target's token among the lower-ranked drafts where the top one
    misses (any first node passes more often than the top one). Near the end of the cache
    (46 tokens) a tree would not fit beside the sequence: those rounds draft chains."""
    target, drafter = _setup(vocab=32, seed=6)  # its top drafts miss, its second ones pass
    target.model.fuse = drafter.mtp.fuse = fuse
    prompt = [3, 7, 1, 4]
    plain = plain_generate(target, prompt, 40)
    target = TransformerTarget(target.model, max_len=len(prompt) + 40 + 2)
    sess = SpeculativeSession(target, drafter, tree=DraftTree.best(2, 7))
    out = [sess.prefill(prompt)]
    while len(out) < 40:
        out += sess.round(40 - len(out))
    st = sess.stats
    assert out[:40] == plain
    assert st.top_first < st.passed[0] and st.emitted > st.rounds
    assert st.emitted == st.accepted + st.rounds
    # a tree round is as deep as its tree (2), and the target verifies its every node (7)
    assert st.drafted <= 2 * st.rounds < st.verified <= 7 * st.rounds
    target.model.fuse = drafter.mtp.fuse = True


@pytest.mark.parametrize("fuse", [True, False])
def test_drafts_read_the_tapped_layers_at_their_positions(fuse: bool):
    """Modules that read a lower layer draft, round after round, what their training forward
    over the whole sequence gives (module k at position i reads the layer's state at i), through
    the kernels and op by op; the tapped states change the drafts, and a target that does not
    return them is refused by name."""
    target, drafter = _setup(vocab=32, seed=1, taps=(0,))
    model, mtp = target.model, drafter.mtp
    model.fuse = mtp.fuse = fuse
    tokens = [3, 7, 1, 4, 9, 2]
    pick = lambda lg: (int(lg.argmax()), lg)  # noqa: E731
    with torch.no_grad():
        _, hidden = target.extend(tokens[:-1])
        assert hidden.shape == (5, 2 * model.cfg.dim)
        for _ in range(2):  # a second round catches up on the positions the first left out
            L = len(tokens)
            drafts, q = drafter.draft(hidden, tokens, pick, 2)
            seq = torch.tensor([tokens + drafts[:1]])
            outs = mtp(model.hidden(seq, taps=(0,)), seq, torch.arange(L + 1)[None], model.embed)
            for k, logits in enumerate(q):
                torch.testing.assert_close(logits, model.head(outs[k][0, L - 2]),
                                           rtol=1e-4, atol=1e-4)
            target.truncate(L - 1)
            tokens = tokens + [drafts[0], 5]
            _, hidden = target.extend(tokens[L - 1:-1])
        blind = MTPDrafter(mtp, DraftHead(model))
        _, hidden = TransformerTarget(model, taps=(0,)).extend(tokens[:-1])
        hidden[:, model.cfg.dim:] = 0  # the tapped layer's states gone
        _, q_blind = blind.draft(hidden, tokens, pick, 2)
        assert not torch.allclose(q_blind[0], q[0])
        _, last = TransformerTarget(model).extend(tokens[:-1])
        with pytest.raises(ValueError, match=r"layers \[0\]"):
            MTPDrafter(mtp, DraftHead(model)).draft(last, tokens, pick, 2)
    model.fuse = mtp.fuse = True


@pytest.mark.parametrize("taps", [(), (0,)])
def test_a_trees_top_branch_is_the_chain(taps: tuple[int, ...]):
    """The rank-0 branch of a tree is the chain the same modules draft; the nodes under one
    parent are its distinct most likely drafts, by rank. With modules that read a lower layer
    too: a node reads that layer's state at its position, as the chain does."""
    target, drafter = _setup(vocab=32, seed=2, taps=taps)
    _, twin = _setup(vocab=32, seed=2, taps=taps)
    tokens = [3, 7, 1, 4, 9, 2]
    with torch.no_grad():
        _, hidden = target.extend(tokens[:-1])
        tree = DraftTree.best(2, 7)
        nodes = drafter.draft_tree(hidden, tokens, tree)
        chain, q = twin.draft(hidden, tokens, lambda lg: (int(lg.argmax()), lg), 2)
    assert [nodes[tree.nodes.index((0,))], nodes[tree.nodes.index((0, 0))]] == chain
    first = [nodes[i] for i in tree.children(-1)]
    assert first == q[0].topk(len(first)).indices.tolist()


def test_draft_trees_are_the_likeliest_nodes_and_refuse_orphans():
    tree = DraftTree.best(2, 5, rank_acceptance=(0.6, 0.3, 0.05))
    # chances: (0,) .6, (0,0) .36, (1,) .3, (0,1) .18, (1,0) .18 (shallower first)
    assert tree.nodes == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert tree.parents == [-1, -1, 0, 0, 1] and tree.depth == 2
    assert tree.children(0) == [2, 3] and tree.upto(1).nodes == [(0,), (1,)]
    assert tree.ancestors(4) == [1] and tree.ancestors(1) == []
    rates = (0.6, 0.3, 0.05)
    assert tree.expected_tokens(rates) == pytest.approx(1 + 0.6 + 0.3 + 0.36 + 0.18 + 0.18)
    assert tree.top_chain().nodes == [(0,), (0, 0)]
    assert tree.top_chain().expected_tokens(rates) == pytest.approx(1.96)
    with pytest.raises(ValueError, match=r"node \(1, 0\) has no parent"):
        DraftTree([(0,), (1, 0)])
    with pytest.raises(ValueError, match="ranks >= 0"):
        DraftTree([(-1,)])
    sess = SpeculativeSession(*_setup(), temperature=0.7, tree=tree)
    assert sess.tree is None  # sampling rounds draft chains


def _model_and_draft_vocab() -> tuple[Transformer, torch.Tensor]:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                           ffn_dim=32, max_seq_len=64)
    return Transformer(cfg).eval(), torch.tensor([1, 4, 9, 30])


def test_draft_head_copies_follow_new_weights():
    """A head of another type holds copies: `refresh` casts the model's new weights again."""
    model, vocab = _model_and_draft_vocab()
    same, half = DraftHead(model, vocab), DraftHead(model, vocab, torch.bfloat16)
    assert same.embed_weight.data_ptr() == model.tok_embeddings.weight.data_ptr()  # no copy
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(2.0)
        model.norm.weight.add_(1.0)
    half.refresh()
    emb, norm, head = half.tensors()
    assert torch.equal(emb, model.tok_embeddings.weight.to(torch.bfloat16))
    assert torch.equal(norm, model.norm.weight.to(torch.bfloat16))
    assert torch.equal(head, model.output_weight[vocab].to(torch.bfloat16))
    h = torch.randn(1, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(half(h)[..., vocab], model.head(h)[..., vocab],
                                   rtol=0.05, atol=0.05)


class OracleDrafter:
    """Drafts the target's own greedy continuation: every draft must be accepted (given the
    whole sequence: with a reused prefix the session shows drafters only the part after it)."""

    def __init__(self, target: TransformerTarget, depth: int):
        self.shadow, self.depth = TransformerTarget(target.model), depth

    def reset(self) -> None:
        pass

    def draft(self, new_hidden, tokens, pick, k):
        # `tokens` ends with the token the target has yet to run: the drafts follow it
        return plain_generate(self.shadow, tokens, k), [target_probs(torch.zeros(5), 0.0)] * k


def _cycling_setup() -> tuple[TransformerTarget, MTPDrafter]:
    """A target whose greedy text runs through a permutation of its vocabulary (24 distinct
    tokens in 60), and drafts right about half the time: a module passes its input token's
    embedding on, through a noisy projection, and the head maps it to the token after."""
    torch.manual_seed(1)
    cfg = ModelConfig.tiny(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                           ffn_dim=32, n_mtp=2, max_seq_len=128, tie_embeddings=False)
    model = Transformer(cfg).eval()
    assert model.output is not None
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(2.5)
        model.output.weight.copy_(model.tok_embeddings.weight[torch.randperm(32)])
    mtp = MTP(cfg).eval()
    with torch.no_grad():
        for m in mtp.layers:
            m.proj.weight.copy_(torch.cat([torch.zeros(16, 16), torch.eye(16)], 1)
                                + 0.3 * torch.randn(16, 32))
    return TransformerTarget(model), MTPDrafter(mtp, DraftHead(model))


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_rounds_replay_from_teacher_forced_drafts(k):
    """The drafter's greedy drafts are the training forward's argmax on the final sequence, so
    the engine's rounds are replayed exactly from per-position correctness; and the rounds'
    first-draft acceptance is not that correctness's mean (rounds skip what they accept)."""
    target, drafter = _cycling_setup()
    prompt, new = [3, 7, 1, 4], 60
    res = speculative_generate(target, drafter, prompt, new, num_draft=k)
    seq = torch.tensor([prompt + res.tokens])
    model, mtp = target.model, drafter.mtp
    with torch.no_grad():
        _, hidden = model(seq, return_hidden=True)
        states = mtp(hidden, seq, torch.arange(seq.shape[1])[None], model.embed)
        hits = [(model.head(h)[0].argmax(-1)[:-1] == seq[0, j + 2:]).tolist()
                for j, h in enumerate(states)]
    replayed = replay_greedy(hits, len(prompt), seq.shape[1], k)
    s = res.stats
    assert len(set(res.tokens)) > 10 and 0 < s.accepted < s.drafted  # pass and fail
    assert (replayed.rounds, replayed.drafted, replayed.accepted, replayed.emitted,
            replayed.reached, replayed.passed) == (s.rounds, s.drafted, s.accepted, s.emitted,
                                                   s.reached, s.passed)
    first = hits[0][len(prompt) - 1:seq.shape[1] - 2]  # every generated token after the first
    if k == 2:
        assert replayed.accept_first != pytest.approx(sum(first) / len(first))
    with pytest.raises(ValueError, match="k: 3 drafts a round"):
        replay_greedy(hits, len(prompt), seq.shape[1], 3)


def test_stats_with_perfect_drafts():
    target, _ = _setup(vocab=5)
    res = speculative_generate(target, OracleDrafter(target, 2), [1, 2], 13)
    assert res.tokens == plain_generate(target, [1, 2], 13)
    s = res.stats
    assert s.accept_first == 1.0 and s.accept_rate == 1.0 and s.tokens_per_pass == 3.0


def test_acceptance_rule_reproduces_target_single_step():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.2, 0.6], dtype=torch.float64)
    counts = torch.zeros(4)
    n = 6000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        acc, extra = accept_drafts([d], [q], p, 1.0, gen)
        counts[d if acc == 1 else extra] += 1
    assert chisquare(counts.numpy(), (p[0] * n).numpy()).pvalue > 1e-3


class MarkovTarget:
    """A first-order Markov chain as a `Target`: cheap enough for thousands of samples."""

    def __init__(self, P: torch.Tensor):
        self.logp, self.n = P.log(), 0

    @property
    def length(self) -> int:
        return self.n

    def reset(self) -> None:
        self.n = 0

    def extend(self, ids, last_only=False):
        self.n += len(ids)
        return self.logp[list(ids)[-1:] if last_only else list(ids)], torch.zeros(len(ids), 1)

    def truncate(self, length: int) -> None:
        assert length <= self.n
        self.n = length


class MarkovDrafter:
    depth = 2

    def __init__(self, Q: torch.Tensor):
        self.logq = Q.log()

    def reset(self) -> None:
        pass

    def draft(self, new_hidden, tokens, pick, k):
        prev, ds, qs = tokens[-1], [], []
        for _ in range(k):
            d, q = pick(self.logq[prev])
            ds.append(d)
            qs.append(q)
            prev = d
        return ds, qs


@pytest.mark.parametrize(("temperature", "draft_vocab"), [(0.7, [0, 1, 2]), (0.7, [0, 1])])
def test_speculative_sampling_matches_target_distribution(temperature, draft_vocab):
    """Chi-square over the joint of 3 generated tokens (27 cells): drafts from a different
    chain, rejections, residual resampling, bonus tokens and truncation at max_new_tokens.
    A draft vocabulary that leaves token 2 out (it is never drafted, only resampled) keeps
    the target distribution too."""
    g = torch.Generator().manual_seed(0)
    V, n_new = 3, 3
    P = torch.rand(V, V, generator=g, dtype=torch.float64) + 0.2
    P /= P.sum(-1, keepdim=True)
    Q = torch.rand(V, V, generator=g, dtype=torch.float64) + 0.05
    Q[:, [t for t in range(V) if t not in draft_vocab]] = 0.0
    Q /= Q.sum(-1, keepdim=True)
    Pt = target_probs(P.log(), temperature)
    expected = {}
    for seq in itertools.product(range(V), repeat=n_new):
        prob, prev = 1.0, 0
        for t in seq:
            prob, prev = prob * float(Pt[prev, t]), t
        expected[seq] = prob
    target, drafter = MarkovTarget(P), MarkovDrafter(Q)
    n = 2000
    counts = dict.fromkeys(expected, 0)
    accepted = drafted = 0
    for _ in range(n):
        res = speculative_generate(target, drafter, [0], n_new, temperature, g)
        counts[tuple(res.tokens)] += 1
        accepted += res.stats.accepted
        drafted += res.stats.drafted
    assert 0.1 * drafted < accepted < 0.95 * drafted  # both branches well exercised
    keys = sorted(expected)
    obs = [counts[k] for k in keys]
    exp = [expected[k] * n for k in keys]
    assert abs(sum(exp) - n) < 1e-6 * n
    assert chisquare(obs, exp).pvalue > 1e-3
    # The same check fails for the draft chain's own distribution: the test has power.
    Qt = target_probs(Q.log(), temperature)
    wrong = []
    for seq in keys:
        prob, prev = 1.0, 0
        for t in seq:
            prob, prev = prob * float(Qt[prev, t]), t
        wrong.append(prob * n)
    assert chisquare(obs, wrong).pvalue < 1e-6


def test_draft_head_over_a_draft_vocabulary():
    model, vocab = _model_and_draft_vocab()
    h = torch.randn(1, 3, 16)
    with torch.no_grad():
        full, sub = model.head(h), DraftHead(model, vocab)(h)
    assert sub.shape == full.shape
    torch.testing.assert_close(sub[..., vocab], full[..., vocab])
    outside = torch.ones(40, dtype=torch.bool)
    outside[vocab] = False
    assert torch.isneginf(sub[..., outside]).all()
    assert set(target_probs(sub[0, -1], 0.0).nonzero().flatten().tolist()) <= set(vocab.tolist())


def test_hidden_history_grows_in_place_and_keeps_every_position():
    hist, rows = HiddenHistory(), torch.arange(300.0)[:, None].expand(300, 4)
    hist.write(0, rows[:50])
    first = hist.buf
    hist.write(50, rows[50:60])  # within the buffer: no new one
    assert hist.buf is first and hist.length == 60
    hist.write(57, rows[57:200])  # overwrites the last three, outgrows the buffer
    hist.write(200, rows[200:300])
    assert hist.length == 300 and hist.buf is not None and hist.buf.shape[0] >= 300
    assert torch.equal(hist[0:300], rows)
    hist.write(100, rows[:1] - 1)  # a rewrite drops the positions after it
    assert hist.length == 101 and float(hist[100:101][0, 0]) == -1
    # a range of step 1 is a view, like a slice; a list of positions is a copy
    assert hist[range(90, 100)].data_ptr() == hist[90:100].data_ptr() == hist.buf[90].data_ptr()
    assert torch.equal(hist[range(90, 100)], rows[90:100])
    assert torch.equal(hist[[99, 3, 3]], rows[[99, 3, 3]])
    assert hist[[5]].data_ptr() != hist.buf[5].data_ptr()
    with pytest.raises(ValueError, match="gap"):
        hist.write(102, rows[:1])
