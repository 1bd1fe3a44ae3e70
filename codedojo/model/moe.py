"""Mixture-of-experts feed-forward layer in the DeepSeek-V3 / Kimi K2 style.

Architectural choices (DeepSeek-V3 report, sec. 2.1.2):

* fine-grained routed experts (small SwiGLU FFNs) plus always-on shared expert(s);
* sigmoid affinities s_i = sigmoid(u . e_i), top-k selection, gates = normalised affinities of the
  selected experts times `route_scale` (with one expert, its affinity: normalised it would be 1
  whatever the router said, and the router would learn nothing);
* auxiliary-loss-free balancing: a per-expert bias b_i is added to the affinities *for selection
  only* (gates use the raw affinities); after each optimizer step, b_i moves by +gamma when expert i
  was under-loaded and -gamma when over-loaded (`update_bias`);
* an optional small sequence-wise balance loss  alpha * sum_i f_i P_i  (`aux_loss` after forward);
* both balancing signals count the tokens of text only: padding (`counting_tokens`), all one
  token, would pile onto a few experts and steer the biases and the loss away from the text's load;
* router replay: when `replay_indices` is set, those expert indices (chosen at inference time) are
  used instead of the top-k, while the gates are still computed from the router so gradients flow
  to it; the indices actually used are always left in `last_indices` so rollouts can return them.

Two implementations of the same math: `forward_reference` loops over tokens and experts (slow,
obviously right), `forward` sorts tokens by expert and runs each expert on its own contiguous
slice, so its work is that of the routed tokens however unevenly they are spread. Tests check one
against the other. The layer does not know about parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _moe_cfg(cfg: Any) -> Any:
    moe = getattr(cfg, "moe", None)
    if moe is None:
        raise ValueError("config.moe is not set: MoE needs a MoEConfig")
    return moe


def _dim(cfg: Any) -> int:
    for name in ("dim", "hidden_size", "d_model"):
        if hasattr(cfg, name):
            return int(getattr(cfg, name))
    raise ValueError("config has no hidden size field (dim / hidden_size)")


def _moe_field(moe: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if hasattr(moe, n):
            return getattr(moe, n)
    if default is None:
        raise ValueError(f"config.moe: missing field {names[0]!r}")
    return default


BALANCE_BUFFERS = ("expert_bias", "tokens_per_expert")


class MoE(nn.Module):
    """x (B, T, D) -> (B, T, D). Reads `cfg.moe` for its sizes."""

    def __init__(self, cfg: Any):
        super().__init__()
        m = _moe_cfg(cfg)
        self.dim = _dim(cfg)
        self.n_experts = int(_moe_field(m, "n_routed_experts", "num_experts"))
        self.top_k = int(_moe_field(m, "top_k", "num_experts_per_tok"))
        self.hidden = int(_moe_field(m, "expert_ffn_dim", "expert_hidden", "moe_intermediate_size"))
        self.n_shared = int(_moe_field(m, "n_shared_experts", default=1))
        self.route_scale = float(_moe_field(m, "route_scale", "routed_scaling_factor", default=1.0))
        self.aux_coef = float(_moe_field(m, "seq_aux_loss_coef", "aux_loss_alpha", default=0.0))
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"config.moe.top_k must be in [1, {self.n_experts}]")
        E, D, H = self.n_experts, self.dim, self.hidden
        self.router = nn.Linear(D, E, bias=False)
        # Stacked expert weights: one (E, ...) tensor each.
        self.w1 = nn.Parameter(torch.empty(E, D, H))  # gate proj
        self.w3 = nn.Parameter(torch.empty(E, D, H))  # up proj
        self.w2 = nn.Parameter(torch.empty(E, H, D))  # down proj
        if self.n_shared > 0:
            hs = H * self.n_shared
            self.shared_w1 = nn.Linear(D, hs, bias=False)
            self.shared_w3 = nn.Linear(D, hs, bias=False)
            self.shared_w2 = nn.Linear(hs, D, bias=False)
        # Balancing state: not parameters (no gradient), but saved with the checkpoint.
        self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)
        self.replay_indices: torch.Tensor | None = None  # (B, T, k) set by router_replay
        self.last_indices: torch.Tensor | None = None  # (B, T, k)
        self.counted: torch.Tensor | None = None  # (B, T) bool, the tokens balancing counts
        self.aux_loss: torch.Tensor | None = None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, out_std: float | None = None) -> None:
        """Normal(0, std) for the router and the gate/up projections, Normal(0, out_std) for
        the down projections, which write to the residual stream (default: std)."""
        out_std = std if out_std is None else out_std
        nn.init.normal_(self.router.weight, std=std)
        for w in (self.w1, self.w3):
            nn.init.normal_(w, std=std)
        nn.init.normal_(self.w2, std=out_std)
        if self.n_shared > 0:
            for lin in (self.shared_w1, self.shared_w3):
                nn.init.normal_(lin.weight, std=std)
            nn.init.normal_(self.shared_w2.weight, std=out_std)

    # ---- routing -------------------------------------------------------------------------

    def route(self, x: torch.Tensor, tokens: tuple[int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> indices (N, k), gates (N, k), scores (N, E); fp32 router math (in a
        bfloat16 model too: rounded logits would pick other experts, and tie). ``tokens``: the
        forward's (B, T), which replayed indices must match (default (1, N))."""
        w = self.router.weight.float()
        b = None if self.router.bias is None else self.router.bias.float()
        scores = torch.sigmoid(F.linear(x.float(), w, b))  # (N, E)
        if self.replay_indices is not None:
            _check_replay(self.replay_indices, self.top_k, tokens or (1, x.shape[0]))
            # (expert ids in range and distinct: checked once, by router_replay)
            idx = self.replay_indices.reshape(-1, self.top_k).to(x.device, torch.long)
        else:
            # The bias steers selection only; it never enters the gate values.
            idx = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        sel = scores.gather(-1, idx)
        if self.top_k > 1:  # normalised over the chosen experts; one expert's would be 1 always,
            sel = sel / (sel.sum(-1, keepdim=True) + 1e-20)  # and the router learn nothing
        gates = sel * self.route_scale
        return idx, gates, scores

    def _bookkeeping(self, idx: torch.Tensor, scores: torch.Tensor, B: int, T: int) -> None:
        self.last_indices = idx.detach().reshape(B, T, self.top_k)
        counted = (torch.ones(B, T, dtype=torch.bool, device=idx.device) if self.counted is None
                   else self.counted.to(idx.device).reshape(B, T))
        if self.training:
            self.tokens_per_expert += torch.bincount(
                idx.reshape(B, T, self.top_k)[counted].reshape(-1), minlength=self.n_experts
            ).to(self.tokens_per_expert)
        if self.aux_coef > 0 and self.training:
            # Sequence-wise balance loss (DeepSeek-V3 eq. 17-20) over each sequence's counted
            # tokens, averaged over sequences.
            E, k = self.n_experts, self.top_k
            w = counted.float().unsqueeze(-1)  # (B, T, 1)
            n = w.sum(1).clamp(min=1)  # (B, 1)
            onehot = torch.zeros(B, T, E, device=scores.device)
            onehot.scatter_(-1, idx.reshape(B, T, k), 1.0)
            f = (onehot * w).sum(1) * E / (k * n)  # (B, E)
            p = ((scores / scores.sum(-1, keepdim=True)).reshape(B, T, E) * w).sum(1) / n
            rows = (w.sum(1) > 0).float().squeeze(-1)  # (B,): sequences with tokens counted
            self.aux_loss = self.aux_coef * ((f * p).sum(-1) * rows).sum() / rows.sum().clamp(
                min=1)
        else:
            self.aux_loss = None

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        if self.n_shared == 0:
            return torch.zeros_like(x)
        return self.shared_w2(F.silu(self.shared_w1(x)) * self.shared_w3(x))

    # ---- forward, fast (grouped) and reference -------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        idx, gates, scores = self.route(flat, (B, T))
        self._bookkeeping(idx, scores, B, T)
        N, k = flat.shape[0], self.top_k
        # Sort the (token, slot) pairs by expert, so each expert's tokens form one contiguous
        # slice, and run each expert on its slice alone (idle experts not at all). Padding every
        # expert to the busiest one's load for a single batched matmul would cost up to E/k
        # times the routed tokens' memory and compute when routing is skewed.
        expert_of = idx.reshape(-1)  # (N*k,)
        order = torch.argsort(expert_of, stable=True)
        token_of = order // k
        xs = flat[token_of]  # (N*k, D), grouped by expert
        out = _grouped_experts(xs, expert_of, self.w1, self.w3, self.w2)
        contrib = out * gates.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        routed = flat.new_zeros(N, D).index_add_(0, token_of, contrib)
        return (routed + self._shared(flat)).reshape(B, T, D)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token, per-expert loop: the definition the fast path must match."""
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        idx, gates, scores = self.route(flat, (B, T))
        self._bookkeeping(idx, scores, B, T)
        rows = []
        for n in range(flat.shape[0]):
            acc = torch.zeros(D, dtype=x.dtype, device=x.device)
            for j in range(self.top_k):
                e = int(idx[n, j])
                h = F.silu(flat[n] @ self.w1[e]) * (flat[n] @ self.w3[e])
                acc = acc + gates[n, j].to(x.dtype) * (h @ self.w2[e])
            rows.append(acc)
        return (torch.stack(rows) + self._shared(flat)).reshape(B, T, D)

    # ---- balancing -----------------------------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> MoE:
        """Moves and casts as any module, except that the balancing state stays float32: a
        bias step (gamma, about 1e-3) is below bfloat16's resolution at the bias's size, a
        count past 256 is too, and a bfloat16 engine would route otherwise than its trainer."""
        before = {name: self._buffers[name] for name in BALANCE_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old is not None and new is not None and new.dtype != torch.float32:
                src = old if old.dtype == torch.float32 else new
                self._buffers[name] = src.to(device=new.device, dtype=torch.float32)
        return self

    @torch.no_grad()
    def update_bias(self, gamma: float) -> None:
        """Aux-loss-free balancing step: nudge each bias by gamma toward the mean load, then
        forget the counts. Call after the optimizer step."""
        load = self.tokens_per_expert
        if load.sum() == 0:
            return
        self.expert_bias += gamma * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


@torch.compiler.disable
def _grouped_experts(xs: torch.Tensor, expert_of: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """xs (M, D), rows grouped by expert in expert order, ``expert_of`` (M,) each row's expert
    (in any order) -> (M, D): each expert's SwiGLU on its own rows, idle experts skipped.

    Eager under ``torch.compile``: the slices' sizes are data, and a compiled graph guards the
    sizes it is traced with (0 and 1 apart from the rest), so every new pattern of idle or
    one-token experts would compile another graph, until the recompile limit made the whole
    block eager. Outside, the graphs see only M."""
    counts = torch.bincount(expert_of, minlength=w1.shape[0]).tolist()
    outs = [(F.silu(xe @ a) * (xe @ b)) @ c
            for xe, n, a, b, c in zip(xs.split(counts), counts, w1.unbind(0), w3.unbind(0),
                                      w2.unbind(0), strict=True) if n]
    return torch.cat(outs) if outs else xs  # no rows: (0, D)


def _check_replay(idx: torch.Tensor, top_k: int, tokens: tuple[int, int] | None = None) -> None:
    """Replayed expert indices must be integer ids, (B, T, top_k) or, when B == 1, (T, top_k);
    for a forward of ``tokens`` (B, T), that forward's B and T exactly."""
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"replay_indices: expert ids must be integers, got {idx.dtype}")
    if tokens is None:
        if idx.ndim in (2, 3) and idx.shape[-1] == top_k:
            return
        raise ValueError(f"replay_indices: {tuple(idx.shape)} must be (B, T, {top_k}) or "
                         f"(T, {top_k}): top_k expert ids a token")
    B, T = tokens
    shapes = [(B, T, top_k), *([(T, top_k)] if B == 1 else [])]
    if tuple(idx.shape) not in shapes:
        raise ValueError(f"replay_indices: {tuple(idx.shape)} for a forward of {B}x{T} tokens "
                         f"of top_k {top_k}: must be {' or '.join(map(str, shapes))}")


# ---- model-level helpers (the MoE layers are found by type, the model needs no hooks) ------


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def update_moe_biases(model: nn.Module, gamma: float) -> None:
    for m in moe_layers(model):
        m.update_bias(gamma)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def recorded_routing(model: nn.Module) -> list[torch.Tensor]:
    """Expert indices used by the last forward, one (B, T, k) tensor per MoE layer in order."""
    out = []
    for m in moe_layers(model):
        if m.last_indices is None:
            raise RuntimeError("no forward has run since the model was built")
        out.append(m.last_indices)
    return out


@contextmanager
def counting_tokens(model: nn.Module, counted: torch.Tensor | None):
    """Within the block, the MoE layers' balancing (the load that moves the biases, the balance
    loss) counts only the tokens ``counted`` (B, T) marks: a forward's text, not its padding.
    None: every token."""
    layers = moe_layers(model)
    try:
        for m in layers:
            m.counted = counted
        yield
    finally:
        for m in layers:
            m.counted = None


@contextmanager
def router_replay(model: nn.Module, indices: Sequence[torch.Tensor]):
    """Within the block, every MoE layer uses the given expert indices, (B, T, k) or (T, k) per
    layer in order, instead of choosing its own: `recorded_routing` at inference, or a rollout's
    ``Completion.routed_experts`` (tokens, layers, k) as ``routed_experts.unbind(-2)``."""
    layers = moe_layers(model)
    if len(indices) != len(layers):
        raise ValueError(f"router_replay: {len(indices)} index tensors for {len(layers)} MoE layers")
    for m, idx in zip(layers, indices, strict=True):  # once, not at every forward that reads them
        _check_replay(idx, m.top_k)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= m.n_experts):
            raise ValueError(f"replay_indices: expert ids {int(idx.min())}..{int(idx.max())} "
                             f"outside [0, {m.n_experts})")
        if m.top_k > 1 and bool((idx.sort(-1).values.diff(dim=-1) == 0).any()):
            raise ValueError("replay_indices: a token's experts must differ")
    try:
        for m, i in zip(layers, indices, strict=True):
            m.replay_indices = i
        yield
    finally:
        for m in layers:
            m.replay_indices = None


@torch.no_grad()
def upcycle_mlp(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, moe: MoE) -> MoE:
    """Dense SwiGLU (weights as nn.Linear stores them: gate/up (F, D), down (D, F)) -> MoE.

    Function-preserving: the shared expert becomes the dense FFN (so the MoE starts as the dense
    model exactly) when its width matches; routed experts start from disjoint neuron slices of the
    dense FFN (diverse, so the router has something to tell apart) with zeroed down projections,
    which then learn.
    """
    Fdim, D = w_gate.shape
    if moe.n_shared == 0 or moe.shared_w1.weight.shape[0] != Fdim:
        raise ValueError(f"upcycle: shared expert width must equal the dense FFN width {Fdim} "
                         "(set moe.n_shared_experts * moe.expert_ffn_dim accordingly)")
    moe.shared_w1.weight.copy_(w_gate)
    moe.shared_w3.weight.copy_(w_up)
    moe.shared_w2.weight.copy_(w_down)
    H = moe.hidden
    for e in range(moe.n_experts):
        sl = torch.arange(e * H, (e + 1) * H) % Fdim
        moe.w1[e].copy_(w_gate[sl].T)
        moe.w3[e].copy_(w_up[sl].T)
    moe.w2.zero_()
    return moe


@torch.no_grad()
def upcycle_model(dense: nn.Module, moe_cfg: Any) -> nn.Module:
    """A dense `Transformer` -> the same model with MoE layers (from `moe_cfg.first_dense_layers`
    on), every non-MLP weight copied and each MLP upcycled by `upcycle_mlp`. With
    `n_shared_experts * expert_ffn_dim == ffn_dim` the result computes the same function."""
    from codedojo.model.transformer import MLP, Transformer

    cfg = dense.cfg.model_copy(update={"moe": moe_cfg})  # type: ignore[union-attr]
    model = Transformer(cfg)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in dense.state_dict().items() if k in own},
                          strict=False)
    for blk_d, blk_m in zip(dense.layers, model.layers, strict=True):  # type: ignore[arg-type]
        if isinstance(blk_m.mlp, MoE):
            mlp = blk_d.mlp
            assert isinstance(mlp, MLP)
            gate, up = mlp.w_gate_up.weight.split(mlp.hidden, dim=0)
            upcycle_mlp(gate, up, mlp.w_down.weight, blk_m.mlp)
    return model
