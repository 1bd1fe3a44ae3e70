"""Speculative decoding with MTP drafts vs plain decoding, batch 1, on held-out code prompts.

Uses the checkpoint `dojo pretrain configs/cpt-smollm2.toml` writes (SmolLM2-135M after CPT, with
MTP modules trained by self-distillation). Both sides run in this process on the same prompts;
greedy, so both emit identical text (checked). Prints one JSON line.

    python benchmarks/spec_decode.py [--ckpt runs/cpt-smollm2/final] [--prompts 6] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="runs/cpt-smollm2/final")
    ap.add_argument("--data", default="runs/cpt-smollm2/data/eval")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from safetensors.torch import load_file

    from codedojo.data.shards import TokenShards
    from codedojo.engine.speculative import (
        SpecStats,
        TransformerTarget,
        load_drafter,
        plain_generate,
        speculative_generate,
    )
    from codedojo.model.config import ModelConfig
    from codedojo.model.weights import build_model

    ck = Path(args.ckpt)
    if not (ck / "model.safetensors").exists():
        sys.exit(f"{ck}: no checkpoint; run `dojo pretrain configs/cpt-smollm2.toml` first")
    cfg = ModelConfig.model_validate_json((ck / "model_config.json").read_text())
    model = build_model(load_file(str(ck / "model.safetensors")), cfg)
    max_len = args.prompt_len + args.new + 16  # + the drafts of the last round
    drafter = load_drafter(model, ck, max_len)
    if drafter is None:
        sys.exit(f"{ck}: checkpoint has no MTP modules")
    shards = TokenShards(args.data)
    prompts = []
    for i in range(len(shards)):
        d = shards.doc(i)
        if len(d) >= args.prompt_len:
            prompts.append(d[: args.prompt_len].tolist())
        if len(prompts) == args.prompts:
            break
    target = TransformerTarget(model, max_len)
    plain_generate(target, prompts[0][:16], 4)  # warm-up
    speculative_generate(target, drafter, prompts[0][:16], 4)
    total = SpecStats()
    t_plain = t_spec = 0.0
    n_plain = n_spec = 0
    same = True
    for p in prompts:
        t0 = time.perf_counter()
        ref = plain_generate(target, p, args.new)
        t_plain += time.perf_counter() - t0
        n_plain += len(ref)
        t0 = time.perf_counter()
        res = speculative_generate(target, drafter, p, args.new)
        t_spec += time.perf_counter() - t0
        n_spec += len(res.tokens)
        same &= res.tokens == ref
        s = res.stats
        total.rounds += s.rounds
        total.target_passes += s.target_passes
        total.drafted += s.drafted
        total.accepted += s.accepted
        total.first_accepted += s.first_accepted
        total.emitted += s.emitted
    plain_tok_s, spec_tok_s = n_plain / t_plain, n_spec / t_spec
    print(json.dumps({
        "accept_first": round(total.accept_first, 4),
        "mean_accepted": round(total.mean_accepted, 4),
        "accept_rate": round(total.accept_rate, 4),
        "tokens_per_pass": round(total.tokens_per_pass, 4),
        "spec_tok_s": round(spec_tok_s, 2), "plain_tok_s": round(plain_tok_s, 2),
        "speedup": round(spec_tok_s / plain_tok_s, 3), "greedy_identical": same,
        "n_mtp": drafter.depth, "draft_vocab": int(len(drafter.mtp.draft_vocab))
        if drafter.mtp.draft_vocab is not None else cfg.vocab_size, "prompts": len(prompts), "new_tokens": args.new, "batch": 1,
        "threads": args.threads, "ckpt": str(ck)}))


if __name__ == "__main__":
    main()
