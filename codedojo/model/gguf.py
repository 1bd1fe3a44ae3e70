"""Import a Llama-family GGUF file (llama.cpp's format) into our state dict.

We read tensors with the ``gguf`` package's reader and dequantize ourselves, vectorised over
blocks: Q4_0, Q4_1, Q8_0 (blocks of 32), F16 and F32. Any other tensor type is refused with an
error naming the tensor and its type.

llama.cpp's converter permutes the rows of the Q and K projections so that rotary pairs are
adjacent (interleaved RoPE); our model uses the rotate-half layout, so import undoes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from codedojo.model.config import ModelConfig
from codedojo.model.tensors import Tensors

BLOCK = 32  # elements per quantisation block for the 4/8-bit formats we read


class UnsupportedTensorType(ValueError):
    """A GGUF tensor uses a quantisation type we do not dequantize."""


def _f16(raw: np.ndarray) -> torch.Tensor:
    """uint8 (..., 2) little-endian half floats -> float32 (...)."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0]).float()


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """uint8 (n, 16) -> (n, 32) values in [0, 15]: low nibbles are elements 0..15, high 16..31."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0x0F, q >> 4], dim=-1).float()


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], name: str
               ) -> torch.Tensor:
    """Raw tensor bytes/values -> float32 tensor of ``shape`` (row-major, torch order)."""
    n = int(np.prod(shape))
    if type_name == "F32":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.float32).copy()).reshape(shape)
    if type_name == "F16":
        return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32)
                                ).reshape(shape)
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes)
        if blocks.shape[0] * BLOCK != n:
            raise ValueError(f"tensor {name!r}: {blocks.shape[0]} {type_name} blocks do not hold "
                             f"{n} elements")
        d = _f16(blocks[:, 0:2])[:, None]  # (n_blocks, 1) scale
        if type_name == "Q4_0":
            out = (_nibbles(blocks[:, 2:]) - 8.0) * d
        elif type_name == "Q4_1":
            m = _f16(blocks[:, 2:4])[:, None]  # block minimum
            out = d * _nibbles(blocks[:, 4:]) + m
        else:
            q = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).view(np.int8)).float()
            out = d * q
        return out.reshape(shape)
    raise UnsupportedTensorType(
        f"tensor {name!r} has GGUF type {type_name}, which codedojo cannot dequantize "
        f"(supported: F32, F16, Q8_0, Q4_0, Q4_1)"
    )


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving permutation of Q/K rows (out, in) -> rotate-half order."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # fields the reader cannot decode stay out of the metadata
        return None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (tokenizer vocab, merges, chat template, ...)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {k: _field_value(f) for k, f in reader.fields.items()}


def config_from_metadata(meta: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from GGUF metadata (architecture 'llama' or 'qwen2')."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"general.architecture: {arch!r} is not supported (llama, qwen2)")

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return v

    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):  # read as plain RoPE it would give other logits
        raise ValueError(f"{arch}.rope.scaling.type: {scaling!r} is not supported (a model "
                         "without RoPE scaling)")
    n_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    return ModelConfig(
        vocab_size=int(vocab), dim=dim, n_layers=int(get("block_count")), n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(meta.get(f"{arch}.rope.dimension_count") or dim // n_heads),
        ffn_dim=int(get("feed_forward_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_seq_len=int(get("context_length")),
        tie_embeddings=True,  # corrected below when output.weight exists
        attn_bias=arch == "qwen2",
    )


def load_gguf(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read a GGUF file -> (our state dict in float32, config)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {k: _field_value(f) for k, f in reader.fields.items()}
    cfg = config_from_metadata(meta)
    arch = meta["general.architecture"]
    raw: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne0 (fastest) first
        raw[t.name] = dequantize(t.data, t.tensor_type.name, shape, t.name)
    if "output.weight" in raw:
        cfg = cfg.model_copy(update={"tie_embeddings": False})
    # llama.cpp permutes Q/K only for the llama architecture (not qwen2, already rotate-half).
    permuted = arch == "llama"
    src = Tensors(raw, str(path))
    take = src.take
    H, K, D, E = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd, cfg.ffn_dim, cfg.dim
    sd: dict[str, torch.Tensor] = {"tok_embeddings.weight": take("token_embd.weight",
                                                                 cfg.vocab_size, E),
                                   "norm.weight": take("output_norm.weight", E)}
    if not cfg.tie_embeddings:
        sd["output.weight"] = take("output.weight", cfg.vocab_size, E)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        q, k, v = take(p + "attn_q.weight", H, E), take(p + "attn_k.weight", K, E), take(
            p + "attn_v.weight", K, E)
        if permuted:
            q, k = unpermute_rope(q, cfg.n_heads), unpermute_rope(k, cfg.n_kv_heads)
        o = f"layers.{i}."
        sd[o + "attn.wqkv.weight"] = torch.cat([q, k, v])
        if cfg.attn_bias:
            sd[o + "attn.wqkv.bias"] = torch.cat(
                [take(p + "attn_q.bias", H), take(p + "attn_k.bias", K),
                 take(p + "attn_v.bias", K)])
        sd[o + "attn.wo.weight"] = take(p + "attn_output.weight", E, H)
        sd[o + "attn_norm.weight"] = take(p + "attn_norm.weight", E)
        sd[o + "mlp_norm.weight"] = take(p + "ffn_norm.weight", E)
        sd[o + "mlp.w_gate_up.weight"] = torch.cat(
            [take(p + "ffn_gate.weight", D, E), take(p + "ffn_up.weight", D, E)])
        sd[o + "mlp.w_down.weight"] = take(p + "ffn_down.weight", E, D)
    raw = src.left
    if "rope_freqs.weight" in raw:  # Llama-3.1's per-frequency RoPE factors
        raise ValueError("rope_freqs.weight: RoPE frequency factors (Llama 3.1 and later) are "
                         "not supported; read as plain RoPE the model would give other logits")
    if raw:
        raise ValueError(f"GGUF tensors not understood: {sorted(raw)[:5]}")
    return sd, cfg
