"""Next-token cross-entropy fused with the output projection, computed in chunks of rows.

The plain loss materialises float32 logits for every position (B·T·V: 200 MB for 4 × 256 tokens
with a 49k vocabulary, 1.6 GB per 8k-token row in the long-context stage), then a log-softmax of
the same size, then its gradient. Here the trained positions are taken in chunks; each chunk's
logits live only while its loss and its gradients (for the hidden states and for the projection)
are computed, in the forward pass (the backward pass only scales them). The matrix multiplies are
the ones backpropagation would run anyway; what goes is the full-size logits, log-softmax and
gradient buffers, and every untrained position (prompts in SFT rows, padding) costs nothing.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_ROWS = 1024


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                chunk: int, grads: bool) -> torch.Tensor:
        """h (N, D) normed hidden states of trained positions, w (V, D), targets (N,) ->
        summed loss. ``grads``: whether autograd will want gradients (computed here)."""
        want_h = grads and ctx.needs_input_grad[0]
        want_w = grads and ctx.needs_input_grad[1]
        acc = torch.promote_types(h.dtype, torch.float32)  # bf16 inputs: float32 sums
        # Under autocast (`dtype = "bf16"`) the products run in its dtype, as the unfused loss's
        # would; the casts are spelled out, since in-place products take no autocast.
        dev = h.device.type
        mm = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        wm = w.to(mm)
        total = h.new_zeros((), dtype=acc)
        dh = torch.empty_like(h) if want_h else None
        dw: torch.Tensor | None = None
        for i in range(0, h.shape[0], chunk):
            hc, tc = h[i:i + chunk].to(mm), targets[i:i + chunk]
            # One (C, V) buffer per chunk, worked in place: shift by the max, exponentiate,
            # normalise (a fresh full-size temporary costs page faults as well as bandwidth).
            z = (hc @ wm.t()).to(acc)  # (C, V) logits
            z.sub_(z.amax(-1, keepdim=True))
            picked = z.gather(1, tc[:, None])[:, 0]
            e = z.exp_()
            norm = e.sum(-1)
            total += (norm.log() - picked).sum()  # log-sum-exp minus the target's logit
            if want_h or want_w:
                p = e.div_(norm[:, None])  # softmax
                p[torch.arange(len(tc), device=p.device), tc] -= 1.0  # d loss / d logits
                if dh is not None:
                    dh[i:i + chunk] = p.to(mm) @ wm
                if want_w:  # the first chunk writes, the rest accumulate (no zero fill)
                    if dw is None:
                        dw = (p.to(mm).t() @ hc).to(acc)
                    elif mm == acc:
                        dw.addmm_(p.t(), hc)
                    else:  # a bf16 product, summed over the chunks in float32
                        dw += p.to(mm).t() @ hc
        if want_w and dw is None:  # no trained position
            dw = torch.zeros_like(w)
        ctx.save_for_backward(dh if dh is not None else h.new_empty(0),
                              dw.to(w.dtype) if dw is not None else w.new_empty(0))
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dh, dw = ctx.saved_tensors
        gh = dh * grad.to(dh.dtype) if ctx.needs_input_grad[0] else None
        gw = dw * grad.to(dw.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                         mask: torch.Tensor, chunk: int = CHUNK_ROWS) -> torch.Tensor:
    """Mean cross-entropy of ``softmax(h @ w.T)`` against ``targets`` over the positions where
    ``mask`` is true. h (..., D) final-normed hidden states, w (V, D), targets and mask (...).
    A batch with no trained position gives 0 (an SFT row holding only a long prompt)."""
    if targets.shape != h.shape[:-1] or mask.shape != targets.shape:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(h.shape)}, targets "
                         f"{tuple(targets.shape)} and mask {tuple(mask.shape)} do not line up")
    hm, tm = h[mask], targets[mask]
    grads = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    loss = _LinearCrossEntropy.apply(hm, w, tm, chunk, grads)
    return loss / mask.sum().clamp(min=1)
