"""``greedy(logits, tokens)``: each row's argmax and the log-softmax of a token of the row, what
greedy decoding reads for every token it emits. On the CPU one C++ call (``greedy.cpp``: two
vectorised passes over a row) stands in for ``torch.argmax`` and ``torch.log_softmax``, which
take about 90 and 40 microseconds per 49k-vocabulary row here; the choice is ``torch.argmax``'s
(the first of equal maxima, a NaN above all) and the log-probability its formula."""

from __future__ import annotations

import torch

from codedojo.ops.gemm import load_kernel

_NO_TOKENS = torch.empty(0, dtype=torch.long)


def greedy(logits: torch.Tensor, tokens: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) -> (argmax (N,) int64, log-softmax at ``tokens`` (N,) float32; at the
    argmax when ``tokens`` is None)."""
    if logits.dim() != 2:
        raise ValueError(f"greedy: logits must be (rows, vocabulary), got {tuple(logits.shape)}")
    if tokens is not None and tuple(tokens.shape) != logits.shape[:1]:
        raise ValueError(f"greedy: tokens must be one id for each of the logits' rows, got "
                         f"{tuple(tokens.shape)} for logits {tuple(logits.shape)}")
    if (logits.device.type == "cpu" and logits.dtype == torch.float32
            and (tokens is None or tokens.device.type == "cpu")
            and not (torch.is_grad_enabled() and logits.requires_grad)
            and (kernel := load_kernel()) is not None):
        return kernel.greedy(logits.contiguous(),
                             _NO_TOKENS if tokens is None else tokens.to(torch.long).contiguous())
    ids = logits.argmax(-1)
    at = ids if tokens is None else tokens.to(ids.device, torch.long)
    lps = torch.log_softmax(logits.float(), -1).gather(-1, at[:, None])[:, 0]
    return ids, lps
