"""Hugging Face checkpoints: import safetensors with Llama or Qwen2 names, export safetensors +
``config.json`` that ``transformers`` loads as ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` when the
model has q/k/v biases, which Llama's config cannot express without an o_proj bias)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from codedojo.model.config import ModelConfig, RopeScaling
from codedojo.model.tensors import Tensors


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_yarn_attention_factor(rope: dict[str, Any]) -> float:
    """The attention factor transformers gives a YaRN config: ``attention_factor`` as given,
    else the ratio of the two mscales when both are set, else its default (ours)."""
    factor = float(rope["factor"])
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return (_mscale(factor, float(rope["mscale"]))
                / _mscale(factor, float(rope["mscale_all_dim"])))
    return _mscale(factor)  # (RopeScaling.attention_factor)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF ``config.json`` dict (model_type llama or qwen2)."""
    mt = hf.get("model_type")
    if mt not in ("llama", "qwen2"):
        raise ValueError(f"config.json model_type: {mt!r} is not supported (llama, qwen2)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = None
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype == "yarn":
        rope = dict(rope)
        original = rope.get("original_max_position_embeddings")
        if rope.get("factor") is None and original:  # as transformers derives it
            rope["factor"] = hf["max_position_embeddings"] / original
        if not isinstance(rope.get("factor"), int | float):
            raise ValueError("config.json rope_scaling: YaRN needs a number `factor` (or "
                             f"original_max_position_embeddings), got {rope.get('factor')!r}")
        # transformers' other YaRN knobs change the attention factor or the ramp; read as if
        # absent they would give other logits than HF's, so they are refused
        other = {k: rope[k] for k in ("attention_factor", "mscale", "mscale_all_dim")
                 if rope.get(k) is not None}
        ours = RopeScaling(kind="yarn", factor=float(rope["factor"])).attention_factor
        if math.isclose(_hf_yarn_attention_factor(rope), ours):
            other = {}  # as good as absent: they come to the default factor
        if rope.get("truncate") is False:
            other["truncate"] = False
        if other:
            raise ValueError(f"config.json rope_scaling: {other} is not supported (YaRN with "
                             "its default attention factor and truncated ramp)")
        scaling = RopeScaling(
            kind="yarn", factor=float(rope["factor"]),
            original_max_seq_len=int(rope.get("original_max_position_embeddings")
                                     or hf["max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0))
    elif rtype not in ("default", None):
        raise ValueError(f"config.json rope_type: {rtype!r} is not supported (default, yarn)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act: {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window: true is not supported (full attention)")
    n_heads = int(hf["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=hf.get("head_dim"), ffn_dim=int(hf["intermediate_size"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        # a YaRN model serves its extended length, whatever max_position_embeddings says
        max_seq_len=max(int(hf.get("max_position_embeddings", 4096)),
                        int(scaling.factor * scaling.original_max_seq_len) if scaling else 0),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attn_bias=mt == "qwen2" or bool(hf.get("attention_bias", False)),
        rope_scaling=scaling,
    )


def state_dict_from_hf(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig
                       ) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen2 parameter names -> ours (fusing q/k/v and gate/up). Each tensor must
    have the shape the config gives it: fused, one a row too long beside one a row short
    would be split at the wrong row."""
    src = Tensors({k.removeprefix("model."): v for k, v in hf_sd.items()}, "HF checkpoint")
    take = src.take
    H, K, D, E = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd, cfg.ffn_dim, cfg.dim

    sd = {"tok_embeddings.weight": take("embed_tokens.weight", cfg.vocab_size, E),
          "norm.weight": take("norm.weight", E)}
    if not cfg.tie_embeddings:
        if "lm_head.weight" not in src.left:
            raise ValueError("lm_head.weight missing while tie_word_embeddings is false")
        sd["output.weight"] = take("lm_head.weight", cfg.vocab_size, E)
    src.left.pop("lm_head.weight", None)
    for i in range(cfg.n_layers):
        p, o = f"layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        sd[o + "attn.wqkv.weight"] = torch.cat(
            [take(a + "q_proj.weight", H, E), take(a + "k_proj.weight", K, E),
             take(a + "v_proj.weight", K, E)])
        if cfg.attn_bias:
            sd[o + "attn.wqkv.bias"] = torch.cat(
                [take(a + "q_proj.bias", H), take(a + "k_proj.bias", K),
                 take(a + "v_proj.bias", K)])
        sd[o + "attn.wo.weight"] = take(a + "o_proj.weight", E, H)
        sd[o + "attn_norm.weight"] = take(p + "input_layernorm.weight", E)
        sd[o + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight", E)
        sd[o + "mlp.w_gate_up.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight", D, E), take(p + "mlp.up_proj.weight", D, E)])
        sd[o + "mlp.w_down.weight"] = take(p + "mlp.down_proj.weight", E, D)
    leftover = [k for k in src.left if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"HF tensors not understood: {sorted(leftover)[:5]}")
    return sd


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Ours -> HF Llama/Qwen2 names (splitting the fused projections)."""
    H, K, D = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd, cfg.ffn_dim
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
           "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(cfg.n_layers):
        o, p = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = sd[o + "attn.wqkv.weight"].split([H, K, K])
        out[p + "self_attn.q_proj.weight"] = q
        out[p + "self_attn.k_proj.weight"] = k
        out[p + "self_attn.v_proj.weight"] = v
        if cfg.attn_bias:
            qb, kb, vb = sd[o + "attn.wqkv.bias"].split([H, K, K])
            out[p + "self_attn.q_proj.bias"] = qb
            out[p + "self_attn.k_proj.bias"] = kb
            out[p + "self_attn.v_proj.bias"] = vb
        out[p + "self_attn.o_proj.weight"] = sd[o + "attn.wo.weight"]
        out[p + "input_layernorm.weight"] = sd[o + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[o + "mlp_norm.weight"]
        g, u = sd[o + "mlp.w_gate_up.weight"].split([D, D])
        out[p + "mlp.gate_proj.weight"] = g
        out[p + "mlp.up_proj.weight"] = u
        out[p + "mlp.down_proj.weight"] = sd[o + "mlp.w_down.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """An HF ``config.json`` dict for ``cfg``."""
    if cfg.moe is not None:
        raise ValueError("moe: MoE models have no Llama/Qwen2 HF config; export the dense model")
    qwen = cfg.attn_bias
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    s = cfg.rope_scaling
    if s is not None and s.kind == "base":
        rope["rope_theta"] = s.new_theta
    elif s is not None and s.kind == "yarn":
        rope.update(rope_type="yarn", factor=s.factor,
                    original_max_position_embeddings=s.original_max_seq_len,
                    beta_fast=s.beta_fast, beta_slow=s.beta_slow)
    conf: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.hd,
        "intermediate_size": cfg.ffn_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": rope["rope_theta"], "rope_parameters": rope,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
    conf.update(extra)
    return conf


def save_hf(model_or_sd: torch.nn.Module | dict[str, torch.Tensor], cfg: ModelConfig,
            out_dir: str | Path, **config_extra: Any) -> Path:
    """Write ``model.safetensors`` + ``config.json`` under ``out_dir``; returns the dir."""
    from codedojo.paths import save_tensors

    sd = model_or_sd.state_dict() if isinstance(model_or_sd, torch.nn.Module) else model_or_sd
    out = Path(out_dir)
    config = hf_config(cfg, **config_extra)  # first: a model HF has no config for writes nothing
    out.mkdir(parents=True, exist_ok=True)
    tensors = state_dict_to_hf({k: v.detach().cpu() for k, v in sd.items()}, cfg)
    if "torch_dtype" not in config_extra:  # the dtype the weights are saved in
        config["torch_dtype"] = str(tensors["model.embed_tokens.weight"].dtype).removeprefix(
            "torch.")
    save_tensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def load_hf(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Read an HF directory (config.json + model*.safetensors) -> (our state dict, config)."""
    from safetensors.torch import load_file

    d = Path(path)
    conf_path = d / "config.json"
    if not conf_path.exists():
        raise FileNotFoundError(f"{conf_path} not found (an HF model directory needs config.json)")
    cfg = config_from_hf(json.loads(conf_path.read_text()))
    # Model shards only: a checkpoint may carry side modules beside them (mtp.safetensors).
    files = sorted(f for f in d.glob("*.safetensors") if f.name.startswith("model"))
    if not files:
        raise FileNotFoundError(f"no model*.safetensors under {d}")
    hf_sd: dict[str, torch.Tensor] = {}
    for f in files:
        hf_sd.update(load_file(str(f)))
    return state_dict_from_hf(hf_sd, cfg), cfg
