"""An MTP distillation step on self-generated text: with the frozen model's hidden states stored
beside the text (as the `mtp_self` stage of `configs/cpt-smollm2.toml` trains) against running
the frozen model over it (as it trains on human code, and as it trained before they were kept).

Both sides take SmolLM2-135M-Instruct with two MTP modules over an 8192-token draft vocabulary and
run the config's step (the defaults): batch 4 of 256-token rows packed from documents of 192 tokens,
blocks compiled (`apply_compile`), `stage_loss(..., "distill")`, backward, AdamW. A step is timed
from the loader's batch (the stored side reads its states from the memory-mapped float16 files
there) to the optimizer's step. The two kinds of step alternate, so a change in the machine's load
falls on both. Token values do not change the time of a step: the text is random, the stored states
are the model's own states of it. Prints one JSON line.

    python benchmarks/mtp_distill_step.py [--steps 6] [--no-compile] [--random-init]
                                          [--batch 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="timed steps of each kind")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="rows a step (the config's 4)")
    ap.add_argument("--seq-len", type=int, default=256,
                    help="tokens a row (the config's 256), packed from documents 3/4 as long")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--random-init", action="store_true",
                    help="SmolLM2-135M's shapes with random weights (no GGUF needed)")
    args = ap.parse_args()
    if args.batch < 1 or args.seq_len < 8:
        sys.exit(f"--batch {args.batch}, --seq-len {args.seq_len}: at least 1 row of 8 tokens")
    torch.set_num_threads(args.threads)

    from codedojo.data.features import FeatureWriter, TokenFeatures
    from codedojo.data.mixture import MixtureSource, mix
    from codedojo.data.packing import PackedLoader, pack
    from codedojo.data.shards import ShardWriter
    from codedojo.model.config import ModelConfig
    from codedojo.model.mtp import MTP
    from codedojo.model.transformer import Transformer
    from codedojo.model.weights import DEFAULT_MODEL, load_model
    from codedojo.pretrain.optim import build_adamw
    from codedojo.pretrain.parallel import apply_compile
    from codedojo.pretrain.trainer import stage_loss

    if args.random_init:
        torch.manual_seed(0)
        model = Transformer(ModelConfig.smollm2_135m())
    else:
        model, _ = load_model(DEFAULT_MODEL)
    cfg = model.cfg.model_copy(update={"n_mtp": 2})
    model.train().requires_grad_(False)
    mtp = MTP(cfg, draft_vocab=8192)
    mtp.init_from_model(model)
    batch, seq = args.batch, args.seq_len
    doc_len = seq * 3 // 4
    docs = (args.steps + 2) * 2 * batch * (seq + 1) // doc_len + 2
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        text = ShardWriter(Path(tmp) / "self", cfg.vocab_size, eos_id=None)
        feats = FeatureWriter(Path(tmp) / "self" / "hidden", cfg.dim)
        with torch.no_grad():
            for _ in range(docs):
                ids = rng.integers(0, cfg.vocab_size, size=doc_len)
                text.add(ids)
                feats.add(model.hidden(torch.from_numpy(ids)[None])[0])
        feats.close()
        text.close()
        src = MixtureSource(name="self", path=str(Path(tmp) / "self"), whole=True)
        packed = pack(mix([src], docs * doc_len, seed=0), seq, origins=True)
        stored = PackedLoader(packed, batch, seed=0, features=TokenFeatures(feats.dir))
        forward = PackedLoader(packed, batch, seed=0)
        if not args.no_compile:
            apply_compile(model, mtp)
        opt = build_adamw(list(mtp.named_parameters()), 1e-4, 0.0, (0.9, 0.95))

        def step(loader: PackedLoader) -> float:
            t0 = time.perf_counter()
            loss, _ = stage_loss(model, mtp, loader.next_batch(), "distill", 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        for loader in (stored, forward):  # warm-up (compiles)
            step(loader)
        times: dict[str, list[float]] = {"stored": [], "forward": []}
        for _ in range(args.steps):
            times["forward"].append(step(forward))
            times["stored"].append(step(stored))
    fwd, sto = (statistics.median(times[k]) for k in ("forward", "stored"))
    print(json.dumps({
        "bench": "mtp_distill_step", "batch": batch, "seq_len": seq, "steps": args.steps,
        "compile": not args.no_compile, "forward_step_s": round(fwd, 4),
        "stored_step_s": round(sto, 4), "forward_tok_s": round(batch * seq / fwd, 1),
        "stored_tok_s": round(batch * seq / sto, 1), "speedup": round(fwd / sto, 3)}))


if __name__ == "__main__":
    main()
