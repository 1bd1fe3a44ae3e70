"""Typed values that cross the engine boundary: what a request asks for, what comes back.

The engine works on token ids only; the server turns text into ids and ids back into text.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
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
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_int(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0, got {self.top_logprobs!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEEDS[0] <= self.seed < SEEDS[1]):
            raise ValueError(f"seed must be an integer in [{SEEDS[0]}, {SEEDS[1]}), "
                             f"got {self.seed!r}")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")


# what torch.Generator.manual_seed takes
SEEDS = (-(1 << 63), 1 << 64)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class GenerationError(RuntimeError):
    """A request the engine could not finish: a step over it failed (the engine goes on)."""


@dataclass
class TokenEvent:
    """One generated token, as streamed."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    # None while running, then "stop" | "length" | "cancelled" | "error" (`error` says what)
    finish_reason: str | None
    cached_tokens: int = 0  # the request's prompt tokens taken from an earlier sequence
    # Routing recorded (`Engine(record_routing=True)`, an MoE model): (tokens, MoE layers,
    # top_k), the prompt's rows with the first token, then the row of the token just before
    # it (one pass may feed several: a verify pass); else None
    routed_experts: torch.Tensor | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    # the version of the weights of the step that sampled it (-1: an event without a token)
    weight_version: int = -1


@dataclass
class Completion:
    """A finished request. ``weight_versions`` holds, per token of ``token_ids``, the version
    of the weights of the step that sampled it; ``weight_version`` is its first (-1: no token
    came). A push mid-request (`Engine.load_weights`) leaves later tokens of a newer version,
    sampled over keys and values the older weights made: a trainer that wants one policy per
    sample masks (or corrects) the tokens whose version is not ``weight_version``.
    ``cached_tokens`` is how many of the prompt's tokens were not prefilled again but taken
    from an earlier sequence's keys and values (`codedojo.engine.prefix_cache`).

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
    weight_versions: list[int] = field(default_factory=list)


def encode_routed_experts(routed: torch.Tensor | np.ndarray) -> str:
    """Routed experts (tokens, MoE layers, top_k) as vLLM sends them over HTTP: a NumPy ``.npy``
    file, base64-encoded, of the narrowest unsigned type that holds the ids (uint8 up to 256
    experts, else uint16): 1.3-2.7 characters an id, against 2-6 as JSON numbers."""
    arr = routed.cpu().numpy() if isinstance(routed, torch.Tensor) else np.asarray(routed)
    _check_routed(arr.shape, arr.dtype)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.uint16).max):
        raise ValueError(f"routed_experts: expert ids must be in [0, 65535], got "
                         f"{arr.min()}..{arr.max()}")
    buf = io.BytesIO()
    narrow = np.uint8 if not arr.size or arr.max() <= np.iinfo(np.uint8).max else np.uint16
    np.save(buf, arr.astype(narrow), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routed_experts(data: str) -> torch.Tensor:
    """The (tokens, MoE layers, top_k) ids `encode_routed_experts` (or vLLM) sent, as int64
    (torch's index type); ValueError saying what is wrong with anything else."""
    return torch.from_numpy(routed_experts_array(data).astype(np.int64))


def routed_experts_array(data: str) -> np.ndarray:
    """`decode_routed_experts` in the type it was sent in (uint8 or uint16 from us and vLLM):
    an eighth of the memory of int64 ids, for rows that are compared and kept, not indexed with."""
    f = _npy(data)
    head = _header(f)
    if head is not None:  # the data must hold what the header says, before it is allocated
        _check_size(head, len(f.getbuffer()))
    f.seek(0)
    try:
        arr = np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"routed_experts: not a NumPy array ({e})") from None
    if not isinstance(arr, np.ndarray):
        raise ValueError("routed_experts: expected one NumPy array, got an .npz archive")
    _check_routed(arr.shape, arr.dtype)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"routed_experts: expert ids must be >= 0, got {arr.min()}..{arr.max()}")
    return arr


def routed_experts_shape(data: str) -> tuple[int, ...]:
    """The (tokens, MoE layers, top_k) shape of encoded routed experts, read from the array's
    header alone (a long turn's rows need not be decoded to be counted)."""
    head = _header(_npy(data[:344] if isinstance(data, str) else data))  # a header: 64-256 B
    if head is None:  # another version, or a longer header
        return tuple(decode_routed_experts(data).shape)
    payload = len(data) // 4 * 3 - (len(data) - len(data.rstrip("=")))  # base64's bytes
    _check_size(head, payload)
    return tuple(head[0])


def _header(f: io.BytesIO) -> tuple[tuple[int, ...], np.dtype, int] | None:
    """An .npy header's shape and dtype, checked as routed experts', and where the data
    starts; None where it is not a version 1 or 2 header this short read holds."""
    try:
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, _, dtype = read(f)
    except (ValueError, KeyError, EOFError):
        return None
    _check_routed(shape, dtype)
    return tuple(shape), dtype, f.tell()


def _check_size(head: tuple[tuple[int, ...], np.dtype, int], size: int) -> None:
    shape, dtype, start = head
    want = start + math.prod(shape) * dtype.itemsize
    if want != size:
        raise ValueError(f"routed_experts: the header says {dtype} {shape} ({want} bytes), "
                         f"the data holds {size} bytes")


def _npy(data: str) -> io.BytesIO:
    if not isinstance(data, str):
        raise ValueError(f"routed_experts: expected a base64 string, got {type(data).__name__}")
    try:
        return io.BytesIO(base64.b64decode(data, validate=True))
    except (ValueError, binascii.Error) as e:
        raise ValueError(f"routed_experts: not base64 ({e})") from None


def _check_routed(shape: tuple[int, ...], dtype: np.dtype) -> None:
    if len(shape) != 3 or dtype.kind not in "iu":
        raise ValueError(f"routed_experts: expected integer ids shaped (tokens, MoE layers, top_k), "
                         f"got {dtype} {tuple(shape)}")
