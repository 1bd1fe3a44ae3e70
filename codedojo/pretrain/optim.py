"""AdamW with a warmup-stable-decay (WSD) schedule.

WSD keeps the peak LR flat for most of the run and decays only at the end, so a stage can be
extended or branched from its stable phase (the reason CPT recipes prefer it to cosine). Decay
parameters: matrices only; norms, biases and the MoE selection bias (a buffer) are not decayed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from codedojo.pretrain.config import decay_steps
from codedojo.pretrain.parallel import is_sharded


def wsd_lr(step: int, *, peak: float, total: int, warmup: int, decay_frac: float,
           min_ratio: float) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, flat, then cosine-shaped decay to
    peak * min_ratio over the last decay_frac of the steps."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    decay = decay_steps(total, decay_frac)
    decay_start = total - decay
    if decay == 0 or step < decay_start:
        return peak
    t = min(1.0, (step - decay_start + 1) / decay)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def build_adamw(params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float,
                betas: tuple[float, float], lr_mult: Callable[[str], float] = lambda _: 1.0
                ) -> torch.optim.AdamW:
    """``lr_mult(name)``: a parameter's learning rate as a multiple of the schedule's (each
    group's ``lr_mult``; `set_lr` applies it)."""
    groups = []
    # FSDP-sharded parameters (DTensors) and parameters kept whole on every rank (the MTP
    # modules) go in groups of their own: the fused kernel takes one kind at a time.
    mults = sorted({lr_mult(n) for n, _ in params})
    for sharded in (False, True):
        for m in mults:
            kind = [p for n, p in params
                    if p.requires_grad and is_sharded(p) == sharded and lr_mult(n) == m]
            groups += [{"params": [p for p in kind if p.ndim >= 2], "lr_mult": m,
                        "weight_decay": weight_decay},
                       {"params": [p for p in kind if p.ndim < 2], "lr_mult": m,
                        "weight_decay": 0.0}]
    # The fused kernel: one pass over each parameter's state per step, and deterministic, so a
    # resumed run stays bit-identical. It leaves the parameters' version counters alone: the
    # decode kernels' copies of them are dropped after each step (`FusedModule.weights_changed`).
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                             fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's learning rate, times each group's ``lr_mult``."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
