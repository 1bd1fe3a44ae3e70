from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from codedojo.model.config import ModelConfig
from codedojo.model.mtp import (
    MTP,
    distill_loss,
    draft_counts,
    load_mtp,
    mtp_valid_mask,
    save_mtp,
)
from codedojo.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(blocks: int = 1):
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=50, n_layers=2, n_mtp=2)
    return Transformer(cfg).eval(), MTP(cfg, blocks=blocks).eval()


@pytest.mark.parametrize("blocks", [1, 2])
def test_cached_drafting_path_matches_training_forward(tmp_path, blocks):
    """Each module fed through its KV cache (a layer per block) in chunks equals the training
    forward; saved and loaded with its blocks."""
    model, mtp = _model(blocks)
    with torch.no_grad():  # the further blocks away from the identity, so that they count
        for p in mtp.parameters():
            p.add_(0.02 * torch.randn_like(p))
    tokens = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        _, hidden = model(tokens, return_hidden=True)
        pos = torch.arange(12)[None]
        full = mtp(hidden, tokens, pos, model.embed)
        assert [h.shape[1] for h in full] == [11, 10]
        caches = mtp.new_caches(64)
        # depth 1, fed in two chunks through its KV cache
        a = mtp.step(1, hidden[:, :5], model.embed(tokens[:, 1:6]), caches[0])
        b = mtp.step(1, hidden[:, 5:11], model.embed(tokens[:, 6:12]), caches[0])
        torch.testing.assert_close(torch.cat([a, b], 1), full[0], rtol=1e-5, atol=1e-5)
        c = mtp.step(2, full[0][:, :10], model.embed(tokens[:, 2:12]), caches[1])
        torch.testing.assert_close(c, full[1], rtol=1e-5, atol=1e-5)
    save_mtp(mtp, tmp_path)
    again = load_mtp(tmp_path, model.cfg)
    assert again is not None and again.depth == 2 and again.n_blocks == blocks
    assert all(torch.equal(x, y) for x, y in zip(mtp.state_dict().values(),
                                                 again.state_dict().values(), strict=True))
    half = load_mtp(tmp_path, model.cfg, torch.bfloat16)  # drafts in another type
    assert half is not None
    for (name, p), q in zip(mtp.named_parameters(), half.parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16)), name
    assert load_mtp(tmp_path / "none", model.cfg) is None


def test_distillation_pulls_modules_toward_main_head():
    model, mtp = _model()
    mtp.train()
    model.requires_grad_(False)  # as in the distill stage: the main model is a frozen teacher
    tokens = torch.randint(0, 50, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[:, 7] = False  # a document boundary
    assert mtp_valid_mask(mask, 2)[:, 5:8].sum() == 0
    opt = torch.optim.AdamW(mtp.parameters(), lr=3e-3)
    with torch.no_grad():
        logits, hidden = model(tokens, return_hidden=True)
    pos = torch.arange(16).expand(4, 16)
    losses = []
    for _ in range(15):
        hs = mtp(hidden, tokens, pos, model.embed)
        loss = distill_loss([model.head(h) for h in hs], logits, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]


def test_greedy_share_moves_the_loss_toward_the_teachers_top_token():
    """``greedy`` w: per position (1 - w) KL + w cross-entropy of the teacher's argmax, so the
    logits' gradient is q - ((1 - w) p + w onehot(argmax p)) at every trained position."""
    torch.manual_seed(1)
    B, T, V = 2, 9, 13
    teacher = torch.randn(B, T, V) * 3
    drafts = [torch.randn(B, T - k, V, requires_grad=True) for k in (1, 2)]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4] = False  # a boundary: rows whose targets cross it are not trained
    kl = distill_loss(drafts, teacher, mask)
    assert torch.equal(distill_loss(drafts, teacher, mask, 0.0), kl)
    ces = []
    for k, d in enumerate(drafts, start=1):
        m = mtp_valid_mask(mask, k)
        ce = torch.nn.functional.cross_entropy(d[m], teacher[:, k:][m].argmax(-1))
        ces.append(ce)
    ce = torch.stack(ces).mean()
    torch.testing.assert_close(distill_loss(drafts, teacher, mask, 1.0), ce)
    half = distill_loss(drafts, teacher, mask, 0.5)
    torch.testing.assert_close(half, 0.5 * kl + 0.5 * ce)
    half.backward()
    d = drafts[0]
    m = mtp_valid_mask(mask, 1)
    p = teacher[:, 1:].softmax(-1)
    target = 0.5 * p + 0.5 * torch.nn.functional.one_hot(p.argmax(-1), V)
    # the mean over depths (2) and over the depth's trained positions
    want = (d.softmax(-1) - target) * m[..., None] / (2 * m.sum())
    torch.testing.assert_close(d.grad, want.detach())
    with pytest.raises(ValueError, match="greedy 1.5 outside"):
        distill_loss(drafts, teacher, mask, 1.5)


def test_detached_modules_learn_their_own_depth_only():
    """With ``detach`` the second module's loss sends module 1 no gradient (without it, it
    does); module 2 still learns, and the states computed are the same either way."""
    model, mtp = _model()
    mtp.train()
    tokens = torch.randint(0, 50, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        _, hidden = model(tokens, return_hidden=True)
    outs = {}
    for detach in (False, True):
        mtp.zero_grad(set_to_none=True)
        hs = mtp(hidden, tokens, pos, model.embed, detach=detach)
        hs[1].pow(2).mean().backward()  # a loss on depth 2 alone
        first, second = mtp.layers
        reached = [p.grad is not None and bool(p.grad.abs().sum() > 0)
                   for p in first.parameters()]
        assert any(reached) != detach
        assert all(p.grad is not None and bool(p.grad.abs().sum() > 0)
                   for p in second.proj.parameters())
        outs[detach] = [h.detach() for h in hs]
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)


def test_draft_vocabulary_is_saved_and_bounded(tmp_path):
    cfg = ModelConfig.tiny(vocab_size=50, n_layers=2, n_mtp=2)
    mtp = MTP(cfg, 2, draft_vocab=5)
    counts = torch.zeros(50)
    counts[[3, 17, 40, 41, 8]] = torch.tensor([9.0, 8, 7, 6, 5])
    mtp.set_draft_vocab(counts)
    assert mtp.draft_vocab.tolist() == [3, 8, 17, 40, 41]
    save_mtp(mtp, tmp_path)
    again = load_mtp(tmp_path, cfg)
    assert again is not None and again.draft_vocab.tolist() == [3, 8, 17, 40, 41]
    with pytest.raises(ValueError, match="draft_vocab"):
        MTP(cfg, 2, draft_vocab=51)
    with pytest.raises(ValueError, match="without a draft vocabulary"):
        MTP(cfg, 2).set_draft_vocab(counts)


def test_the_draft_vocabulary_is_chosen_from_text_not_padding():
    from codedojo.data.packing import pack

    # whole documents: the second does not fit beside the first, so both rows end in padding
    # (the pad id 0, also a token of the text, once)
    packed = pack([np.array([5, 6, 7, 5]), np.array([6, 7, 0])], seq_len=5, allow_split=False)
    assert (packed.tokens[packed.segments < 0] == 0).sum() == 5
    counts = draft_counts(packed.tokens, packed.segments, 10)
    assert counts.tolist() == [1, 0, 0, 0, 0, 2, 2, 2, 0, 0]
    mtp = MTP(ModelConfig.tiny(vocab_size=10, n_layers=2, n_mtp=1), 1, draft_vocab=3)
    mtp.set_draft_vocab(counts)
    assert mtp.draft_vocab.tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="do not line up"):
        draft_counts(packed.tokens, packed.segments[:1], 10)


def test_modules_read_tapped_layers_through_projections_that_start_at_zero(tmp_path):
    """``taps``: each module adds a projection of the tapped layers' states (normed) to what it
    reads of the previous depth. It starts at zero, so new modules draft as they did without
    them; trained, it changes the drafts, the cached drafting path reads the states at its
    positions as the training forward does, and the checkpoint keeps the taps."""
    model, plain = _model()
    mtp = MTP(model.cfg, taps=(0,)).eval()
    missing = mtp.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["layers.0.fuse.weight", "layers.1.fuse.weight"]
    tokens = torch.randint(0, 50, (1, 12))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        hidden = model.hidden(tokens, taps=(0,))
        assert hidden.shape == (1, 12, 2 * model.cfg.dim)
        for a, b in zip(mtp(hidden, tokens, pos, model.embed),
                        plain(hidden[..., :model.cfg.dim], tokens, pos, model.embed),
                        strict=True):
            assert torch.equal(a, b)
        for layer in mtp.layers:
            layer.fuse.weight.normal_(std=0.5)
        full = mtp(hidden, tokens, pos, model.embed)
        assert not torch.allclose(full[0], plain(hidden[..., :64], tokens, pos, model.embed)[0])
        caches = mtp.new_caches(64)
        D = model.cfg.dim
        h, tapped = hidden[..., :D], hidden[..., D:]
        a = mtp.step(1, h[:, :5], model.embed(tokens[:, 1:6]), caches[0], tapped=tapped[:, :5])
        b = mtp.step(1, h[:, 5:11], model.embed(tokens[:, 6:12]), caches[0],
                     tapped=tapped[:, 5:11])
        torch.testing.assert_close(torch.cat([a, b], 1), full[0], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"layers \[0\]' expected, 128 wide"):
            mtp(h, tokens, pos, model.embed)
        with pytest.raises(ValueError, match="tapped layers' states"):
            mtp.step(2, full[0][:, :10], model.embed(tokens[:, 2:12]), caches[1])
    save_mtp(mtp, tmp_path)
    again = load_mtp(tmp_path, model.cfg)
    assert again is not None and again.taps == (0,)
    assert all(torch.equal(x, y) for x, y in zip(mtp.state_dict().values(),
                                                 again.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="taps"):
        MTP(model.cfg, taps=(2,))  # the model has layers 0 and 1


def test_further_blocks_start_as_the_identity(tmp_path):
    """Modules given a second block draft exactly as their one-block selves did, from the
    one-block modules' weights (`mtp.json` without ``blocks``, as before modules stacked them,
    reads as one); once the new block's weights move, the drafts do too."""
    model, one = _model()
    with torch.no_grad():
        for p in one.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_mtp(one, tmp_path)
    meta = json.loads((tmp_path / "mtp.json").read_text())
    (tmp_path / "mtp.json").write_text(json.dumps({k: v for k, v in meta.items()
                                                   if k != "blocks"}))
    loaded = load_mtp(tmp_path, model.cfg)
    assert loaded is not None and loaded.n_blocks == 1
    two = MTP(model.cfg, blocks=2).eval()
    res = two.load_state_dict(one.state_dict(), strict=False)
    assert res.unexpected_keys == [] and res.missing_keys
    assert all(".extra_blocks.0." in k for k in res.missing_keys)
    tokens = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        _, hidden = model(tokens, return_hidden=True)
        pos = torch.arange(12)[None]
        want = one(hidden, tokens, pos, model.embed)
        for m in (loaded, two):
            for a, b in zip(m(hidden, tokens, pos, model.embed), want, strict=True):
                assert torch.equal(a, b)
        two.layers[0].extra_blocks[0].mlp.w_down.weight.normal_(std=0.1)
        assert not torch.equal(two(hidden, tokens, pos, model.embed)[0], want[0])
    with pytest.raises(ValueError, match="blocks 0"):
        MTP(model.cfg, blocks=0)


def test_a_fresh_modules_attention_biases_start_at_zero():
    """Norm scales at one, biases at zero (a model with attention biases: Qwen2's), in the
    further blocks too, which `init_from_model` leaves as they are made."""
    cfg = ModelConfig.tiny(attn_bias=True, n_mtp=1)
    mtp = MTP(cfg, 1, blocks=2)
    biases = {n: p for n, p in mtp.named_parameters() if n.endswith(".bias")}
    assert biases and all(not p.any() for p in biases.values())
    norms = [p for n, p in mtp.named_parameters() if "norm" in n and p.ndim == 1]
    assert norms and all(bool((p == 1).all()) for p in norms)
