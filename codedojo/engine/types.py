"""Typed values that cross the engine boundary: what a request asks for, what comes back.

The engine works on token ids only; the server turns text into ids and ids back into text.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SamplingParams:
    """How to sample one request.

    ``logprobs`` reports, for each sampled token, the log-softmax of the distribution it was
    actually drawn from: logits / temperature, then the top-k and top-p filters, renormalised.
    Greedy (``temperature == 0``) reports the log-softmax of the raw logits (temperature 1), so
    the number stays finite and comparable across greedy and sampled runs.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = True  # per-token logprob of the sampled token (RL needs it)
    top_logprobs: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs!r}")


@dataclass
class TokenEvent:
    """One generated token, as streamed."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None  # None while running, then "stop" | "length" | "cancelled"
    cached_tokens: int = 0  # the request's prompt tokens taken from an earlier sequence
    # Routing recorded (`Engine(record_routing=True)`, an MoE model): the experts of the tokens
    # fed since the last event, (tokens, MoE layers, top_k): the prompt's with the first token,
    # then the one token before it; else None
    routed_experts: torch.Tensor | None = None


@dataclass
class Completion:
    """A finished request. ``weight_version`` is the engine's version when it was produced;
    ``cached_tokens`` how many of the prompt's tokens were not prefilled again but taken from
    an earlier sequence's keys and values (`codedojo.engine.prefix_cache`).

    ``routed_experts`` (an MoE model on an engine that records routing; else None, as for a
    request cancelled before its prefill): the experts every MoE layer chose for every token
    the engine fed the model, the prompt and then each generated token but the last, as a CPU
    (len(prompt_ids) + len(token_ids) - 1, MoE layers in order, top_k) int16 tensor (vLLM's
    layout). A training forward over ``(prompt_ids + token_ids)[:-1]`` inside
    ``router_replay(model, routed_experts.unbind(-2))`` routes every token as the rollout did
    (`codedojo.model.moe`), so its logprobs are the rollout's, not a re-routed model's."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cached_tokens: int = 0
    routed_experts: torch.Tensor | None = None


def encode_routed_experts(routed: torch.Tensor) -> str:
    """Routed experts (tokens, MoE layers, top_k) as vLLM sends them over HTTP: a NumPy ``.npy``
    file, base64-encoded (2 bytes an id, against about 3 as JSON numbers)."""
    buf = io.BytesIO()
    np.save(buf, routed.to("cpu", torch.int16).numpy(), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routed_experts(data: str) -> torch.Tensor:
    """The (tokens, MoE layers, top_k) ids `encode_routed_experts` (or vLLM) sent, as int64
    (torch's index type); ValueError saying what is wrong with anything else."""
    try:
        arr = np.load(io.BytesIO(base64.b64decode(data, validate=True)), allow_pickle=False)
    except (ValueError, binascii.Error, OSError, EOFError) as e:
        raise ValueError(f"routed_experts: not a base64-encoded NumPy array ({e})") from None
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise ValueError(f"routed_experts: expected integer ids shaped (tokens, MoE layers, top_k), "
                         f"got {arr.dtype} {arr.shape}")
    return torch.from_numpy(arr.astype(np.int64))
