"""A tiny mixture-of-experts model for tests: three layers, the last two MoE."""

from __future__ import annotations

import torch

from codedojo.model.config import ModelConfig, MoEConfig
from codedojo.model.transformer import Transformer

TOP_K = 2
MOE_LAYERS = 2


def tiny_moe(vocab_size: int = 96, max_seq_len: int = 256) -> Transformer:
    torch.manual_seed(0)
    moe = MoEConfig(n_routed_experts=8, top_k=TOP_K, expert_ffn_dim=16, n_shared_experts=1,
                    first_dense_layers=1)
    m = Transformer(ModelConfig.tiny(dim=24, n_layers=3, vocab_size=vocab_size,
                                     max_seq_len=max_seq_len, moe=moe))
    m.init_weights(std=0.5)
    return m.eval()
