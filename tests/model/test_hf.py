"""HF safetensors: export loads in transformers with the same logits; Llama and Qwen2 import."""

from __future__ import annotations

import math

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


def test_the_export_says_the_dtype_its_weights_are_saved_in(tmp_path) -> None:
    """transformers' ``dtype="auto"`` loads by the config's word: a bfloat16 model is one."""
    import json

    from safetensors import safe_open

    cfg = ModelConfig.tiny()
    out = save_hf(Transformer(cfg).to(torch.bfloat16), cfg, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(hf.parameters()).dtype == torch.bfloat16


def test_an_hf_yarn_config_serves_its_extended_length_and_unknown_knobs_are_refused() -> None:
    from codedojo.model.hf import config_from_hf

    hf = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32768,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}}
    cfg = config_from_hf(hf)
    assert cfg.max_seq_len == 131072 and cfg.rope_scaling.factor == 4.0
    # knobs that give another attention factor than the default, as transformers reads them
    # (an explicit 1.0 too, and two equal mscales, whose ratio is 1)
    for knob in ({"attention_factor": 0.8}, {"attention_factor": 1.0},
                 {"mscale": 1, "mscale_all_dim": 1}, {"mscale": 0.707, "mscale_all_dim": 1},
                 {"truncate": False}):
        bad = {**hf, "rope_scaling": {**hf["rope_scaling"], **knob}}
        with pytest.raises(ValueError, match=f"rope_scaling: .*{next(iter(knob))}"):
            config_from_hf(bad)
    # and those that come to the default are as good as absent
    for knob in ({"mscale": 0.707}, {"attention_factor": 0.1 * math.log(4.0) + 1},
                 {"mscale": 1, "mscale_all_dim": 0}):
        assert config_from_hf({**hf, "rope_scaling": {**hf["rope_scaling"], **knob}}) == cfg
    # no factor: transformers takes it from the two lengths
    derived = {**hf, "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "yarn", "original_max_position_embeddings": 32768}}
    assert config_from_hf(derived).rope_scaling.factor == 4.0
    with pytest.raises(ValueError, match="YaRN needs a number `factor`"):
        config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn"}})


def test_an_moe_export_is_refused_before_anything_is_written(tmp_path) -> None:
    from codedojo.model.config import MoEConfig

    cfg = ModelConfig.tiny(moe=MoEConfig(n_routed_experts=4, top_k=2, expert_ffn_dim=16))
    with pytest.raises(ValueError, match="moe: MoE models have no Llama/Qwen2 HF config"):
        save_hf(Transformer(cfg), cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_settings_and_tensors_that_would_give_other_logits_are_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from codedojo.model.hf import config_from_hf

    hf = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 64}
    with pytest.raises(ValueError, match="hidden_act: 'gelu' is not supported"):
        config_from_hf({**hf, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="use_sliding_window: true is not supported"):
        config_from_hf({**hf, "use_sliding_window": True})
    assert config_from_hf({**hf, "hidden_act": "silu", "use_sliding_window": False})

    cfg = ModelConfig.tiny(vocab_size=32)
    save_hf(Transformer(cfg), cfg, tmp_path)
    path = tmp_path / "model.safetensors"
    sd = load_file(str(path))
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    moved = {**sd, q: torch.cat([sd[q], sd[k][:1]]), k: sd[k][1:]}  # the same rows in all
    save_file(moved, str(path))
    with pytest.raises(ValueError, match=r"q_proj.weight has shape \(\d+, \d+\), the config"):
        load_model(tmp_path)
    save_file({n: t for n, t in sd.items() if "down_proj" not in n}, str(path))
    with pytest.raises(ValueError, match="tensor layers.0.mlp.down_proj.weight is missing"):
        load_model(tmp_path)
