"""HF safetensors: export loads in transformers with the same logits; Llama and Qwen2 import."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from codedojo.model.config import ModelConfig
from codedojo.model.hf import save_hf
from codedojo.model.transformer import Transformer
from codedojo.model.weights import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _roundtrip(cfg: ModelConfig, tmp_path) -> None:
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("bias"):
                p.normal_()  # zero-initialised biases would not test their mapping
    out = save_hf(ours, cfg, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() < 1e-5
    back, cfg2 = load_model(out)  # and our own import of the export
    assert cfg2.attn_bias == cfg.attn_bias and cfg2.tie_embeddings == cfg.tie_embeddings
    with torch.no_grad():
        assert torch.equal(back(tokens), ours(tokens))


def test_llama_export_import(tmp_path) -> None:
    _roundtrip(ModelConfig.tiny(), tmp_path)


def test_qwen2_style_biases_untied_export_import(tmp_path) -> None:
    _roundtrip(ModelConfig.tiny(attn_bias=True, tie_embeddings=False), tmp_path)
