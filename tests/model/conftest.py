"""Shared fixtures: SmolLM2-135M-Instruct is loaded once per session (ours and HF's)."""

from __future__ import annotations

import pytest
import torch

# SmolLM2 chat prompts as token ids (user turn + assistant header), so no tokenizer is needed:
# reverse a string; what `yield` does; fix `for i in range(10) print(i)`; what a hash map is;
# reading a file line by line.
PROMPTS: list[list[int]] = [
    [1, 4093, 198, 19161, 253, 5905, 1517, 338, 10557, 266, 253, 4928, 30, 2, 198, 1, 520, 9531,
     198],
    [1, 4093, 198, 1780, 1072, 260, 2179, 31616, 80, 20173, 536, 281, 5905, 47, 2, 198, 1, 520,
     9531, 198],
    [1, 4093, 198, 54, 1088, 260, 15630, 42, 327, 2056, 281, 1845, 24, 33, 32, 25, 1628, 24, 89,
     25, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 36971, 732, 253, 15345, 4141, 314, 281, 582, 6330, 30, 2, 198, 1, 520, 9531,
     198],
    [1, 4093, 198, 2020, 536, 339, 1012, 253, 2301, 1761, 411, 1761, 281, 5905, 47, 2, 198, 1, 520,
     9531, 198],
]
EOS = 2  # <|im_end|>


@pytest.fixture(scope="session")
def smollm2():
    """(our Transformer in float32, its config)."""
    from codedojo.model.weights import load_model

    torch.manual_seed(0)
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' LlamaForCausalLM loaded from the same GGUF file."""
    from transformers import LlamaForCausalLM

    from codedojo.model.weights import gguf_path

    p = gguf_path()
    return LlamaForCausalLM.from_pretrained(p.parent, gguf_file=p.name,
                                            dtype=torch.float32).eval()

