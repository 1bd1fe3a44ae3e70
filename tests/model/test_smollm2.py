"""Acceptance on real weights: SmolLM2-135M-Instruct against transformers loaded from the same
GGUF (logits, greedy generation), and export -> transformers -> same logits."""

from __future__ import annotations

import pytest
import torch

from codedojo.engine.engine import Engine
from codedojo.engine.types import SamplingParams
from tests.model.conftest import EOS, PROMPTS

# One intra-op thread: far steadier than two when the machine is shared (see conftest).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_logits_match_transformers_from_gguf(smollm2, hf_smollm2) -> None:
    model, _ = smollm2
    with torch.inference_mode():
        for p in PROMPTS:
            tokens = torch.tensor([p])
            diff = (model(tokens) - hf_smollm2(tokens).logits).abs().max().item()
            assert diff < 1e-4, (p, diff)


def test_greedy_generation_matches_transformers_generate(smollm2, hf_smollm2) -> None:
    model, _ = smollm2
    n = 24
    engine = Engine(model, max_batch=len(PROMPTS), max_seq_len=256)
    # batched through the engine, i.e. a ragged continuous batch, not one prompt at a time
    ours = engine.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0,
                                                   stop_token_ids=[EOS]))
    for p, c in zip(PROMPTS, ours, strict=True):
        with torch.inference_mode():
            ref = hf_smollm2.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                      eos_token_id=EOS, pad_token_id=EOS)
        assert c.token_ids == ref[0, len(p):].tolist(), p


def test_export_loads_in_transformers_with_same_logits(smollm2, tmp_path) -> None:
    from transformers import LlamaForCausalLM

    from codedojo.model.hf import save_hf

    model, cfg = smollm2
    out = save_hf(model, cfg, tmp_path / "export", bos_token_id=1, eos_token_id=2)
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.tensor([PROMPTS[0], PROMPTS[2][: len(PROMPTS[0])]])
    with torch.inference_mode():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
