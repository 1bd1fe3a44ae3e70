"""Turning next-token logits into tokens: temperature, top-k, top-p, seeded draws, logprobs.

Each request draws from its own ``torch.Generator``, so a seed gives the same tokens whatever
else shares the batch. Generators live on the CPU: logits computed elsewhere are copied there to
be sampled, so a seed draws alike on every device. The reported logprob is the log-probability
of the sampled token under the distribution it was drawn from (after temperature and the
top-k/top-p filters, renormalised); greedy requests report the log-softmax of the raw logits.
"""

from __future__ import annotations

import torch

from codedojo.engine.types import SamplingParams
from codedojo.ops import greedy

MIN_TEMPERATURE = 1e-30  # a float32 divisor; anything near it is the argmax already
LOGPROB_FLOOR = -9999.0  # a top logprob of a token the filters removed (vLLM's value)


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (V,) float32 -> log-probabilities (V,) of the distribution to sample from
    (-inf outside the top-k / top-p set). Greedy (temperature 0) -> plain log-softmax."""
    if params.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    # from the largest logit down: a temperature near 0 sends the rest to -inf, never to NaN
    # (below MIN_TEMPERATURE float32 holds it as 0, and 0/0 is NaN: it divides no further)
    x = (logits - logits.max()) / max(params.temperature, MIN_TEMPERATURE)
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses is kept).
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        x = x.scatter(0, order[drop], float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None
               ) -> tuple[int, float, list[tuple[int, float]]]:
    """One request's next token from logits (V,): (token, logprob, top logprobs)."""
    lp = filtered_logprobs(logits, params)
    if params.temperature == 0:  # the token and its logprob as an all-greedy batch gets them
        toks, lps = greedy(logits[None])  # (`sample_batch`): whatever shares its batch
        tok, tok_lp = int(toks[0]), float(lps[0])
    else:
        tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
        tok_lp = float(lp[tok])
    top: list[tuple[int, float]] = []
    if params.top_logprobs:
        vals, ids = torch.topk(lp, min(params.top_logprobs, lp.shape[-1]))
        # more asked for than top-k/top-p kept: those are impossible, at a finite floor (JSON
        # has no -inf)
        top = [(int(i), tok_lp if int(i) == tok else max(float(v), LOGPROB_FLOOR))
               for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]  # (one logprob a token)
    return tok, tok_lp, top


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 gens: list[torch.Generator | None]
                 ) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """logits (B, V) -> one (token, logprob, top logprobs) per row. All-greedy batches without
    top logprobs (the common decode case) take one vectorised path."""
    if all(p.temperature == 0 and not p.top_logprobs for p in params):
        toks, lps = greedy(logits)
        return [(t, lp, []) for t, lp in zip(toks.tolist(), lps.tolist(), strict=True)]
    logits = logits.cpu()  # where the requests' generators draw (one copy of B rows)
    return [sample_row(logits[i], p, g) for i, (p, g) in enumerate(zip(params, gens, strict=True))]
