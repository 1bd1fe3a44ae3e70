"""Shared fixtures: SmolLM2-135M-Instruct is loaded once per session (ours and HF's)."""

from __future__ import annotations

import pytest
import torch

# Prompts as token ids (no tokenizer needed): SmolLM2 chat-formatted and plain text pieces.
PROMPTS: list[list[int]] = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 2020, 314, 13869, 47],
    [504, 3458, 282, 4649, 314],
    [1, 4093, 198, 12275, 253, 1789, 2132, 288, 1303, 1530, 260, 1345, 2, 198, 1, 520, 9531, 198],
    [1073, 1909, 1463, 3001, 357, 441, 44, 28, 216],
    [19, 28, 216, 20, 28, 216, 21, 28, 216],
]


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


@pytest.fixture()
def one_thread():
    """Tiny models are all per-op overhead: extra intra-op threads only add synchronisation,
    which gets very slow when the machine is busy. Restores the previous setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
