"""Rotary position embeddings (Su et al. 2021) with the two ways we stretch them for long context:
a base-frequency change, and YaRN (Peng et al. 2023).

Layout follows the Hugging Face Llama convention ("rotate half"): dimension i is paired with
i + head_dim/2, not with its neighbour. GGUF files store Q/K permuted for the interleaved
convention; ``gguf.py`` undoes that permutation at import.
"""

from __future__ import annotations

import math

import torch

from codedojo.model.config import ModelConfig, RopeScaling


def _yarn_correction_dim(n_rotations: float, head_dim: int, theta: float, orig_len: int) -> float:
    """The (fractional) dim index whose wavelength fits ``n_rotations`` times in ``orig_len``."""
    return head_dim * math.log(orig_len / (n_rotations * 2 * math.pi)) / (2 * math.log(theta))


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair angular frequencies, shape (head_dim/2,), float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling.kind == "base":
        theta = float(scaling.new_theta)  # type: ignore[arg-type]
    inv = 1.0 / (theta**exponents)
    if scaling is None or scaling.kind != "yarn" or scaling.factor <= 1.0:
        return inv
    # YaRN "NTK-by-parts": keep high-frequency dims (many rotations over the original context),
    # interpolate low-frequency ones by the factor, ramp linearly in between.
    lo = math.floor(_yarn_correction_dim(scaling.beta_fast, head_dim, theta,
                                         scaling.original_max_seq_len))
    hi = math.ceil(_yarn_correction_dim(scaling.beta_slow, head_dim, theta,
                                        scaling.original_max_seq_len))
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 = extrapolate (keep), 0 = interpolate
    return (inv / scaling.factor) * (1 - keep) + inv * keep


class Rotary(torch.nn.Module):
    """Precomputed cos/sin tables for positions [0, max_seq_len); indexed by position ids."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.hd
        inv = inv_frequencies(hd, cfg.rope_theta, cfg.rope_scaling)
        pos = torch.arange(cfg.max_seq_len, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]  # (S, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (S, hd)
        scale = cfg.rope_scaling.attention_factor if cfg.rope_scaling else 1.0
        cos, sin = emb.cos() * scale, emb.sin() * scale
        # "Rotate half" as one flip: rot(x) = [-x2, x1], so x*cos + rot(x)*sin equals
        # x*cos + flip_halves(x) * [-sin1, sin2].
        half = hd // 2
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin_signed, persistent=False)
        self.max_seq_len = cfg.max_seq_len

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) long -> cos, sin each (B, T, 1, hd), broadcastable over heads."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, hd) -> rotated, same shape. ``sin`` is the signed table from ``Rotary``."""
    hd = x.shape[-1]
    swapped = x.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * sin
