"""The fused decode layers equal the layers run op by op: hidden states, and the keys/values
they write into the cache, for rows at different lengths, several tokens per row (verification
passes) and models with q/k/v biases."""

from __future__ import annotations

import pytest
import torch

import codedojo.model.transformer as transformer
from codedojo.model.config import ModelConfig, RopeScaling
from codedojo.model.kv_cache import KVCache
from codedojo.model.transformer import Transformer
from tests.ops.conftest import needs_kernel



def _decode(model: Transformer, cache: KVCache, tokens: torch.Tensor, start: int
            ) -> torch.Tensor:
    return model.hidden(tokens, cache=cache.view(start, start + tokens.shape[0]))


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
    calls = []
    real = transformer.decode_layers
    monkeypatch.setattr(transformer, "decode_layers",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        _prefill(model, fused, lengths, start)
        got = [_decode(model, fused, tokens, start), _decode(model, fused, tokens + 1, start)]
        monkeypatch.setattr(transformer, "decode_layers", lambda *a, **k: None)
        _prefill(model, plain, lengths, start)
        want = [_decode(model, plain, tokens, start), _decode(model, plain, tokens + 1, start)]
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
def test_fused_decode_long_context_and_saturated_activations(gain: float,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
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
            if not fused:
                monkeypatch.setattr(transformer, "decode_layers", lambda *a, **k: None)
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
    fused = []
    real = transformer.decode_layers

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        y = real(*a, **k)
        fused.append(y is not None)
        return y

    monkeypatch.setattr(transformer, "decode_layers", counted)
    with torch.no_grad():
        cache = KVCache(cfg, 4, 64, dtype=torch.bfloat16)
        _prefill(low, cache, [5, 9], 1)
        got = _decode(low, cache, tokens, 1)
        monkeypatch.setattr(transformer, "decode_layers", lambda *a, **k: None)
        plain = KVCache(cfg, 4, 64)
        _prefill(ref, plain, [5, 9], 1)
        want = _decode(ref, plain, tokens, 1)
    assert fused == [True] * 3 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache.k[:, 1:3].float(), plain.k[:, 1:3], rtol=2e-2, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4, 40])
def test_a_pass_over_several_tokens_equals_one_token_steps_bit_for_bit(dtype: torch.dtype,
                                                                      n: int) -> None:
    """What makes a verification pass give exactly the hidden states (and cache entries) of
    one-token decode steps: greedy speculative decoding then emits plain greedy decoding's
    tokens, in bfloat16 too. A pass of 40 tokens (a short prefill) runs in chunks of 16."""
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
def test_fused_decode_steps_aside() -> None:
    """Training, MoE layers and weights of another type than the cache run the layers op by
    op."""
    from codedojo.model.config import MoEConfig
    from codedojo.ops import decode_layers

    cfg = ModelConfig.tiny()
    model = Transformer(cfg)
    w = model._dense_weights()
    assert w is not None and len(w) == 7 * cfg.n_layers
    cache = KVCache(cfg, 1, 16)
    x, cs = torch.randn(1, cfg.dim), torch.zeros(1, cfg.hd)
    args = (cache.k, cache.v, [0], [0], cs, cs, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps)
    assert decode_layers(x, w, *args) is None  # gradients enabled
    with torch.no_grad():
        assert decode_layers(x, w, *args) is not None
        low = KVCache(cfg, 1, 16, dtype=torch.bfloat16)
        assert decode_layers(x, w, low.k, low.v, *args[2:]) is None
        assert decode_layers(torch.randn(17, cfg.dim), w, *args) is None
    moe = Transformer(ModelConfig.tiny(moe=MoEConfig(n_routed_experts=4, expert_ffn_dim=32)))
    assert moe._dense_weights() is None


@needs_kernel
def test_fused_decode_rejects_bad_shapes() -> None:
    from codedojo.ops import decode_layers

    cfg = ModelConfig.tiny()
    w = Transformer(cfg)._dense_weights()
    assert w is not None
    cache = KVCache(cfg, 1, 16)
    cs = torch.zeros(1, cfg.hd)
    x, heads = torch.randn(1, cfg.dim), (cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps)
    with torch.no_grad(), pytest.raises(RuntimeError, match="position 99 outside"):
        decode_layers(x, w, cache.k, cache.v, [0], [99], cs, cs, *heads)
    with torch.no_grad(), pytest.raises(RuntimeError, match="slot 1 outside"):
        decode_layers(x, w, cache.k, cache.v, [1], [0], cs, cs, *heads)
    with torch.no_grad(), pytest.raises(RuntimeError, match="layer 0 wqkv"):
        decode_layers(x, [w[0], w[1][:-1]] + w[2:], cache.k, cache.v, [0], [0], cs, cs, *heads)


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


def test_decode_weights_are_listed_again_when_parameters_are_replaced() -> None:
    model = Transformer(ModelConfig.tiny())
    first = model._dense_weights()
    assert first is not None and model._dense_weights() is first  # listed once
    fresh = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)  # new parameter objects
    listed = model._dense_weights()
    assert listed is not None and listed is not first
    assert listed[1] is model.layers[0].attn.wqkv.weight
    model.to(torch.float64)
    assert model._dense_weights() is not listed
