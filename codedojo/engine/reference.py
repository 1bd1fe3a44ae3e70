"""Slow reference generation: recompute the whole sequence every step, no cache, no batching.
The fast engine is tested against it."""

from __future__ import annotations

import torch

from codedojo.model.transformer import Transformer


@torch.inference_mode()
def greedy_reference(model: Transformer, prompt_ids: list[int], max_tokens: int,
                     stop_token_ids: list[int] | None = None) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by full recomputation at every step."""
    seq = list(prompt_ids)
    out: list[int] = []
    stops = set(stop_token_ids or [])
    for _ in range(max_tokens):
        logits = model(torch.tensor([seq], dtype=torch.long))  # (1, T, V)
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stops:
            break
    return out


@torch.inference_mode()
def sequence_logprobs(model: Transformer, prompt_ids: list[int], token_ids: list[int],
                      temperature: float = 1.0) -> list[float]:
    """log p(token_ids[i] | prompt, token_ids[:i]) from one full forward pass, at
    ``temperature`` (no top-k/top-p filtering)."""
    seq = torch.tensor([list(prompt_ids) + list(token_ids)], dtype=torch.long)
    logits = model(seq)[0, len(prompt_ids) - 1 : -1] / temperature  # (N, V)
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()
