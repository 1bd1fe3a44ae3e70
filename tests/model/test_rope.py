"""RoPE, base change and YaRN against transformers' reference frequencies; relative-position
invariance of the rotation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from codedojo.model.config import ModelConfig, RopeScaling
from codedojo.model.rope import Rotary, apply_rotary, inv_frequencies

pytestmark = pytest.mark.usefixtures("one_thread")


def test_yarn_frequencies_and_temperature_match_transformers() -> None:
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=32768,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 8192,
                                      "beta_fast": 32.0, "beta_slow": 1.0})
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    s = RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=8192)
    ours = inv_frequencies(64, 10000.0, s)
    assert torch.allclose(ours, ref_inv.float(), rtol=1e-6)
    assert math.isclose(s.attention_factor, ref_scale, rel_tol=1e-6)
    assert math.isclose(s.attention_factor, 0.1 * math.log(4.0) + 1)
    # high-frequency dims are kept, the lowest one is interpolated by the factor
    plain = inv_frequencies(64, 10000.0, None)
    assert ours[0] == plain[0] and torch.isclose(ours[-1], plain[-1] / 4)


def test_base_change_uses_new_theta() -> None:
    s = RopeScaling(kind="base", new_theta=500000.0)
    assert torch.allclose(inv_frequencies(64, 10000.0, s), inv_frequencies(64, 500000.0, None))


def test_rotation_depends_only_on_relative_position() -> None:
    cfg = ModelConfig.tiny(max_seq_len=64)
    rot = Rotary(cfg)
    q, k = torch.randn(1, 1, 1, cfg.hd), torch.randn(1, 1, 1, cfg.hd)

    def score(pq: int, pk: int) -> float:
        cq, sq = rot.tables(torch.tensor([[pq]]))
        ck, sk = rot.tables(torch.tensor([[pk]]))
        return float((apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum())

    assert math.isclose(score(7, 3), score(40, 36), rel_tol=1e-4)
    assert not math.isclose(score(7, 3), score(7, 6), rel_tol=1e-3)
