"""GGUF import: dequantisation against the gguf package's reference, the Q/K permutation, a whole
tiny model written with GGUFWriter, and the error for an unsupported tensor type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize

from codedojo.model.config import ModelConfig
from codedojo.model.gguf import UnsupportedTensorType, dequantize, load_gguf, unpermute_rope
from codedojo.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16])
def test_dequantize_matches_gguf_reference(qtype: Q) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    raw = quantize(x, qtype)
    ours = dequantize(raw, qtype.name, (8, 64), "w")
    ref = torch.from_numpy(ref_dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(ours, ref)
    # and it is a faithful approximation of the original
    assert (ours - torch.from_numpy(x)).abs().max() < 0.5


def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows."""
    out = w.shape[0]
    return (w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llamacpp_permutation() -> None:
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    back = unpermute_rope(torch.from_numpy(_llamacpp_permute(w, 4)), 4)
    assert torch.equal(back, torch.from_numpy(w))


def _write_tiny_gguf(path, model: Transformer, cfg: ModelConfig, *, bad_type: bool = False,
                     rope_freqs: bool = False, drop: str = "") -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    H, K = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    w.add_tensor("token_embd.weight", sd["tok_embeddings.weight"])
    w.add_tensor("output_norm.weight", sd["norm.weight"])
    for i in range(cfg.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        qkv = sd[p + "attn.wqkv.weight"]
        w.add_tensor(b + "attn_q.weight", _llamacpp_permute(qkv[:H], cfg.n_heads))
        w.add_tensor(b + "attn_k.weight", _llamacpp_permute(qkv[H:H + K], cfg.n_kv_heads))
        w.add_tensor(b + "attn_v.weight", qkv[H + K:])
        w.add_tensor(b + "attn_output.weight", sd[p + "attn.wo.weight"])
        w.add_tensor(b + "attn_norm.weight", sd[p + "attn_norm.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "mlp_norm.weight"])
        gate, up = np.split(sd[p + "mlp.w_gate_up.weight"], 2)
        if bad_type and i == 0:  # Q5_0: a real llama.cpp type we do not dequantize
            w.add_tensor(b + "ffn_gate.weight", quantize(gate, Q.Q5_0), raw_dtype=Q.Q5_0)
        else:
            w.add_tensor(b + "ffn_gate.weight", gate)
        w.add_tensor(b + "ffn_up.weight", up)
        if b + "ffn_down.weight" != drop:
            w.add_tensor(b + "ffn_down.weight", sd[p + "mlp.w_down.weight"])
    if rope_freqs:  # Llama 3.1's per-frequency factors
        w.add_tensor("rope_freqs.weight", np.ones(cfg.hd // 2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_round_trip_gives_same_logits(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(dim=64, ffn_dim=64)  # 64: the row length must fill 32-blocks
    model = Transformer(cfg).eval()
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model, cfg)
    sd, cfg2 = load_gguf(path)
    assert cfg2.n_heads == cfg.n_heads and cfg2.n_kv_heads == cfg.n_kv_heads
    loaded = Transformer(cfg2).eval()
    loaded.load_state_dict(sd)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(tokens), loaded(tokens), atol=1e-5)


def test_unsupported_tensor_type_is_named(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(dim=64, ffn_dim=64)
    path = tmp_path / "bad.gguf"
    _write_tiny_gguf(path, Transformer(cfg), cfg, bad_type=True)
    with pytest.raises(UnsupportedTensorType, match=r"blk\.0\.ffn_gate\.weight.*Q5_0"):
        load_gguf(path)


def test_rope_the_loader_cannot_apply_is_refused_not_dropped(tmp_path) -> None:
    """RoPE scaling in the metadata, or Llama 3.1's frequency factors: read as plain RoPE, the
    model would give other logits with no error."""
    from codedojo.model.gguf import config_from_metadata

    meta = {"general.architecture": "llama", "llama.attention.head_count": 2,
            "llama.embedding_length": 64, "llama.block_count": 1,
            "llama.feed_forward_length": 64, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.context_length": 64, "llama.vocab_size": 32}
    assert config_from_metadata(meta).n_heads == 2
    with pytest.raises(ValueError, match=r"llama.rope.scaling.type: 'yarn' is not supported"):
        config_from_metadata({**meta, "llama.rope.scaling.type": "yarn"})
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(dim=64, ffn_dim=64)
    _write_tiny_gguf(tmp_path / "l31.gguf", Transformer(cfg), cfg, rope_freqs=True)
    with pytest.raises(ValueError, match="rope_freqs.weight: RoPE frequency factors"):
        load_gguf(tmp_path / "l31.gguf")


def test_a_missing_tensor_is_named_with_its_file(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(dim=64, ffn_dim=64)
    path = tmp_path / "cut.gguf"
    _write_tiny_gguf(path, Transformer(cfg), cfg, drop="blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match=r"cut.gguf: tensor blk.0.ffn_down.weight is missing"):
        load_gguf(path)
