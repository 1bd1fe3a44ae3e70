"""Decode throughput of the engine on SmolLM2-135M-Instruct, against HF ``generate`` and against
the memory-bandwidth bound, all measured in this process.

Prints one JSON line:
- ``batch1_tok_s``: greedy tokens/s, one request at a time (prefill included, as for HF);
  ``batch1_decode_tok_s`` after each prompt's first step, and ``batch1_decode_over_bound``
  (``--new-tokens`` too few to leave a decode step after the first is refused);
- ``batch16_tok_s``: greedy tokens/s with 16 requests decoding together;
- ``hf_batch1_tok_s``: transformers ``generate`` (greedy, KV cache) on the same prompts;
- ``bound_tok_s``: read bandwidth / weight bytes read per token. The bandwidth (a sum over a
  512 MB tensor in huge-page memory, as the weights are: ``codedojo.ops.huge_pages``) is
  sampled between the batch-1 generations and the median taken (``read_gb_s``): on a shared
  machine it moves by half from minute to minute, so it is measured while the decoding runs;
  ``read_gb_s_best`` is the best sample, ``batch1_over_best_bound`` the ratio against it;
  ``read_gb_s_4k_pages`` the same sum over ordinary 4 KB pages, sampled beside it (``read_gb_s``
  is the faster of the two medians);
- ``bf16_*``: the same engine figures with bfloat16 weights and KV cache (``dojo serve --dtype
  bfloat16``: the kernels read half the bytes; sums in float32), and their bound.

    python benchmarks/decode.py [--new-tokens 64] [--threads N] [--skip-bf16] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from codedojo.engine.engine import Engine
from codedojo.engine.types import SamplingParams
from codedojo.model.weights import gguf_path, load_model
from codedojo.ops import huge_page_empty

# Sixteen short chat-style prompts as token ids (decoding, not prefill, is what we measure).
BASE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198]
QUESTIONS = [[2020, 314, 13869, 47], [12275, 253, 1789, 2132, 288, 1303, 1530],
             [504, 3458, 282, 4649, 314], [1073, 1909, 1463, 3001, 357, 441, 44]]
PROMPTS = [BASE + QUESTIONS[i % 4] + [28 + i, 2, 198, 1, 520, 9531, 198] for i in range(16)]


class ReadRate:
    """Samples of the read bandwidth: bytes/s of summing a 512 MB float32 tensor, in huge-page
    memory (``huge``) and in ordinary pages (``small_pages``), each the best of a few sums."""

    def __init__(self, n_bytes: int = 512 * 2**20) -> None:
        self.n_bytes = n_bytes
        self._huge = huge_page_empty((n_bytes // 4,), torch.float32).fill_(1.0)
        self._small = torch.ones(n_bytes // 4)
        self.huge: list[float] = []
        self.small_pages: list[float] = []

    def sample(self, reps: int = 1) -> None:
        self.huge.append(self._best(self._huge, reps))
        self.small_pages.append(self._best(self._small, reps))

    def _best(self, x: torch.Tensor, reps: int) -> float:
        x.sum()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return self.n_bytes / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Every matrix is read once per decode step; the embedding table once (as the tied
    output projection; the input lookup reads one row)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def engine_tok_s(engine: Engine, prompts: list[list[int]], n: int) -> float:
    params = SamplingParams(max_tokens=n, temperature=0)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm up
    t = time.perf_counter()
    out = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    return sum(len(c.token_ids) for c in out) / dt


@dataclass
class TimedRequest:
    """One request run alone through an engine: its first step (the prompt and the first token;
    for a speculative engine, also its first round) and the decode steps after it."""

    token_ids: list[int]
    first_tokens: int  # tokens out after the first step
    first_s: float
    decode_s: float
    decode_steps: int
    # tokens drafted in the decode steps, a tree's every node (speculative: the first is apart)
    decode_drafts: int = 0

    @property
    def decoded(self) -> int:
        return len(self.token_ids) - self.first_tokens


def time_request(engine: Engine, prompt: list[int], params: SamplingParams) -> TimedRequest:
    """Run ``prompt`` alone to the end, step by step (``spec_decode.py`` uses this too)."""
    req = engine.submit(prompt, params)
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    first, steps, drafted = len(req.token_ids), 0, engine.spec_stats.verified
    while engine.n_live:
        engine.step()
        steps += 1
    return TimedRequest(req.completion().token_ids, first, t1 - t0,
                        time.perf_counter() - t1, steps, engine.spec_stats.verified - drafted)


def batch1_tok_s(engine: Engine, prompts: list[list[int]], n: int,
                 rate: ReadRate | None = None) -> tuple[float, float | None]:
    """One prompt at a time; samples the read bandwidth into ``rate`` before each.
    Returns tokens/s with the prefill (the prompt and the first token) and without it (None
    when every request ended in its first step: ``n`` too few to leave a decode step)."""
    params = SamplingParams(max_tokens=n, temperature=0)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))
    runs = []
    for p in prompts:
        if rate is not None:
            rate.sample()
        runs.append(time_request(engine, p, params))
    decoded = sum(r.decoded for r in runs)
    return (sum(len(r.token_ids) for r in runs) / sum(r.first_s + r.decode_s for r in runs),
            decoded / sum(r.decode_s for r in runs) if decoded else None)


def hf_tok_s(prompts: list[list[int]], n: int) -> float:
    from transformers import LlamaForCausalLM

    p = gguf_path()
    hf = LlamaForCausalLM.from_pretrained(p.parent, gguf_file=p.name,
                                          dtype=torch.float32).eval()
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4,
                                                   "min_new_tokens": 4})
        tokens, t = 0, time.perf_counter()
        for pr in prompts:
            out = hf.generate(torch.tensor([pr]), **kw)
            tokens += out.shape[1] - len(pr)
        return tokens / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    a = ap.parse_args()
    if a.new_tokens < 1 or a.batch1_prompts < 1:
        ap.error(f"--new-tokens {a.new_tokens}, --batch1-prompts {a.batch1_prompts}: "
                 "each must be at least 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    n, p1 = a.new_tokens, PROMPTS[: a.batch1_prompts]
    from codedojo.ops import kernel_status

    res: dict[str, object] = {"bench": "decode", "model": "smollm2-135m-instruct",
                              "new_tokens": n, "threads": torch.get_num_threads(),
                              "kernel": kernel_status()}
    rate = ReadRate()
    rate.sample(reps=5)

    model, _ = load_model()
    eng = Engine(model, max_batch=16, max_seq_len=256)
    wb = weight_bytes_per_token(model)
    res["weight_mb_per_token"] = round(wb / 2**20, 1)
    b1, b1_decode = batch1_tok_s(eng, p1, n, rate)
    if b1_decode is None:
        ap.error(f"--new-tokens {n}: every request ended in its first step, which makes the "
                 "first tokens; no decode step left to measure: ask for more")
    res["batch1_tok_s"], res["batch1_decode_tok_s"] = round(b1, 2), round(b1_decode, 2)
    rate.sample()
    # the faster of the two kinds of memory (huge pages, almost always)
    bw = max(statistics.median(rate.huge), statistics.median(rate.small_pages))
    best = max(rate.huge + rate.small_pages)
    res["read_gb_s"], res["read_gb_s_best"] = round(bw / 1e9, 2), round(best / 1e9, 2)
    res["read_gb_s_4k_pages"] = round(statistics.median(rate.small_pages) / 1e9, 2)
    res["bound_tok_s"] = round(bw / wb, 2)
    res["batch1_over_best_bound"] = round(b1 / (best / wb), 3)
    res["batch1_decode_over_bound"] = round(b1_decode / (bw / wb), 3)
    res["batch16_tok_s"] = round(engine_tok_s(eng, PROMPTS, n), 2)
    del eng, model

    if not a.skip_bf16:
        model, _ = load_model(dtype=torch.bfloat16)
        eng = Engine(model, max_batch=16, max_seq_len=256)
        res["bf16_bound_tok_s"] = round(bw / weight_bytes_per_token(model), 2)
        res["bf16_batch1_tok_s"] = round(batch1_tok_s(eng, p1, n)[0], 2)
        res["bf16_batch1_over_bound"] = round(
            res["bf16_batch1_tok_s"] / res["bf16_bound_tok_s"], 3)  # type: ignore[operator]
        res["bf16_batch16_tok_s"] = round(engine_tok_s(eng, PROMPTS, n), 2)
        del eng, model

    if not a.skip_hf:
        res["hf_batch1_tok_s"] = round(hf_tok_s(p1, n), 2)
        res["batch1_over_bound"] = round(res["batch1_tok_s"] / res["bound_tok_s"], 3)  # type: ignore[operator]
        res["batch16_over_hf_batch1"] = round(
            res["batch16_tok_s"] / res["hf_batch1_tok_s"], 2)  # type: ignore[operator]
    res["load_avg_1m"] = round(__import__("os").getloadavg()[0], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
