"""Model configuration: one pydantic model describes a Llama-family decoder, optionally with MoE
layers and MTP modules. Weight importers build it from GGUF metadata or an HF ``config.json``."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RopeScaling(BaseModel):
    """How rotary frequencies are changed to reach a longer context.

    kind "yarn": YaRN (Peng et al. 2023). Frequencies whose wavelength is short compared with the
    original context (more than ``beta_fast`` rotations) are kept, those with few rotations (less
    than ``beta_slow``) are interpolated by ``factor``, with a linear ramp between; attention
    logits are scaled by the temperature 0.1·ln(factor)+1 (applied to cos/sin, as in the paper).

    kind "base": a plain base-frequency change (``rope_theta`` is replaced by ``new_theta``).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["yarn", "base"] = "yarn"
    factor: float = Field(1.0, ge=1.0, description="context extension factor s (yarn)")
    original_max_seq_len: int = Field(
        8192, ge=1, description="context length the base model was trained with (yarn)"
    )
    beta_fast: float = Field(32.0, description="rotations above which a dim is kept (yarn)")
    beta_slow: float = Field(1.0, description="rotations below which a dim is interpolated")
    new_theta: float | None = Field(None, gt=0, description="new RoPE base (kind 'base')")

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.kind == "base" and self.new_theta is None:
            raise ValueError("rope_scaling.new_theta is required when kind is 'base'")
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"rope_scaling: beta_fast ({self.beta_fast}) must be above "
                             f"beta_slow ({self.beta_slow})")
        return self

    @property
    def attention_factor(self) -> float:
        """Multiplier on cos/sin (so on q·k it is applied squared, as YaRN specifies)."""
        if self.kind != "yarn" or self.factor <= 1.0:
            return 1.0
        return 0.1 * math.log(self.factor) + 1.0


class MoEConfig(BaseModel):
    """DeepSeek-V3 style mixture of experts (the layer lives in ``moe.py``)."""

    model_config = ConfigDict(extra="forbid")

    n_routed_experts: int = Field(8, ge=1, description="fine-grained routed experts per layer")
    n_shared_experts: int = Field(1, ge=0, description="always-on shared experts")
    top_k: int = Field(2, ge=1, description="routed experts chosen per token")
    expert_ffn_dim: int = Field(256, ge=1, description="hidden size of one expert's SwiGLU")
    first_dense_layers: int = Field(1, ge=0, description="leading layers that keep a dense MLP")
    bias_update_speed: float = Field(
        1e-3, ge=0, description="γ: step of the aux-loss-free per-expert selection bias"
    )
    seq_aux_loss_coef: float = Field(0.0, ge=0, description="sequence-wise balance loss weight")
    route_scale: float = Field(1.0, gt=0, description="multiplier on the normalised gates")

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.n_routed_experts:
            raise ValueError(
                f"moe.top_k ({self.top_k}) must be <= moe.n_routed_experts "
                f"({self.n_routed_experts})"
            )
        return self


class ModelConfig(BaseModel):
    """A Llama-family decoder: RMSNorm, SwiGLU, RoPE, grouped-query attention."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(49152, ge=1)
    dim: int = Field(576, ge=1, description="model (residual stream) width")
    n_layers: int = Field(30, ge=1)
    n_heads: int = Field(9, ge=1, description="query heads")
    n_kv_heads: int = Field(3, ge=1, description="key/value heads (GQA groups)")
    head_dim: int | None = Field(None, ge=1, description="defaults to dim // n_heads")
    ffn_dim: int = Field(1536, ge=1, description="SwiGLU hidden size of a dense MLP")
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    max_seq_len: int = Field(8192, ge=1)
    tie_embeddings: bool = True
    attn_bias: bool = Field(False, description="biases on q/k/v projections (Qwen2)")
    rope_scaling: RopeScaling | None = None
    moe: MoEConfig | None = None
    n_mtp: int = Field(0, ge=0, description="number of sequential MTP modules")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must divide by n_heads ({self.n_heads})")
        if self.hd % 2:
            raise ValueError(f"head_dim ({self.hd}) must be even for RoPE")
        return self

    @property
    def hd(self) -> int:
        """Per-head width."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        """SmolLM2-135M(-Instruct) shapes."""
        return cls(
            vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
            norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
        )

    @classmethod
    def tiny(cls, **overrides: object) -> ModelConfig:
        """A few-hundred-thousand-parameter model for tests."""
        base: dict[str, object] = dict(
            vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
            norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256, tie_embeddings=True,
        )
        base.update(overrides)
        return cls.model_validate(base)
