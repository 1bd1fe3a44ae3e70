"""A Llama-family decoder, top to bottom as in the papers.

Architectural choices:
- pre-norm residual blocks with RMSNorm (Zhang & Sennrich 2019);
- SwiGLU MLP (Shazeer 2020), gate and up projections fused into one matrix;
- rotary position embeddings (rotate-half layout) with optional YaRN / base change (``rope.py``);
- grouped-query attention (Ainslie et al. 2023) through ``scaled_dot_product_attention``, the
  q/k/v projections fused into one matrix (optional biases, as in Qwen2);
- optional tied input/output embeddings;
- layers ``>= moe.first_dense_layers`` use the mixture-of-experts MLP when ``cfg.moe`` is set;
- packed documents: ``doc_ids`` makes attention block-diagonal causal.

Fused projections keep one matrix multiply per step where the paper has two or three: on CPU,
batch-1 decoding is dominated by per-op overhead and weight reads. Weight import (``gguf.py``,
``hf.py``) maps the usual separate q/k/v and gate/up names onto them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from codedojo.model.config import ModelConfig
from codedojo.model.rope import Rotary, apply_rotary
from codedojo.ops import decode_layers, linear
from codedojo.ops.gemm import MAX_ROWS

if TYPE_CHECKING:
    from codedojo.model.kv_cache import CacheView


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Spelled out rather than F.rms_norm: at decode sizes the fused CPU kernel costs several
        # times more (it round-trips through float copies), and this is HF's exact arithmetic.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose decode-sized CPU calls take the small-row kernel (``codedojo.ops``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.wqkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.hd,
                              bias=cfg.attn_bias)
        self.wo = Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: CacheView | None) -> torch.Tensor:
        B, T, _ = x.shape
        H, K = self.n_heads, self.n_kv
        qkv = self.wqkv(x).view(B, T, H + 2 * K, self.hd)
        # Rotate q and k together: they are adjacent heads of the fused projection.
        qk = apply_rotary(qkv[:, :, : H + K], cos, sin)  # (B, T, H+K, hd)
        q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, hd)
        k = qk[:, :, H:].transpose(1, 2)  # (B, K, T, hd)
        v = qkv[:, :, H + K :].transpose(1, 2)  # (B, K, T, hd)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, K, S, hd) with the past
        causal = mask is None and cache is None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           enable_gqa=H != K)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w_gate_up = Linear(dim, 2 * hidden, bias=False)
        self.w_down = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.hidden, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp: nn.Module
        if cfg.moe is not None and layer >= cfg.moe.first_dense_layers:
            from codedojo.model.moe import MoE  # the MoE layer is optional machinery

            self.mlp = MoE(cfg)
        else:
            self.mlp = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: CacheView | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))

    def decode_weights(self) -> list[torch.Tensor] | None:
        """This block's tensors in ``codedojo.ops.decode_layers``' order; None with MoE."""
        attn, mlp = self.attn, self.mlp
        if not isinstance(mlp, MLP):
            return None
        bias = attn.wqkv.bias if attn.wqkv.bias is not None else _EMPTY
        return [self.attn_norm.weight, attn.wqkv.weight, bias, attn.wo.weight,
                self.mlp_norm.weight, mlp.w_gate_up.weight, mlp.w_down.weight]


_EMPTY = torch.empty(0)  # "no bias" for decode_layers
# Passes of more than MAX_ROWS tokens go through the kernel in chunks up to this many tokens:
# a 25-token prefill of SmolLM2-135M 84 ms against 111 op by op (BLAS); at 64 they are even,
# and past it BLAS is faster (128 tokens: 287 ms against 362).
FUSED_TOKENS = 48


def fused_blocks(weights: list[torch.Tensor], x: torch.Tensor, cache: CacheView,
                 store_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cfg: ModelConfig) -> torch.Tensor | None:
    """Dense blocks (``weights``: their ``decode_weights`` in order) over x (B, T, D) against
    a cache view already prepared for these T tokens (``store_pos`` (B, T) from ``prepare``), in
    C++ calls of at most ``MAX_ROWS`` tokens: decode steps and verification passes in one,
    prefills of up to ``FUSED_TOKENS`` tokens in chunks of consecutive positions. None where
    the kernels do not take it; the caller then runs the blocks one by one."""
    B, T, _ = x.shape
    step = MAX_ROWS // B  # tokens of each row per call
    if not step or B * T > max(MAX_ROWS, FUSED_TOKENS):
        return None
    out = []
    for t0 in range(0, T, step):  # a chunk's keys are in the cache before the next attends
        t1 = min(T, t0 + step)
        n = B * (t1 - t0)
        slots = [cache.start + b for b in range(B) for _ in range(t0, t1)]
        y = decode_layers(x[:, t0:t1].reshape(n, -1), weights, cache.cache.k, cache.cache.v,
                          slots, store_pos[:, t0:t1].flatten().tolist(),
                          cos[:, t0:t1].reshape(n, -1), sin[:, t0:t1].reshape(n, -1),
                          cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps)
        if y is None:
            return None
        out.append(y.view(B, t1 - t0, -1))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> bool (B, 1, T, T): causal and within the same document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal).unsqueeze(1)


class Transformer(nn.Module):
    """Embedding -> blocks -> final norm -> output projection (tied or not)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._decode_weights: list[torch.Tensor] | None = None  # see _dense_weights
        # load_state_dict(assign=True) puts new parameter objects in place: list them again.
        self.register_load_state_dict_post_hook(lambda m, _: m._forget_decode_weights())
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) everywhere, residual-output projections scaled by 1/sqrt(2·layers)
        (GPT-2), norms at one, biases at zero. Submodules with their own ``init_weights``
        (the MoE layer) initialise themselves."""
        out_std = std / (2 * self.cfg.n_layers) ** 0.5
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p) if name.endswith("norm.weight") else nn.init.zeros_(p)
            elif name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)
        for m in self.modules():
            if m is not self and hasattr(m, "init_weights"):
                m.init_weights()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> (B, T, dim)."""
        return self.tok_embeddings(tokens)

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, dim): the output projection (the embedding table when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def head(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + output projection: (B, T, dim) -> float32 logits (B, T, V), or over
        the token ids ``vocab`` only (B, T, len(vocab))."""
        w = self.output_weight if vocab is None else self.output_weight[vocab]
        return linear(self.norm(hidden), w, out_dtype=torch.float32)

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                cache: CacheView | None = None, doc_ids: torch.Tensor | None = None,
                return_hidden: bool = False, last_only: bool = False,
                logits_at: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, T) -> logits (B, T, V) float32, or (logits, hidden before the final norm).

        ``cache`` appends this call's keys/values to a KV cache view and attends to everything
        stored before them (positions default to the stored lengths). ``doc_ids`` (no cache)
        restricts attention to the same packed document. ``last_only`` computes logits for the
        last position only (prefill needs nothing else); ``logits_at`` (B,) for one chosen
        position per row (prefill of right-padded prompts), giving (B, 1, V).
        """
        x = self.hidden(tokens, positions=positions, cache=cache, doc_ids=doc_ids)
        B = x.shape[0]
        if logits_at is not None:
            h = x[torch.arange(B, device=x.device), logits_at].unsqueeze(1)
        else:
            h = x[:, -1:] if last_only else x
        logits = self.head(h)
        return (logits, x) if return_hidden else logits

    def _forget_decode_weights(self) -> None:
        self._decode_weights = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._forget_decode_weights()  # .to(), .to_empty() may replace parameter objects
        return super()._apply(fn, recurse)

    def _dense_weights(self) -> list[torch.Tensor] | None:
        """Every layer's tensors for ``fused_blocks`` (None with MoE layers), listed once and
        listed again whenever parameters may have been replaced (``_apply``, loading with
        ``assign=True``)."""
        if self._decode_weights is None:
            per_layer = [layer.decode_weights() for layer in self.layers]
            if any(w is None for w in per_layer):
                return None
            self._decode_weights = [t for w in per_layer for t in w]  # type: ignore[union-attr]
        return self._decode_weights

    def hidden(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
               cache: CacheView | None = None, doc_ids: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The last hidden states (B, T, dim), before the final norm (``forward`` without the
        head; arguments as there)."""
        B, T = tokens.shape
        mask: torch.Tensor | None = None
        if cache is not None:
            if doc_ids is not None:
                raise ValueError("doc_ids: packed-document masking is not supported with a cache")
            store_pos, mask = cache.prepare(T)
            if positions is None:
                positions = store_pos
        elif doc_ids is not None:
            if doc_ids.shape != tokens.shape:
                raise ValueError(f"doc_ids: shape {tuple(doc_ids.shape)} != tokens "
                                 f"{tuple(tokens.shape)}")
            if not bool((doc_ids == doc_ids[:, :1]).all()):  # one document per row: causal
                mask = document_mask(doc_ids)
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        elif positions.shape != tokens.shape:
            raise ValueError(f"positions: shape {tuple(positions.shape)} != tokens "
                             f"{tuple(tokens.shape)}")
        if T and int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"positions: {int(positions.max())} >= max_seq_len "
                             f"{self.cfg.max_seq_len}")
        cos, sin = self.rotary.tables(positions)
        cos, sin = cos.to(self.tok_embeddings.weight.dtype), sin.to(self.tok_embeddings.weight.dtype)
        x = self.embed(tokens)
        if cache is not None and (weights := self._dense_weights()) is not None:
            fused = fused_blocks(weights, x, cache, store_pos, cos, sin, self.cfg)
            if fused is not None:
                return fused
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return x
