"""Multi-token prediction (MTP) modules, DeepSeek-V3 style (report sec. 2.2).

D sequential modules share the main model's embedding and output head. Module k (1-based) at
position i combines the previous depth's hidden state with the embedding of token t_{i+k} and
predicts t_{i+k+1}:

    h'_i^k = W_k [RMSNorm(h_i^{k-1}); RMSNorm(Emb(t_{i+k}))]      (W_k: 2D -> D, no bias)
    h_i^k  = Block_k(h'^k)_i                                      (one transformer block)
    P_{i+k+1}^k = Head(h_i^k)                                     (shared head, incl. final norm)

with h^0 the main model's last hidden state (before the final norm). A module may also read the
states of a few lower layers at position i (``taps``, the fused features of EAGLE-3, Li et al.
2025): h_i^{k-1} is then replaced by

    h_i^{k-1} + F_k [RMSNorm(h_i^(a)); RMSNorm(h_i^(b)); ...]     (F_k: n D -> D, starting at 0)

h^(a) the output of layer a. The last state tells what the model will say; the lower ones keep
what it has read, which the next tokens after that also depend on. On SmolLM2-135M (layers 8
and 20 of 30) the held-out agreement of the first module rose from 0.732 to 0.757, of the second
from 0.723 to 0.740, in a paired fine-tune (``benchmarks/mtp_features.py``); trained so over a
whole distillation stage, the first draft passed 0.722 of the time in speculative decoding
against 0.675 (``configs/cpt-smollm2.toml``).

Each module's block is the main model's decoder `Block` (dense, with the same RoPE/YaRN tables)
with its own single-layer KV cache, so drafting at decode time costs one block per module per
token. A module may stack more blocks (``blocks``, and as many cache layers): a larger draft
model at the price of a block more per draft. The first starts as a copy of the main model's last
block, the others as the identity (their output projections at zero), so that a module given
more blocks drafts as it did until they are trained. The modules are trained by
self-distillation (their distribution at i pulled toward the main head's distribution at i+k,
which predicts the same token); see `distill_loss`. The module knows nothing about training or
decoding loops.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from codedojo.model.config import ModelConfig
from codedojo.model.kv_cache import CacheView, KVCache
from codedojo.model.rope import Rotary
from codedojo.model.transformer import (
    MLP,
    Block,
    FusedModule,
    Linear,
    RMSNorm,
    Transformer,
    check_taps,
    document_mask,
    fused_pass,
)
from codedojo.ops import FusedLayers, move_to_huge_pages


def mtp_block_config(cfg: ModelConfig, blocks: int = 1) -> ModelConfig:
    """The MTP blocks are dense even in an MoE model (a draft block should be cheap), and a
    module's KV cache has a layer per block."""
    return cfg.model_copy(update={"moe": None, "n_layers": blocks, "n_mtp": 0})


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, taps: int = 0, blocks: int = 1):
        super().__init__()
        self.norm_h = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm_e = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = Linear(2 * cfg.dim, cfg.dim, bias=False)
        bc = mtp_block_config(cfg, blocks)
        self.block = Block(bc, 0)
        # stacked after it (each with its own layer of the module's KV cache)
        self.extra_blocks = nn.ModuleList(Block(bc, i) for i in range(1, blocks))
        self.eps = cfg.norm_eps
        # F_k, over the states of `taps` lower layers (see the top of this file)
        self.fuse = Linear(taps * cfg.dim, cfg.dim, bias=False) if taps else None

    def reads(self, h_prev: torch.Tensor, tapped: torch.Tensor | None) -> torch.Tensor:
        """What the module reads of the previous depth: h_prev (..., D), plus F_k of the tapped
        layers' states (..., n D) side by side (as `Transformer.hidden` gives them after the
        last) when it has taps."""
        if self.fuse is None:
            return h_prev
        tapped = self.check_tapped(tapped)
        D = h_prev.shape[-1]
        normed = F.rms_norm(tapped.unflatten(-1, (-1, D)), (D,), eps=self.eps).flatten(-2)
        return h_prev + self.fuse(normed.to(h_prev.dtype))

    def check_tapped(self, tapped: torch.Tensor | None) -> torch.Tensor:
        """The tapped layers' states, or a clear error when they are missing or of the wrong
        width."""
        assert self.fuse is not None
        if tapped is None or tapped.shape[-1] != self.fuse.in_features:
            raise ValueError(f"MTP module: the tapped layers' states must be "
                             f"(..., {self.fuse.in_features}); got "
                             f"{None if tapped is None else tuple(tapped.shape)}")
        return tapped

    def forward(self, h_prev: torch.Tensor, emb_next: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None = None,
                cache: CacheView | None = None) -> torch.Tensor:
        """h_prev, emb_next (B, T, D) -> h (B, T, D). cos/sin from `MTP.rotary`."""
        x = self.combine(h_prev, emb_next)
        for block in self.blocks:
            x = block(x, cos, sin, mask, cache)
        return x

    def combine(self, h_prev: torch.Tensor, emb_next: torch.Tensor) -> torch.Tensor:
        """h'^k: the block's input."""
        return self.proj(torch.cat([self.norm_h(h_prev), self.norm_e(emb_next)], -1))

    @property
    def blocks(self) -> list[nn.Module]:
        """The block, then the extra ones, in the order they run."""
        return [self.block, *self.extra_blocks]


class MTP(FusedModule):
    """The D modules. Embedding and head are the main model's, passed in as callables."""

    draft_vocab: torch.Tensor | None

    def __init__(self, cfg: ModelConfig, depth: int | None = None, draft_vocab: int = 0,
                 taps: Sequence[int] = (), blocks: int = 1):
        """``taps``: the main model's layers (0-based, increasing) whose states every module
        reads beside the previous depth's (the module header); the hidden states passed in
        then carry them after the last (`Transformer.hidden`'s ``taps``). ``blocks``: each
        module's stacked blocks."""
        super().__init__()
        depth = cfg.n_mtp if depth is None else depth
        if depth < 1:
            raise ValueError("MTP needs depth >= 1 (config n_mtp)")
        if not 0 <= draft_vocab <= cfg.vocab_size:
            raise ValueError(f"draft_vocab: {draft_vocab} outside [0, {cfg.vocab_size}]")
        check_taps(taps, cfg.n_layers)
        if blocks < 1:
            raise ValueError(f"MTP: blocks {blocks}: a module needs at least one")
        self.cfg = cfg
        self.depth = depth
        self.taps = tuple(taps)
        self.n_blocks = blocks
        self.layers = nn.ModuleList(MTPModule(cfg, len(taps), blocks) for _ in range(depth))
        self.rotary = Rotary(cfg)
        # The draft vocabulary (FR-Spec, Zhao et al. 2025): the ids of the most frequent
        # tokens. The modules draft, and are distilled, over these only, so a draft costs a
        # block and a slice of the output head instead of the whole head. 0: the full vocab.
        if draft_vocab:
            self.register_buffer("draft_vocab", torch.arange(draft_vocab))
        else:
            self.draft_vocab = None
        self.init_weights()

    @torch.no_grad()
    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """Choose the draft vocabulary: the ``len(draft_vocab)`` most frequent ids (sorted);
        ``token_counts`` (V,) per id, of packed rows as `draft_counts` counts them."""
        if self.draft_vocab is None:
            raise ValueError("set_draft_vocab: this MTP was built without a draft vocabulary")
        top = token_counts.topk(len(self.draft_vocab)).indices.sort().values
        self.draft_vocab.copy_(top)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if p.ndim == 1:  # norms' scales at one, biases (attention's q/k/v) at zero
                nn.init.zeros_(p) if name.endswith(".bias") else nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std / (1 if "proj" in name else 4))
        # The projection starts as "pass RMSNorm(h) through, plus a little of the embedding":
        # an untrained module then predicts about what the main head does, a far better start
        # for distillation than noise.
        # F_k starts at zero: the module first drafts as it would without the lower layers.
        # Blocks after the first start as the identity: it first drafts as with one block.
        D = self.cfg.dim
        for mod in self.layers:
            mod.proj.weight[:, :D].copy_(torch.eye(D))
            if mod.fuse is not None:
                nn.init.zeros_(mod.fuse.weight)
            for block in mod.extra_blocks:
                identity_block(block)

    @torch.no_grad()
    def init_from_model(self, model: Transformer) -> None:
        """Copy the main model's last block into every module's first block (same shapes when
        the last layer is dense): a trained block is a much better start than a random one."""
        last = model.layers[-1]
        src = {k: v for k, v in last.state_dict().items()}
        for mod in self.layers:
            own = mod.block.state_dict()
            if set(own) != set(src) or any(own[k].shape != src[k].shape for k in own):
                raise ValueError("init_from_model: the last block is not a dense block of the "
                                 "same shape (MoE?)")
            mod.block.load_state_dict(src)
        self.rotary = Rotary(model.cfg)

    @torch.no_grad()
    def calibrate(self, hidden: torch.Tensor) -> float:
        """Scale the projection's pass-through so a block copied from the main model sees inputs
        at the residual-stream scale it was trained on (RMSNorm(h) has RMS 1; a late-layer
        residual stream is far larger). hidden (B, T, D) main hidden states (with the tapped
        layers' after them: only the last are read); returns the scale."""
        rms = float(hidden[..., : self.cfg.dim].float().pow(2).mean(-1).sqrt().mean())
        D = self.cfg.dim
        for mod in self.layers:
            mod.proj.weight[:, :D].copy_(torch.eye(D) * rms)
        return rms

    def set_rope(self, cfg: ModelConfig) -> None:
        """Follow a context extension of the main model (same RoPE scaling)."""
        self.cfg = self.cfg.model_copy(update={"rope_scaling": cfg.rope_scaling,
                                               "rope_theta": cfg.rope_theta,
                                               "max_seq_len": cfg.max_seq_len})
        self.rotary = Rotary(self.cfg).to(next(self.parameters()).device)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor],
                doc_ids: torch.Tensor | None = None, detach: bool = False
                ) -> list[torch.Tensor]:
        """Training forward. hidden (B, T, D) main last hidden (before the final norm; with
        ``taps``, (B, T, (1 + len(taps)) D), the tapped layers' states after the last), tokens
        (B, T) the inputs. Returns hidden states per depth: depth k (1-based) is (B, T-k, D);
        row i predicts tokens[i + k + 1] (= targets[i + k]). ``detach``: module k+1 reads
        module k's states without sending gradients back, so each module learns its own depth
        only (otherwise module 1 also serves every deeper module's loss)."""
        outs = []
        h, tapped = self.split(hidden)
        T = tokens.shape[1]
        dtype = hidden.dtype
        for k, mod in enumerate(self.layers, start=1):
            if T - k <= 0:
                break
            cos, sin = self.rotary.tables(positions[:, : T - k])
            mask = None if doc_ids is None else document_mask(doc_ids[:, : T - k])
            prev = h[:, : T - k].detach() if detach and k > 1 else h[:, : T - k]
            prev = mod.reads(prev, None if tapped is None else tapped[:, : T - k])
            h = mod(prev, embed(tokens[:, k:]), cos.to(dtype), sin.to(dtype), mask)
            outs.append(h)
        return outs

    @torch.no_grad()
    def drafts(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               embed: Callable[[torch.Tensor], torch.Tensor],
               greedy: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
               doc_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each depth's greedy draft at every position, as ids of the whole vocabulary:
        depth k (B, T-k), row i the draft of tokens[i + k + 1] (arguments as `forward`'s;
        ``greedy`` is the main head's argmax over a vocabulary, `Transformer.greedy`)."""
        out = []
        for h in self(hidden, tokens, positions, embed, doc_ids):
            pick = greedy(h, self.draft_vocab)
            out.append(pick if self.draft_vocab is None else self.draft_vocab[pick])
        return out

    def split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The main model's states as the modules take them, (..., (1 + len(taps)) D) -> the
        last (..., D) and the tapped layers' (..., len(taps) D) (None without taps)."""
        D, n = self.cfg.dim, len(self.taps)
        if hidden.shape[-1] != (1 + n) * D:
            raise ValueError(f"MTP: hidden states {tuple(hidden.shape)}: the last layer's"
                             + (f" and layers {list(self.taps)}'" if n else "")
                             + f" expected, {(1 + n) * D} wide (Transformer.hidden(taps=...))")
        return hidden[..., :D], (hidden[..., D:] if n else None)

    def new_caches(self, max_len: int, dtype: torch.dtype = torch.float32) -> list[KVCache]:
        """One single-slot KV cache per module, a layer per block (decode-time drafting)."""
        bc = mtp_block_config(self.cfg, self.n_blocks)
        dev = next(self.parameters()).device
        return [KVCache(bc, 1, max_len, dtype=dtype, device=dev) for _ in self.layers]

    def step(self, k: int, h_prev: torch.Tensor, emb_next: torch.Tensor, cache: KVCache,
             parents: Sequence[int] | None = None, tapped: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Decode-time forward of module k (1-based), op by op: h_prev, emb_next (1, T, D) for
        the T positions following those already in `cache` (a cache position is a token
        position; ``parents``: the T are a tree, as `Transformer.forward` takes them;
        ``tapped`` (1, T, len(taps) D): the tapped layers' states at those positions).
        `draft_step` does the same in one C++ call where the kernels take it."""
        view = cache.view(0)
        module = self.layers[k - 1]
        prev = module.reads(h_prev, tapped)
        positions, mask = view.prepare(prev.shape[1], parents)  # (1, T); advances the length
        cos, sin = self.rotary.tables(positions)
        return module(prev, emb_next, cos.to(h_prev.dtype), sin.to(h_prev.dtype), mask, view)

    def draft_step(self, k: int, h_prev: torch.Tensor, tokens: list[int], cache: KVCache,
                   embed: torch.Tensor, norm: torch.Tensor, head: torch.Tensor,
                   rows: Sequence[int] | None = None, parents: Sequence[int] | None = None,
                   tapped: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`step` of module k fed token ids, with the logits of its positions ``rows``
        (default: the last): the embedding (``embed``, the main model's table), the module's
        input projection, its block, and the shared head (``norm``, ``head`` (V, D): the final
        norm and output projection, or a slice of it) in one C++ call, the projection of the
        tapped layers' states too. h_prev (T, D), T = len(tokens); ``parents`` as `step` takes
        them, ``tapped`` (T, len(taps) D). Returns h (T, D) and the logits (len(rows), V); None
        where the kernels do not take it (then `step`)."""
        module = self.layers[k - 1]
        fused = self.fused_layers(k, lambda: self._build_fused(module, embed, norm, head),
                                  embed, norm, head)
        if fused is None:
            return None
        T = len(tokens)
        if module.fuse is not None:  # the kernel adds F_k of them, as `MTPModule.reads` does
            h_prev = torch.cat([h_prev, module.check_tapped(tapped).to(h_prev.dtype)], -1)
        out = fused_pass(fused, cache.view(0), 1, T, tokens=[tokens], x=h_prev[None],
                         logits=[T - 1] if rows is None else rows, parents=parents)
        if out is None:
            return None
        h, logits = out
        assert logits is not None
        return h[0], logits[0]

    def _build_fused(self, module: MTPModule, embed: torch.Tensor, norm: torch.Tensor,
                     head: torch.Tensor) -> FusedLayers | None:
        parts = [block.decode_weights() for block in module.blocks]
        assert all(parts)  # MTP blocks are dense
        weights = [w for part in parts for w in part]  # type: ignore[union-attr]
        cfg = self.cfg
        return FusedLayers.build(weights, self.rotary.cos, self.rotary.sin, cfg.n_heads,
                                 cfg.n_kv_heads, cfg.norm_eps, embed=embed, norm=norm,
                                 head=head, mix=(module.norm_h.weight, module.norm_e.weight,
                                                 module.proj.weight,
                                                 *(() if module.fuse is None
                                                   else (module.fuse.weight,))))


def draft_counts(tokens: np.ndarray, segments: np.ndarray, vocab_size: int) -> torch.Tensor:
    """How often each id occurs in packed rows (`codedojo.data.packing.Packed`'s ``tokens`` and
    ``segments``), for `MTP.set_draft_vocab`. Padding (segment -1) is left out: it fills the
    last row, and the end of rows of whole documents, with the pad id, which counted would win
    a place in the draft vocabulary as if it were text."""
    tokens, segments = np.asarray(tokens), np.asarray(segments)
    if tokens.shape != segments.shape:
        raise ValueError(f"draft_counts: tokens {tokens.shape} and segments {segments.shape} "
                         "do not line up")
    return torch.from_numpy(np.bincount(tokens[segments >= 0], minlength=vocab_size))


def save_mtp(mtp: MTP, out_dir: str | Path) -> Path:
    """`mtp.safetensors` + `mtp.json` beside the model weights of a checkpoint."""
    from codedojo.paths import save_tensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in mtp.state_dict().items()}
    save_tensors(sd, out / "mtp.safetensors")
    vocab = 0 if mtp.draft_vocab is None else len(mtp.draft_vocab)
    (out / "mtp.json").write_text(json.dumps({"depth": mtp.depth, "draft_vocab": vocab,
                                              "taps": list(mtp.taps), "blocks": mtp.n_blocks}))
    return out


def grow_chain(state: dict[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """An MTP state dict of ``depth`` modules from one of fewer (a chain grown on a branch of a
    run): the missing modules start as copies of its last, which drafts the nearest depth and has
    the same shape. A state dict of ``depth`` modules or more comes back as it is."""
    saved = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.")),
                    default=-1)
    if not 0 < saved < depth:
        return state
    last = f"layers.{saved - 1}."
    grown = dict(state)
    for k in range(saved, depth):
        grown.update({f"layers.{k}.{name[len(last):]}": t.clone()
                      for name, t in state.items() if name.startswith(last)})
    return grown


def load_mtp(ckpt_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None
             ) -> MTP | None:
    """The checkpoint's MTP modules (their weights converted to ``dtype`` when given), or None
    when it has none (then decode without drafts)."""
    from safetensors.torch import load_file

    d = Path(ckpt_dir)
    if not (d / "mtp.safetensors").exists():
        return None
    meta = json.loads((d / "mtp.json").read_text())
    mtp = MTP(cfg, int(meta["depth"]), int(meta.get("draft_vocab", 0)), meta.get("taps", ()),
              int(meta.get("blocks", 1)))
    mtp.load_state_dict(load_file(str(d / "mtp.safetensors")))
    move_to_huge_pages(mtp, dtype)  # every draft reads them all, as a step reads the model's
    return mtp.eval()


@torch.no_grad()
def identity_block(block: Block) -> None:
    """Zero a block's output projections: x + 0 + 0, whatever its other weights."""
    nn.init.zeros_(block.attn.wo.weight)
    mlp = block.mlp
    assert isinstance(mlp, MLP)
    nn.init.zeros_(mlp.w_down.weight)


def mtp_valid_mask(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """Row i of depth k is trained when the next k+1 targets are all in-document:
    loss_mask[i..i+k] all true. (B, T) -> (B, T-k)."""
    T = loss_mask.shape[1]
    m = loss_mask[:, : T - k].clone()
    for j in range(1, k + 1):
        m &= loss_mask[:, j: T - k + j]
    return m


def distill_loss(mtp_logits: list[torch.Tensor], main_logits: torch.Tensor,
                 loss_mask: torch.Tensor, greedy: float = 0.0,
                 positions: Sequence[float] | None = None) -> torch.Tensor:
    """Self-distillation: mean over depths of KL(p_main(. | i+k) || q_k(. | i)), masked.

    ``main_logits`` are detached: the teacher's distribution is a fixed target, and no
    gradient flows back through it. The gradient leaves through ``mtp_logits`` only; where it
    goes from there is the stage's choice (`codedojo.pretrain.trainer.stage_loss`):
    - ``distill``: the main model is frozen and its states are computed without gradient, so
      only the MTP modules' own weights learn (norms, projections, blocks, taps' F_k).
    - ``joint``: the modules' logits come from the shared final norm and output projection
      and their inputs from the trunk's last (and tapped) hidden states and the shared
      embedding, so this loss (times ``mtp_weight``) also trains those: the trunk learns to
      serve the drafts, as in DeepSeek-V3's MTP. Only the teacher's side is cut: the head's
      logits at i+k are never pulled toward the drafts, but its weights are trained by them.

    Depth k's loss is its sum over the positions it trains on (`mtp_valid_mask`) divided by
    ``positions[k - 1]``, by default their number here: its mean. A step of several
    micro-batches passes the step's numbers, and its micro-batches' losses add up to the
    step's mean per depth (depth k trains on fewer positions than depth 1 where documents
    or trained spans are short, and unevenly so across micro-batches).

    ``greedy`` (w in [0, 1]) gives that share of each position's loss to the cross-entropy of
    the main head's greedy token instead, -log q_k(argmax p_main): a greedy draft passes when it
    is that token, and a module too small to match the whole distribution then spends more of
    itself on the top of it (as LK losses, Samarin et al. 2026, train the acceptance rate rather
    than the KL). The gradient in the logits is q - ((1 - w) p + w onehot(argmax p)):
    distillation toward the teacher sharpened onto its top token."""
    if not 0.0 <= greedy <= 1.0:
        raise ValueError(f"distill_loss: greedy {greedy} outside [0, 1]")
    teacher = F.log_softmax(main_logits.detach().float(), -1)  # (B, T, V)
    top = teacher.argmax(-1, keepdim=True) if greedy else None  # (B, T, 1)
    T = main_logits.shape[1]
    losses = []
    for k, logits in enumerate(mtp_logits, start=1):
        t = teacher[:, k:]  # (B, T-k, V)
        s = F.log_softmax(logits.float(), -1)
        loss = (t.exp() * (t - s)).sum(-1)  # (B, T-k): the KL
        if top is not None:
            ce = -s.gather(-1, top[:, k:]).squeeze(-1)
            loss = (1.0 - greedy) * loss + greedy * ce
        m = mtp_valid_mask(loss_mask, k)[:, : T - k].float()
        n = m.sum().clamp(min=1) if positions is None else positions[k - 1]
        losses.append((loss * m).sum() / n)
    return torch.stack(losses).mean()


def mtp_positions(loss_masks: Sequence[torch.Tensor], depth: int) -> list[int]:
    """Per depth, the positions `distill_loss` trains on in these batches."""
    return [sum(int(mtp_valid_mask(m, k).sum()) for m in loss_masks)
            for k in range(1, depth + 1)]
