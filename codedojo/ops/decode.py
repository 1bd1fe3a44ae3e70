"""``FusedLayers``: every dense layer of a model for up to 16 new tokens against a KV cache, in
one C++ call (``decode_step.cpp``), with the token embedding before them and the final norm and
output head after them: a decode step, a speculative verification pass, a short prefill.

Run op by op, a batch-1 decode step of SmolLM2-135M spends two thirds as long again on a
thousand small tensor ops and their dispatch as on reading the weights (11 of 28 ms here);
this object leaves the weight reads. It holds the weights (listed and checked once); a call
passes token ids, cache slots and positions. The caller (``Transformer``) has already
reserved the cache and advanced its lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from codedojo.ops.gemm import KERNEL_DTYPES, load_kernel
from codedojo.ops.huge_pages import huge_page_empty

PER_LAYER = 7  # attn_norm, wqkv, bqkv (or an empty tensor), wo, mlp_norm, w_gate_up, w_down
_EMPTY = torch.empty(0)


class FusedLayers:
    """Layers (``PER_LAYER`` tensors each, as ``Block.decode_weights`` lists them) held by the
    C++ kernel. Float32 matrices are read from a copy laid out for the kernel (``panels.h``:
    as much memory again as those weights), packed again by the next call when a weight's
    version counter has moved: weights updated in place by tensor ops (``copy_``, an
    optimizer step that is not fused) are seen by the next call. Writes that leave the
    counter alone are not: a fused optimizer step (``torch.optim.AdamW(fused=True)``), writes
    through ``.data``, writes to inference tensors (made under ``torch.inference_mode()``,
    which keep no counter); build again after those (`FusedModule.weights_changed`). Replaced
    weights are not seen either (build again)."""

    def __init__(self, handle: Any, dtype: torch.dtype) -> None:
        self._handle, self.dtype = handle, dtype

    @classmethod
    def build(cls, weights: Sequence[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
              n_heads: int, n_kv: int, eps: float, *, embed: torch.Tensor | None = None,
              norm: torch.Tensor | None = None, head: torch.Tensor | None = None,
              mix: Sequence[torch.Tensor] = ()) -> FusedLayers | None:
        """cos, sin (positions, head_dim): the RoPE tables, rounded to the weights' type as
        the layers run op by op use them. ``embed`` (vocab, D) lets calls pass token ids;
        ``norm`` and ``head`` (V, D) let them ask for logits. ``mix`` (an MTP module's
        ``norm_h``, ``norm_e`` and ``proj`` weights): calls pass the previous depth's hidden
        states and token ids, and the layers' input is proj [norm_h(x); norm_e(embed[ids])].
        With a fourth, ``fuse`` (D, n D): x's rows are [h, t_1, ..., t_n] (the tapped layers'
        states beside the previous depth's), and the module reads h + fuse [RMSNorm(t_1); ...]
        (norms without weights) in place of x, as `MTPModule.reads` computes it.
        Weights are float32, or all bfloat16 (read at half the bytes; sums in float32, the
        activations rounded to bfloat16 for the products where the CPU multiplies bfloat16
        pairs, AVX512-BF16), every tensor of one type. None when the kernels are unavailable
        or do not take these weights (the caller then runs the layers op by op)."""
        held = [t for t in (embed, norm, head, *mix) if t is not None]
        if not (weights and len(weights) % PER_LAYER == 0 and weights[1].dtype in KERNEL_DTYPES
                and all(t.dtype == weights[1].dtype and t.device.type == "cpu"
                        and t.is_contiguous() for t in [*weights, *held] if t.numel())):
            return None  # (an empty tensor: a bias the layers have not)
        kernel = load_kernel()
        if kernel is None:
            return None
        dtype, f32 = weights[1].dtype, torch.float32
        handle = kernel.FusedLayers(
            [w.detach() for w in weights], cos.to(dtype).to(f32).contiguous(),
            sin.to(dtype).to(f32).contiguous(), n_heads, n_kv, eps,
            *(_EMPTY if t is None else t.detach() for t in (embed, norm, head)),
            [t.detach() for t in mix], lambda n: huge_page_empty((n,), f32))
        return cls(handle, dtype)

    def takes(self, k_cache: torch.Tensor) -> bool:
        """Whether a call over this cache runs here: not while gradients are on, and only over
        caches of the weights' type."""
        return not torch.is_grad_enabled() and k_cache.dtype == self.dtype

    def __call__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: Sequence[int],
                 positions: Sequence[int], *, x: torch.Tensor | None = None,
                 tokens: Sequence[int] = (), logit_rows: Sequence[int] = (),
                 rope: Sequence[int] = (), parents: Sequence[int] = (),
                 taps: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens as x (N, D) embedded, or as ids ``tokens`` (with ``mix``, both: x the
        previous depth's hidden states; with its ``fuse``, (N, D + n D), the tapped layers'
        states beside them). Token i's key and value
        go to position ``positions[i]`` of cache slot ``slots[i]`` (caches laid out (layers,
        slots, kv_heads, capacity, head_dim), as ``takes``) and it attends to positions
        ``[0, positions[i]]`` of that slot, tokens of this call included. Returns the hidden
        states after the last layer (N, D) in the weights' type and float32 logits
        (len(logit_rows), V) of the rows ``logit_rows``. ``taps`` (increasing layer indexes):
        the states after those layers follow the last ones in each row, (N, (1 + len(taps)) D).

        A tree of tokens (``parents``: each one's parent's index in this call, or -1; ``rope``:
        their RoPE positions, a parent's plus one): token i is rotated as at ``rope[i]`` and
        attends to positions ``[0, rope[r])`` of its slot, r its first ancestor in the call,
        then to its ancestors' positions and its own, as if they were the whole sequence."""
        x32 = _EMPTY if x is None else x.to(torch.float32)
        h, logits = self._handle.run(x32, list(tokens), k_cache, v_cache, list(slots),
                                     list(positions), list(logit_rows), list(rope),
                                     list(parents), list(taps))
        return h.to(self.dtype), logits
