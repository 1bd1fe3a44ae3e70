"""The fused decode layers equal the layers run op by op: hidden states, logits, and the
keys/values they write into the cache, for rows at different lengths, several tokens per row
(verification passes) and models with q/k/v biases."""

from __future__ import annotations

import pytest
import torch

import codedojo.model.transformer as transformer
from codedojo.model.config import ModelConfig, RopeScaling
from codedojo.model.kv_cache import KVCache
from codedojo.model.transformer import Transformer
from codedojo.ops import FusedLayers
from tests.ops.conftest import needs_kernel


def _decode(model: Transformer, cache: KVCache, tokens: torch.Tensor, start: int
            ) -> torch.Tensor:
    return model.hidden(tokens, cache=cache.view(start, start + tokens.shape[0]))


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time a FusedLayers object runs."""
    calls: list[int] = []
    real = FusedLayers.__call__
    monkeypatch.setattr(FusedLayers, "__call__",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _prefill(model: Transformer, cache: KVCache, lengths: list[int], start: int) -> None:
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):
        prompt = torch.randint(0, model.cfg.vocab_size, (1, n), generator=g)
        model.hidden(prompt, cache=cache.view(start + i))


@needs_kernel
@pytest.mark.parametrize("cfg", [
    ModelConfig.tiny(),
    ModelConfig.tiny(attn_bias=True, n_kv_heads=1, dim=48, n_heads=4, ffn_dim=72),
    ModelConfig.tiny(head_dim=24, n_heads=6, n_kv_heads=3, n_layers=3,
                     rope_scaling=RopeScaling(kind="yarn", factor=4.0,
                                              original_max_seq_len=64)),
], ids=["gqa", "bias-mqa-odd-widths", "head-dim-yarn"])
@pytest.mark.parametrize(("lengths", "start", "new"), [([5], 0, 1), ([3], 2, 1), ([1, 7, 4], 1, 1),
                                                       ([9, 2, 6, 6, 1], 0, 1), ([6], 0, 5),
                                                       ([2, 8], 3, 3)])
def test_fused_decode_matches_layers(cfg: ModelConfig, lengths: list[int], start: int, new: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their init values
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    fused, plain = KVCache(cfg, 8, 64), KVCache(cfg, 8, 64)
    tokens = torch.randint(0, cfg.vocab_size, (len(lengths), new))
    calls = _count_calls(monkeypatch)
    got, want = [], []
    with torch.no_grad():
        for cache, out in ((fused, got), (plain, want)):
            model.fuse = cache is fused
            _prefill(model, cache, lengths, start)
            out.append(_decode(model, cache, tokens, start))
            view = cache.view(start, start + len(lengths))
            out += model(tokens + 1, cache=view, return_hidden=True)[::-1]  # hidden, logits
    assert len(calls) == 2 + len(lengths)  # both passes, and each (short) prefill, were fused
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert fused.lengths == plain.lengths
    for i, n in enumerate(lengths):
        s = start + i
        end = n + 2 * new
        torch.testing.assert_close(fused.k[:, s, :, :end], plain.k[:, s, :, :end],
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused.v[:, s, :, :end], plain.v[:, s, :, :end],
                                   rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("gain", [1.0, 30.0])
def test_fused_decode_long_context_and_saturated_activations(gain: float) -> None:
    """Contexts past one 16-wide vector of attention scores, and gate values far into SwiGLU's
    saturation (the kernel's own exponential, clamped at the float range)."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny()
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.w_gate_up.weight.mul_(gain)
            layer.attn.wqkv.weight.mul_(gain ** 0.5)
    tokens = torch.randint(0, cfg.vocab_size, (1, 3))
    out = []
    with torch.no_grad():
        for fused in (True, False):
            model.fuse = fused
            cache = KVCache(cfg, 1, 64)
            _prefill(model, cache, [45], 0)
            out.append(_decode(model, cache, tokens, 0))
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5 * gain)


@needs_kernel
@pytest.mark.parametrize("new", [1, 3])
def test_fused_decode_in_bfloat16_matches_float32_layers(new: int,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """bfloat16 weights and caches, widened to float32 as the kernel reads them, against the
    layers run op by op in float32 over the same (widened) weights: equal up to the bfloat16
    rounding of the cached keys/values and of the result."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(attn_bias=True)
    low = Transformer(cfg).eval()
    with torch.no_grad():
        for p in low.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    low = low.bfloat16()
    ref = Transformer(cfg).eval()
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    tokens = torch.randint(0, cfg.vocab_size, (2, new))
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        cache = KVCache(cfg, 4, 64, dtype=torch.bfloat16)
        _prefill(low, cache, [5, 9], 1)
        got = _decode(low, cache, tokens, 1)
        ref.fuse = False
        plain = KVCache(cfg, 4, 64)
        _prefill(ref, plain, [5, 9], 1)
        want = _decode(ref, plain, tokens, 1)
    assert len(calls) == 3 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache.k[:, 1:3].float(), plain.k[:, 1:3], rtol=2e-2, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4, 40])
def test_a_pass_over_several_tokens_equals_one_token_steps_bit_for_bit(dtype: torch.dtype,
                                                                      n: int) -> None:
    """What makes a verification pass give exactly the hidden states (and cache entries) of
    one-token decode steps: greedy speculative decoding then emits plain greedy decoding's
    tokens, in bfloat16 too. A pass of 40 tokens (a short prefill) is one call too."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(attn_bias=True, dim=96, n_heads=4, n_kv_heads=2, ffn_dim=200)
    model = Transformer(cfg).eval().to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (1, n))
    with torch.no_grad():
        a, b = KVCache(cfg, 1, 64, dtype=dtype), KVCache(cfg, 1, 64, dtype=dtype)
        _prefill(model, a, [7], 0)
        _prefill(model, b, [7], 0)
        together = _decode(model, a, tokens, 0)
        steps = torch.cat([_decode(model, b, tokens[:, i:i + 1], 0) for i in range(n)], 1)
    assert torch.equal(together, steps)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_pass_gives_each_node_its_branchs_states_bit_for_bit(dtype: torch.dtype) -> None:
    """A tree of new tokens in one call (a draft tree's verification): each node's hidden
    state is exactly what decoding its branch alone gives, and what the layers run op by op
    give up to rounding; `keep` then leaves the cache entries the branch alone writes. So a
    greedy tree round accepts exactly the tokens plain greedy decoding emits."""
    from tests.model.test_transformer import TREE_PARENTS

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(attn_bias=True, dim=96, n_heads=4, n_kv_heads=2, ffn_dim=200)
    model = Transformer(cfg).eval().to(dtype)
    nodes = torch.randint(0, cfg.vocab_size, (1, len(TREE_PARENTS)))
    branch = [0, 1, 5]  # node 5's ancestors and itself
    with torch.no_grad():
        tree, alone = KVCache(cfg, 1, 64, dtype=dtype), KVCache(cfg, 1, 64, dtype=dtype)
        _prefill(model, tree, [7], 0)
        _prefill(model, alone, [7], 0)
        ref = KVCache(cfg, 1, 64, dtype=dtype)
        _prefill(model, ref, [7], 0)
        got = model.hidden(nodes, cache=tree.view(0), parents=TREE_PARENTS)[0]
        want = _decode(model, alone, nodes[:, branch], 0)[0]
        model.fuse = False
        try:
            layers = model.hidden(nodes, cache=ref.view(0), parents=TREE_PARENTS)[0]
        finally:
            model.fuse = True
    assert torch.equal(got[branch], want)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, layers, rtol=tol, atol=tol)
    tree.keep(0, 7, [7 + i for i in branch])
    assert tree.lengths == alone.lengths == [10]
    assert torch.equal(tree.k[:, :, :, :10], alone.k[:, :, :, :10])
    assert torch.equal(tree.v[:, :, :, :10], alone.v[:, :, :, :10])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 1]], ids=["chain", "tree"])
def test_fused_passes_return_the_tapped_layers_states(dtype: torch.dtype,
                                                     parents: list[int] | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``taps``, a pass returns the outputs of those layers after the last hidden states
    (what MTP modules reading lower layers take): in one C++ call, equal to the layers' outputs
    op by op, the last states and logits unchanged, and bad taps refused by name."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(dim=96, n_heads=4, n_kv_heads=2, ffn_dim=200, n_layers=4)
    model = Transformer(cfg).eval().to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (1, 4))
    seen: dict[int, torch.Tensor] = {}
    hooks = [model.layers[i].register_forward_hook(
        lambda _m, _a, y, i=i: seen.__setitem__(i, y)) for i in range(cfg.n_layers)]
    calls = _count_calls(monkeypatch)
    out = {}
    with torch.no_grad():
        for fuse, taps in ((True, (0, 2)), (True, ()), (False, (0, 2))):
            model.fuse = fuse
            cache = KVCache(cfg, 1, 64, dtype=dtype)
            _prefill(model, cache, [5], 0)
            out[fuse, taps] = model(tokens, cache=cache.view(0), return_hidden=True,
                                    parents=parents, taps=taps)
    for h in hooks:
        h.remove()
    assert len(calls) == 4  # the fused passes and their prefills
    (logits, feats), (plain_logits, last) = out[True, (0, 2)], out[True, ()]
    D = cfg.dim
    assert feats.shape == (1, 4, 3 * D)
    assert torch.equal(feats[..., :D], last) and torch.equal(logits, plain_logits)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    by_op = out[False, (0, 2)][1]
    torch.testing.assert_close(feats, by_op, rtol=tol, atol=tol)
    assert torch.equal(by_op[..., D:2 * D], seen[0]) and torch.equal(by_op[..., 2 * D:], seen[2])
    model.fuse = True
    for bad in ((2, 0), (1, 1), (4,)):
        with pytest.raises(ValueError, match="taps"):
            model(tokens, cache=KVCache(cfg, 1, 64, dtype=dtype).view(0), taps=bad)
        with pytest.raises(ValueError, match="taps"):
            model.hidden(tokens, taps=bad)


@needs_kernel
def test_fused_decode_steps_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training, MoE layers, passes too long for the kernel and caches of another type than the
    weights run the layers op by op (or, the last, not at all)."""
    from codedojo.model.config import MoEConfig

    cfg = ModelConfig.tiny()
    model = Transformer(cfg)
    calls = _count_calls(monkeypatch)

    def run(m: Transformer, T: int) -> None:
        cache = KVCache(m.cfg, 1, 64)
        m(torch.randint(0, cfg.vocab_size, (1, T)), cache=cache.view(0))
        assert cache.lengths == [T]

    run(model, 1)  # gradients enabled
    assert calls == []
    with torch.no_grad():
        run(model, 1)
        run(model, 40)  # a short prefill: one call too
        assert len(calls) == 2
        monkeypatch.setattr(transformer, "FUSED_TOKENS", 16)
        run(model, 17)
        run(Transformer(ModelConfig.tiny(moe=MoEConfig(n_routed_experts=4, expert_ffn_dim=32))),
            1)
        fused = model.fused_layers(0, model._build_fused)
        assert fused is not None and fused.takes(KVCache(cfg, 1, 8).k)
        assert not fused.takes(KVCache(cfg, 1, 8, dtype=torch.bfloat16).k)
    assert len(calls) == 2
    assert not fused.takes(KVCache(cfg, 1, 8).k)  # gradients on


def _fused(cfg: ModelConfig) -> FusedLayers:
    model = Transformer(cfg)
    fused = model.fused_layers(0, model._build_fused)
    assert fused is not None
    return fused


@needs_kernel
def test_fused_decode_rejects_bad_input() -> None:
    """Errors that name what is wrong, for the tensors at build time and for each call."""
    cfg = ModelConfig.tiny()
    model = Transformer(cfg)
    weights = [t for layer in model.layers for t in layer.decode_weights()]  # type: ignore[union-attr]
    rope = (model.rotary.cos, model.rotary.sin, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps)
    with pytest.raises(RuntimeError, match="layer 0 wqkv"):
        FusedLayers.build([weights[0], weights[1][:-1]] + weights[2:], *rope)
    # as many elements in another shape: read as the shape it should have, out of bounds
    with pytest.raises(RuntimeError, match=r"layer 0 wqkv .* of shape \(128, 64\)"):
        FusedLayers.build([weights[0], weights[1].T.contiguous()] + weights[2:], *rope)
    with pytest.raises(RuntimeError, match=r"layer 0 w_gate_up .* of shape \(256, 64\)"):
        FusedLayers.build(weights[:5] + [weights[5].reshape(-1)] + weights[6:], *rope)
    with pytest.raises(RuntimeError, match="cannot share"):
        FusedLayers.build(weights, *rope[:2], cfg.n_heads, cfg.n_heads - 1, cfg.norm_eps)
    fused = _fused(cfg)
    cache = KVCache(cfg, 1, 16)
    kv = (cache.k, cache.v)
    with torch.no_grad():
        for call, error in [
            (lambda: fused(*kv, [0], [99], tokens=[1]), "position 99 outside"),
            (lambda: fused(*kv, [1], [0], tokens=[1]), "slot 1 outside"),
            (lambda: fused(*kv, [0], [0], tokens=[cfg.vocab_size]), "outside the vocabulary"),
            (lambda: fused(*kv, [0], [0], tokens=[1], logit_rows=[1]), "logits asked of row 1"),
            (lambda: fused(*kv, [0, 0], [0], tokens=[1, 2]), "a slot and a position for each"),
            (lambda: fused(*kv, [0], [0]), "either x or tokens"),
            (lambda: fused(*kv, [0], [0], x=torch.randn(1, cfg.dim + 1)), r"x must be \(N, "),
        ]:
            with pytest.raises(RuntimeError, match=error):
                call()
        no_head = FusedLayers.build(weights, *rope)
        assert no_head is not None
        with pytest.raises(RuntimeError, match="no output head"):
            no_head(*kv, [0], [0], x=torch.randn(1, cfg.dim), logit_rows=[0])
        with pytest.raises(RuntimeError, match="no embedding table"):
            no_head(*kv, [0], [0], tokens=[1])
    # an MTP module's mix, with the projection of two tapped layers' states
    D, tok = cfg.dim, model.tok_embeddings.weight
    mix = [torch.ones(D), torch.ones(D), torch.randn(D, 2 * D)]
    with pytest.raises(RuntimeError, match=r"mix fuse must be \("):
        FusedLayers.build(weights, *rope, embed=tok, mix=[*mix, torch.randn(D, 2 * D + 1)])
    mixed = FusedLayers.build(weights, *rope, embed=tok, mix=[*mix, torch.randn(D, 2 * D)])
    assert mixed is not None
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=rf"x must be \(N, {3 * D}\)"):
            mixed(*kv, [0], [0], x=torch.randn(1, D), tokens=[1])  # the tapped states missing
        h, _ = mixed(*kv, [0], [0], x=torch.randn(1, 3 * D), tokens=[1])
    assert h.shape == (1, D)


_GREEDY = """
import json, sys, torch
from codedojo.engine.engine import Engine
from codedojo.engine.types import SamplingParams
from codedojo.model.config import ModelConfig
from codedojo.model.transformer import Transformer
from codedojo.ops import kernel_status
torch.manual_seed(0)
model = Transformer(ModelConfig.tiny())
eng = Engine(model, max_batch=4, max_seq_len=64)
out = eng.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9]], SamplingParams(max_tokens=12, temperature=0))
print(json.dumps({"kernel": kernel_status(), "tokens": [c.token_ids for c in out],
                  "logprobs": [c.logprobs for c in out]}))
"""


def _greedy(env: dict[str, str]) -> dict:
    import json
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _GREEDY], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_kernel
def test_engine_without_kernels_generates_the_same() -> None:
    """CODEDOJO_KERNELS=0 (or a machine that cannot build them): the op-by-op layers and
    F.linear give the same greedy tokens and logprobs."""
    fast, slow = _greedy({}), _greedy({"CODEDOJO_KERNELS": "0"})
    assert fast["kernel"] == "ready" and slow["kernel"].startswith("disabled")
    assert fast["tokens"] == slow["tokens"]
    for a, b in zip(fast["logprobs"], slow["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_fused_layers_follow_replaced_parameters_and_rope_tables() -> None:
    """Built once and reused; built again after ``load_state_dict(assign=True)`` (new
    parameter objects), a new ``rotary`` (a context extension) or ``.to()``; weights changed
    in place (an optimizer step) are packed again by the next call: the fused logits keep
    equal to the layers run op by op with the weights and tables now in place."""
    from codedojo.model.rope import Rotary

    torch.manual_seed(0)
    cfg = ModelConfig.tiny()
    model = Transformer(cfg).eval()
    first = model.fused_layers(0, model._build_fused)
    assert first is not None and model.fused_layers(0, model._build_fused) is first

    def agree() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (2, 5))
        out = []
        with torch.no_grad():
            for fuse in (True, False):
                model.fuse = fuse
                cache = KVCache(model.cfg, 2, 64, dtype=next(model.parameters()).dtype)
                cache.lengths = [3, 3]
                out.append(model(tokens, cache=cache.view(0, 2)))
        model.fuse = True
        torch.testing.assert_close(out[0].float(), out[1].float(), rtol=1e-4, atol=1e-4)

    agree()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randint(0, cfg.vocab_size, (1, 6))).square().mean().backward()
    opt.step()  # every matrix, the tied embedding and head too, changed in place
    assert model.fused_layers(0, model._build_fused) is first
    agree()
    model.load_state_dict({k: v.clone() * 1.5 for k, v in model.state_dict().items()},
                          assign=True)
    agree()
    model.rotary = Rotary(cfg.model_copy(update={"rope_theta": 100.0}))
    agree()
    model.to(torch.float64)  # not a type the kernels take: op by op
    assert model.fused_layers(0, model._build_fused) is None


@needs_kernel
@pytest.mark.parametrize(("draft_vocab", "dtype", "taps", "blocks"), [
    (None, torch.float32, (), 1), ([1, 4, 9, 30, 33], torch.float32, (), 1),
    ([1, 4, 9, 30, 33], torch.bfloat16, (), 1), (None, torch.float32, (0,), 1),
    ([1, 4, 9, 30, 33], torch.bfloat16, (0,), 1), (None, torch.float32, (), 2),
    ([1, 4, 9, 30, 33], torch.bfloat16, (0,), 2)])
def test_fused_mtp_drafts_equal_drafts_op_by_op(draft_vocab: list[int] | None,
                                                dtype: torch.dtype, taps: tuple[int, ...],
                                                blocks: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An MTP module's draft step in one C++ call (embedding, input projection, blocks, shared
    head): the same drafts and draft logits as the module run op by op, over two rounds (the
    second catching up on positions the first left out). Bfloat16 drafts for a float32 model
    too (the module and the head's copies in bfloat16); modules reading a tapped layer too
    (the target's states then carry it); modules of two blocks too."""
    from codedojo.engine.speculative import DraftHead, MTPDrafter
    from codedojo.model.mtp import MTP

    torch.manual_seed(0)
    cfg = ModelConfig.tiny(vocab_size=40, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48,
                           n_mtp=2, max_seq_len=64)
    model = Transformer(cfg).eval()
    mtp = MTP(cfg, taps=taps, blocks=blocks).eval()
    with torch.no_grad():
        for p in mtp.parameters():  # the taps' projections away from zero too, the blocks
            # after the first away from the identity
            p.add_(0.3 * torch.randn_like(p))
    mtp = mtp.to(dtype)
    vocab = None if draft_vocab is None else torch.tensor(draft_vocab)
    width = (1 + len(taps)) * cfg.dim
    hidden = [torch.randn(6, width), torch.randn(2, width)]
    tokens = [3, 7, 1, 4, 22, 9, 5]
    out = []
    calls = _count_calls(monkeypatch)
    for fuse in (True, False):
        mtp.fuse = fuse
        drafter = MTPDrafter(mtp, DraftHead(model, vocab, dtype), 64)
        seen: list[torch.Tensor] = []

        def pick(logits: torch.Tensor, seen: list[torch.Tensor] = seen
                 ) -> tuple[int, torch.Tensor]:
            seen.append(logits)
            return int(logits.argmax()), logits

        with torch.no_grad():
            first, _ = drafter.draft(hidden[0], tokens, pick, 2)
            second, _ = drafter.draft(hidden[1], tokens + [first[0], 11], pick, 2)
        out.append((first + second, seen))
        if fuse:
            assert len(calls) == 4  # a call a module a round
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(a[a.isfinite()], b[b.isfinite()], rtol=tol, atol=tol)


@needs_kernel
def test_a_model_that_decoded_can_be_copied() -> None:
    """A copy (an RL reference model, say) leaves the kernel objects behind and builds its
    own, over its own weights."""
    import copy

    model = Transformer(ModelConfig.tiny()).eval()
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = model(tokens, cache=KVCache(model.cfg, 1, 16).view(0))
        twin = copy.deepcopy(model)
        got = twin(tokens, cache=KVCache(model.cfg, 1, 16).view(0))
        for p in twin.parameters():
            p.mul_(0.5)
        assert not torch.allclose(twin(tokens, cache=KVCache(model.cfg, 1, 16).view(0)), want)
        again = model(tokens, cache=KVCache(model.cfg, 1, 16).view(0))
    assert torch.equal(got, want) and torch.equal(again, want)


@needs_kernel
def test_fused_layers_take_weights_made_in_inference_mode(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Inference tensors keep no version counter: their panels are packed once, not checked."""
    torch.manual_seed(0)
    cfg = ModelConfig.tiny()
    calls = _count_calls(monkeypatch)
    with torch.inference_mode():
        model = Transformer(cfg).eval()
        tokens = torch.randint(0, cfg.vocab_size, (1, 4))
        fused = model(tokens, cache=KVCache(cfg, 1, 32).view(0, 1))
        model.fuse = False
        plain = model(tokens, cache=KVCache(cfg, 1, 32).view(0, 1))
    assert len(calls) == 1
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_weights_the_kernels_do_not_take_run_op_by_op() -> None:
    """A weight stored transposed (as `engine.input_major_weights` makes them) or of another
    type than the rest: the cached passes run the layers op by op, not an error."""
    cfg = ModelConfig.tiny()
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 6))
    with torch.no_grad():
        want = model(tokens, cache=KVCache(cfg, 1, 16).view(0))
        wqkv = model.layers[0].attn.wqkv
        wqkv.weight = torch.nn.Parameter(wqkv.weight.detach().T.contiguous().T)
        norm = model.layers[1].mlp_norm
        norm.weight = torch.nn.Parameter(norm.weight.detach().bfloat16())
        assert not wqkv.weight.is_contiguous()
        model.weights_changed()
        got = model(tokens, cache=KVCache(cfg, 1, 16).view(0))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("fuse", [True, False])
def test_the_logits_asked_of_each_row_are_that_rows(fuse: bool) -> None:
    """``logits_at``: a position of each row, a negative one from its end; one past a row is
    refused, on the fused path as op by op (it read another row's)."""
    cfg = ModelConfig.tiny()
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.fuse = fuse
    tokens = torch.randint(0, cfg.vocab_size, (2, 3))
    with torch.no_grad():
        every = model(tokens, cache=KVCache(cfg, 2, 16).view(0, 2))
        got = model(tokens, cache=KVCache(cfg, 2, 16).view(0, 2),
                    logits_at=torch.tensor([0, -1]))
        torch.testing.assert_close(got[:, 0], every[[0, 1], [0, 2]])
        for bad in ([3, 0], [0, -4]):
            cache = KVCache(cfg, 2, 16)
            with pytest.raises(ValueError, match=r"logits_at: positions in \[-3, 3\)"):
                model(tokens, cache=cache.view(0, 2), logits_at=torch.tensor(bad))
            assert cache.lengths[:2] == [0, 0]  # (refused before the cache counts them)
