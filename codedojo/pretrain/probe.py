"""Long-context retrieval probe: a passkey hidden in code.

A line `PASSKEY = "<5 digits>"` is planted at a seeded depth inside held-out code; the prompt
ends with a question in code form (`assert PASSKEY == "`). Scored teacher-forced: a trial passes
when the model's argmax reproduces every digit; we also report the digits' mean log-probability,
which moves before accuracy does at small scale. Run before and after the long-context stage.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


MIN_BODY = 16  # tokens of code around the passkey, at the least


def build_probe(filler: Sequence[int], tok: Encoder, length: int, rng: random.Random
                ) -> tuple[list[int], list[int]]:
    """(prompt ids ending right before the digits, the digit ids)."""
    key = "".join(rng.choice("0123456789") for _ in range(5))
    needle = tok.encode(f'\nPASSKEY = "{key}"  # remember this value\n')
    question = tok.encode('\n\n# what was the passkey?\nassert PASSKEY == "')
    answer = tok.encode(key)
    fixed = len(needle) + len(question) + len(answer)
    body = length - fixed
    if body < MIN_BODY:
        raise ValueError(f"probe length {length} is too short: the passkey's lines take "
                         f"{fixed} tokens and at least {MIN_BODY} of code go around them, "
                         f"{fixed + MIN_BODY} in all")
    if len(filler) < body:
        raise ValueError(f"probe: need {body} filler tokens for length {length}, "
                         f"have {len(filler)}")
    start = rng.randrange(0, len(filler) - body + 1)
    ctx = list(filler[start:start + body])
    depth = rng.randint(body // 10, body * 9 // 10)
    prompt = ctx[:depth] + needle + ctx[depth:] + question
    return prompt, answer


def probe_prompts(filler: Sequence[int], tok: Encoder, length: int, trials: int = 4,
                  seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """The ``trials`` probes `passkey_probe` scores, drawn by ``seed``: built before training
    too, so that a length or a filler they do not fit is refused before any stage trains."""
    rng = random.Random(seed)
    return [build_probe(filler, tok, length, rng) for _ in range(trials)]


@torch.no_grad()
def passkey_probe(model: nn.Module, tok: Encoder, filler: Sequence[int], length: int,
                  trials: int = 4, seed: int = 0) -> dict[str, float]:
    was_training = model.training
    model.eval()
    hits, logps = 0, []
    dev = next(model.parameters()).device
    for prompt, answer in probe_prompts(filler, tok, length, trials, seed):
        ids = torch.tensor([prompt + answer], device=dev)
        logits = model(ids[:, :-1])  # (1, T-1, V)
        n = len(answer)
        pred = logits[0, -n:]  # the positions that predict each digit
        tgt = ids[0, -n:]
        hits += int(bool((pred.argmax(-1) == tgt).all()))
        logps.append(float(F.log_softmax(pred.float(), -1).gather(-1, tgt[:, None]).mean()))
    model.train(was_training)
    return {"passkey_acc": hits / trials, "passkey_logp": sum(logps) / len(logps),
            "length": float(length)}
