"""A whole pretraining run at test size: a small code corpus and all five stages on a tiny
model with the real tokenizer's vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from codedojo.pretrain.config import PretrainConfig


def code_corpus(src: Path) -> Path:
    src.mkdir()
    for i in range(24):
        body = "\n".join(f"    x{j} = value * {i + j}  # step {j}" for j in range(25))
        (src / f"mod{i}.py").write_text(
            f'def func{i}(value):\n    """Scale value by {i}."""\n{body}\n    return value\n')
    return src


def five_stage_config(tmp_path: Path, name: str, lr: float = 1e-3, bulk_mtp: str = "off",
                      **model: Any) -> PretrainConfig:
    """Bulk, MTP distillation on code, long context (probe, base change), SFT, and MTP
    distillation on the model's own continuations; two steps each."""
    stage = {"seq_len": 32, "batch_size": 2, "steps": 2, "lr": lr, "mix": [{"data": "code"}]}
    return PretrainConfig.model_validate({
        "name": name, "out_dir": str(tmp_path / "runs"), "sft_examples": 6,
        "long_docs_chars": [500, 3000],
        "corpus": {"sources": [{"kind": "dir", "path": str(code_corpus(tmp_path / "src"))}],
                   "holdout_frac": 0.25, "dedup": {"near": False}},
        "model": {"base": "tiny", "n_mtp": 1, **model,
                  "tiny_overrides": {"vocab_size": 49152, "dim": 32, "n_heads": 2,
                                     "n_kv_heads": 1, "ffn_dim": 64}},
        "eval": {"seq_len": 32, "batch_size": 2, "batches": 1, "probe_len": 96,
                 "probe_trials": 1},
        "stages": [{"name": "bulk", **stage, "mtp": bulk_mtp},
                   {"name": "mtp", **stage, "mtp": "distill"},
                   {"name": "long", **stage, "seq_len": 64, "probe": True, "mtp": "joint",
                    "mix": [{"data": "long", "weight": 1.0}, {"data": "code", "weight": 1.0}],
                    "rope_scaling": {"kind": "base", "new_theta": 40000.0}},
                   {"name": "sft", **stage, "mix": [{"data": "sft"}]},
                   {"name": "mtp_self", **stage, "mtp": "distill", "mix": [{"data": "self"}],
                    "self_gen": {"prompts": 4, "prompt_len": 8, "new_tokens": 8,
                                 "batch": 2}}]})
