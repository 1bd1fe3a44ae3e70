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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from codedojo.model.config import ModelConfig
from codedojo.model.kv_cache import check_tree, tree_positions
from codedojo.model.rope import Rotary, apply_rotary
from codedojo.ops import FusedLayers, linear

if TYPE_CHECKING:
    from codedojo.model.kv_cache import CacheView


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` with a given weight. Spelled out rather than F.rms_norm: at decode sizes the
    fused CPU kernel costs several times more (it round-trips through float copies), and this
    is HF's exact arithmetic."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


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
        causal = mask is None and T > 1  # with a cache: the pass starts at position 0
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
        """This block's tensors in ``codedojo.ops.FusedLayers``' order; None with MoE."""
        attn, mlp = self.attn, self.mlp
        if not isinstance(mlp, MLP):
            return None
        bias = attn.wqkv.bias if attn.wqkv.bias is not None else _EMPTY
        return [self.attn_norm.weight, attn.wqkv.weight, bias, attn.wo.weight,
                self.mlp_norm.weight, mlp.w_gate_up.weight, mlp.w_down.weight]


_EMPTY = torch.empty(0)  # "no bias" for FusedLayers
# Passes of up to this many tokens (all rows together) go through the fused layers in one call:
# a decode step, a verification pass, a prefill. Prefilling SmolLM2-135M (float32, logits of
# every token), fused against op by op (BLAS): 128 tokens 220 / 376 ms, 256 tokens 425 / 556,
# 512 tokens 999 / 1103, 1024 tokens even (2.5 s: the fused attention is a plain loop).
FUSED_TOKENS = 512


def fused_pass(layers: FusedLayers, view: CacheView, B: int, T: int, *,
               tokens: list[list[int]] | None = None, x: torch.Tensor | None = None,
               logits: Literal["all"] | Sequence[int] | None = None,
               parents: Sequence[int] | None = None, taps: Sequence[int] = ()
               ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """T new tokens for each of the B slots of ``view`` through ``layers``, in one C++ call,
    given as ids ``tokens`` (B lists of T) or embedded, x (B, T, D). Advances the view's
    lengths. Returns the hidden states (B, T, D) and the logits: of every token (B, T, V) for
    ``logits="all"``, of the token at ``logits[b]`` of each row (B, 1, V) (with one row, of
    each token it lists: (1, len(logits), V)), or None. None (the
    view untouched) for passes of more than ``FUSED_TOKENS`` tokens or ones the kernels do not
    take; the caller then runs the layers op by op. ``parents`` (B = 1): the T tokens are a
    tree (``kv_cache.tree_positions``). ``taps``: the states after those layers follow the last
    ones, (B, T, (1 + len(taps)) D) (`Transformer.hidden`)."""
    if not (0 < B * T <= FUSED_TOKENS and layers.takes(view.cache.k)):
        return None
    if parents is not None:
        check_tree(parents, T, B)
    past = view.advance(T)
    tree = {} if parents is None else {"parents": parents,
                                       "rope": tree_positions(past[0], parents)}
    cells = [(b, t) for b in range(B) for t in range(T)]
    rows: Sequence[int] = ()
    if logits == "all":
        rows = range(B * T)
    elif logits is not None and B == 1:  # one row: any of its tokens
        rows = list(logits)
    elif logits is not None:
        rows = [b * T + t for b, t in enumerate(logits)]
    h, lg = layers(view.cache.k, view.cache.v, [view.start + b for b, _ in cells],
                   [past[b] + t for b, t in cells],
                   x=None if x is None else x.reshape(B * T, -1),
                   tokens=() if tokens is None else [tokens[b][t] for b, t in cells],
                   logit_rows=rows, taps=taps, **tree)
    if logits is None:
        return h.view(B, T, -1), None
    return h.view(B, T, -1), lg.view(B, T if logits == "all" else len(rows) // B, -1)


class FusedModule(nn.Module):
    """A module whose passes over a KV cache go through ``FusedLayers`` objects, built on first
    use and built again whenever its parameters may have been replaced through it (``_apply``:
    ``.to()``, ``.bfloat16()``; its own ``load_state_dict(assign=True)``), its RoPE tables were
    (a new ``rotary``) or other tensors they hold were (``sources``). Weights changed in place
    are seen through their version counters (``FusedLayers``), which some writes leave alone;
    and a parameter replaced below it (``block.attn.wqkv.weight = ...``, a block's own
    ``load_state_dict(assign=True)``, ``.data =``, ``set_``) is not looked for at every pass
    (a walk of the parameters takes about 0.6 ms for 30 layers, a decode step's share): call
    `weights_changed` after those."""

    rotary: Rotary
    fuse = True  # False: every layer op by op (the reference the fused passes are tested against)

    def __init__(self) -> None:
        super().__init__()
        self._fused: dict[int, tuple[tuple[torch.Tensor, ...], FusedLayers | None]] = {}
        self.register_load_state_dict_post_hook(lambda m, _: m._fused.clear())

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._fused.clear()
        return super()._apply(fn, recurse)

    def weights_changed(self) -> None:
        """Drop the kernel objects, built again (weights packed again) by the next fused pass.
        Call it after writes the weights' version counters do not see: a fused optimizer step
        (``torch.optim.AdamW(fused=True)``), writes through ``.data``, writes to inference
        tensors."""
        self._fused.clear()

    def __getstate__(self) -> dict:
        """Copies and pickles leave the kernel objects behind (a copy builds its own)."""
        return {**super().__getstate__(), "_fused": {}}

    def fused_layers(self, key: int, build: Callable[[], FusedLayers | None],
                     *sources: torch.Tensor) -> FusedLayers | None:
        """The ``FusedLayers`` under ``key`` (``build`` makes it, holding ``sources`` besides
        this module's own tensors); None when ``fuse`` is off or the kernels do not take these
        layers."""
        if not self.fuse:
            return None
        held = (self.rotary.cos, *sources)
        hit = self._fused.get(key)
        if hit is None or len(hit[0]) != len(held) or any(
                a is not b for a, b in zip(hit[0], held, strict=True)):
            hit = self._fused[key] = (held, build())
        return hit[1]


def _positions_asked(logits_at: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """``logits_at`` (B,): a position of each of the B rows of T tokens, a negative one from
    the row's end (as indexing reads it), as positions in [0, T); a ValueError otherwise (the
    fused pass would read another row's)."""
    if tuple(logits_at.shape) != (B,):
        raise ValueError(f"logits_at: one position for each of the {B} rows expected, got "
                         f"shape {tuple(logits_at.shape)}")
    if B and not bool(((logits_at >= -T) & (logits_at < T)).all()):
        raise ValueError(f"logits_at: positions in [-{T}, {T}) of rows of {T} tokens "
                         f"expected, got {logits_at.tolist()}")
    return logits_at % max(T, 1)


def check_taps(taps: Sequence[int], n_layers: int) -> None:
    """Layers whose outputs are tapped: increasing indexes of the ``n_layers``."""
    if any(not 0 <= t < n_layers for t in taps) or list(taps) != sorted(set(taps)):
        raise ValueError(f"taps: {list(taps)} must be increasing layer indexes in "
                         f"[0, {n_layers})")


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> bool (B, 1, T, T): causal and within the same document."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal).unsqueeze(1)


class Transformer(FusedModule):
    """Embedding -> blocks -> final norm -> output projection (tied or not)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rotary = Rotary(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Normal(0, std) everywhere, residual-output projections scaled by 1/sqrt(2·layers)
        (GPT-2), norms at one, biases at zero. Submodules with their own ``init_weights``
        (the MoE layer) initialise themselves, given both stds."""
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
                m.init_weights(std, out_std)

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

    def greedy(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None,
               chunk: int = 1024) -> torch.Tensor:
        """The head's greedy picks: (..., dim) -> (...) indices into the vocabulary (or into
        ``vocab``), ``chunk`` positions at a time, so a long batch's logits never exist whole."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        picks = [self.head(c, vocab).argmax(-1) for c in flat.split(chunk)]
        return torch.cat(picks).view(hidden.shape[:-1])

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
                cache: CacheView | None = None, doc_ids: torch.Tensor | None = None,
                return_hidden: bool = False, last_only: bool = False,
                logits_at: torch.Tensor | None = None, parents: Sequence[int] | None = None,
                taps: Sequence[int] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, T) -> logits (B, T, V) float32, or (logits, hidden before the final norm).

        ``cache`` appends this call's keys/values to a KV cache view and attends to everything
        stored before them (positions default to the stored lengths). ``doc_ids`` (no cache)
        restricts attention to the same packed document. ``last_only`` computes logits for the
        last position only (prefill needs nothing else); ``logits_at`` (B,) for one chosen
        position per row (prefill of right-padded prompts), giving (B, 1, V). ``parents``
        (with a cache, one row): the new tokens are a tree, each one's parent given by its index
        among them or -1 (``kv_cache.tree_positions``): several continuations in one pass.
        ``taps``: the hidden states returned carry those layers' outputs too (`hidden`).
        """
        if logits_at is not None:
            logits_at = _positions_asked(logits_at, *tokens.shape)
        if cache is not None and positions is None and doc_ids is None:
            B, T = tokens.shape
            at: Literal["all"] | list[int] = "all"
            if logits_at is not None:
                at = logits_at.tolist()
            elif last_only:
                at = [T - 1] * B
            fused = self._fused_pass(tokens, cache, at, parents, taps)
            if fused is not None:
                x, logits = fused
                return (logits, x) if return_hidden else logits  # type: ignore[return-value]
        x = self.hidden(tokens, positions=positions, cache=cache, doc_ids=doc_ids,
                        parents=parents, taps=taps)
        B, last = x.shape[0], x[..., : self.cfg.dim]
        if logits_at is not None:
            h = last[torch.arange(B, device=x.device), logits_at].unsqueeze(1)
        else:
            h = last[:, -1:] if last_only else last
        logits = self.head(h)
        return (logits, x) if return_hidden else logits

    def _fused_pass(self, tokens: torch.Tensor, cache: CacheView,
                    logits: Literal["all"] | Sequence[int] | None,
                    parents: Sequence[int] | None = None, taps: Sequence[int] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``fused_pass`` over every layer, from the token ids to the logits asked for; None
        where the kernels do not take it."""
        layers = self.fused_layers(0, self._build_fused)
        if layers is None:
            return None
        check_taps(taps, self.cfg.n_layers)
        T = tokens.shape[1]
        # (`fused_pass` checks the tree before it touches the cache)
        self._check_room(cache, T, parents)
        return fused_pass(layers, cache, tokens.shape[0], T, tokens=tokens.tolist(),
                          logits=logits, parents=parents, taps=taps)

    def _check_room(self, cache: CacheView, T: int, parents: Sequence[int] | None) -> None:
        """Refuse a cached pass whose new tokens would sit at max_seq_len or past it, before
        the cache counts them: T tokens after the longest past, or a tree (``parents``) as
        deep as its longest branch (its tokens sit at their places in the tree)."""
        depth = T if parents is None else max(tree_positions(0, parents), default=-1) + 1
        end = max(cache.cache.lengths[cache.start : cache.stop]) + depth
        if end > self.cfg.max_seq_len:
            raise ValueError(f"positions: {end - 1} >= max_seq_len {self.cfg.max_seq_len}")

    def _build_fused(self) -> FusedLayers | None:
        per_layer = [layer.decode_weights() for layer in self.layers]
        if any(w is None for w in per_layer):  # MoE layers: op by op
            return None
        cfg = self.cfg
        return FusedLayers.build([t for w in per_layer for t in w],  # type: ignore[union-attr]
                                 self.rotary.cos, self.rotary.sin, cfg.n_heads, cfg.n_kv_heads,
                                 cfg.norm_eps, embed=self.tok_embeddings.weight,
                                 norm=self.norm.weight, head=self.output_weight)

    def hidden(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
               cache: CacheView | None = None, doc_ids: torch.Tensor | None = None,
               parents: Sequence[int] | None = None, taps: Sequence[int] = ()
               ) -> torch.Tensor:
        """The last hidden states (B, T, dim), before the final norm (``forward`` without the
        head; arguments as there). ``taps`` (increasing layer indexes, 0-based): the outputs of
        those layers follow the last states, (B, T, (1 + len(taps)) dim): the fused features an
        MTP module may read (EAGLE-3)."""
        check_taps(taps, self.cfg.n_layers)
        B, T = tokens.shape
        mask: torch.Tensor | None = None
        if parents is not None and (cache is None or positions is not None):
            raise ValueError("parents: a tree of new tokens goes with a cache, positions "
                             "left to it")
        if cache is not None:
            if doc_ids is not None:
                raise ValueError("doc_ids: packed-document masking is not supported with a cache")
            if positions is None and (
                    fused := self._fused_pass(tokens, cache, None, parents, taps)) is not None:
                return fused[0]
            if positions is None and T:  # as the check below would say, before the cache
                # counts tokens that never come
                self._check_room(cache, T, parents)
            store_pos, mask = cache.prepare(T, parents)
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
        if T:
            lo, hi = (int(x) for x in torch.aminmax(positions))
            if hi >= self.cfg.max_seq_len or lo < 0:
                raise ValueError(f"positions: {lo}..{hi} outside [0, max_seq_len "
                                 f"{self.cfg.max_seq_len})")
        cos, sin = self.rotary.tables(positions)
        cos, sin = cos.to(self.tok_embeddings.weight.dtype), sin.to(self.tok_embeddings.weight.dtype)
        x = self.embed(tokens)
        tapped = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache)
            if i in taps:
                tapped.append(x)
        return torch.cat([x, *tapped], -1) if tapped else x
