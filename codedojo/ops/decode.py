"""``decode_layers``: every dense layer for up to 16 new tokens against a KV cache, in one C++
call (``decode_step.cpp``): a decode step, a speculative verification pass, a short prefill.

Run op by op, a batch-1 decode step of SmolLM2-135M spends two thirds as long again on a
thousand small tensor ops and their dispatch as on reading the weights (11 of 28 ms here);
this call leaves the weight reads.
The caller (``Transformer.hidden``) has already reserved the cache and advanced its lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from codedojo.ops.gemm import KERNEL_DTYPES, MAX_ROWS, load_kernel

PER_LAYER = 7  # attn_norm, wqkv, bqkv (or an empty tensor), wo, mlp_norm, w_gate_up, w_down


def decode_layers(x: torch.Tensor, weights: Sequence[torch.Tensor], k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: Sequence[int], positions: Sequence[int],
                  cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int, eps: float
                  ) -> torch.Tensor | None:
    """x (N, D) embedded tokens -> hidden states after the last layer (N, D). Token i's key and
    value go to position ``positions[i]`` of cache slot ``slots[i]`` (caches laid out
    (layers, slots, kv_heads, capacity, head_dim)) and it attends to positions
    ``[0, positions[i]]`` of that slot, tokens of this call included; cos/sin (N, head_dim) are
    the RoPE tables at each token's position. Weights and caches are float32, or all bfloat16
    (read at half the bytes; sums in float32, the activations rounded to bfloat16 for the
    products where the CPU multiplies bfloat16 pairs (AVX512-BF16); the result in x's dtype).
    None when the kernels are unavailable or the inputs are not what they take (the caller
    then runs the layers op by op)."""
    if not (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.device.type == "cpu"
            and x.dtype in KERNEL_DTYPES and weights and len(weights) % PER_LAYER == 0
            and weights[1].dtype == k_cache.dtype and k_cache.dtype in KERNEL_DTYPES
            and not torch.is_grad_enabled()):
        return None
    kernel = load_kernel()
    if kernel is None:
        return None
    f32 = torch.float32
    y = kernel.decode_layers(x.to(f32), list(weights), k_cache, v_cache, list(slots),
                             list(positions), cos.to(f32).contiguous(),
                             sin.to(f32).contiguous(), n_heads, n_kv, eps)
    return y.to(x.dtype)
