"""Training-step throughput: our decoder vs Hugging Face transformers, same model, batch, length.

Both load SmolLM2-135M-Instruct (ours through `load_model`, HF's `LlamaForCausalLM` from the same
converted safetensors directory), then time full steps (forward, loss, backward, AdamW step) on
the same random token batch, in this process, float32 on both sides. Ours is the step `dojo
pretrain` runs with `configs/cpt-smollm2.toml` (`stage_loss`: the loss fused with the output
projection, `build_adamw`, blocks compiled by `apply_compile`); HF's is what its Trainer does by
default (`labels=` loss, fused AdamW, no compile). Our eager step (`compile = false`) is timed in
the same run (`ours_eager_tok_s`, `eager_ratio`). The steps of the three alternate, so a change
in the machine's load falls on all of them. Prints one JSON line.

    python benchmarks/train_throughput.py [--batch 4] [--seq 256] [--steps 4] [--no-compile]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable

import numpy as np
import torch


def _seconds(step: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="time our eager step only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from codedojo.data.packing import make_batch
    from codedojo.model.weights import DEFAULT_MODEL, converted_dir, load_model
    from codedojo.pretrain.optim import build_adamw
    from codedojo.pretrain.parallel import apply_compile
    from codedojo.pretrain.trainer import stage_loss

    ours, cfg = load_model(DEFAULT_MODEL)
    ours.train()
    hf = transformers.LlamaForCausalLM.from_pretrained(converted_dir(DEFAULT_MODEL),
                                                       torch_dtype=torch.float32,
                                                       attn_implementation="sdpa")
    hf.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    x = tokens[:, :-1]
    batch = make_batch(tokens.numpy(), np.zeros(tokens.shape, np.int32),
                       np.ones(tokens.shape, bool))

    def ours_step(model: torch.nn.Module) -> Callable[[], None]:
        opt = build_adamw(list(model.named_parameters()), 1e-5, 0.0, (0.9, 0.999))

        def step() -> None:
            loss, _ = stage_loss(model, None, batch, "off", 0.0)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    opt_h = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True)

    def step_hf() -> None:
        out = hf(input_ids=x, labels=tokens[:, :-1])  # HF shifts labels internally
        out.loss.backward()
        opt_h.step()
        opt_h.zero_grad(set_to_none=True)

    steps = {"ours_eager": ours_step(ours), "hf": step_hf}
    if not args.no_compile:
        compiled = copy.deepcopy(ours)
        apply_compile(compiled)
        steps["ours"] = ours_step(compiled)
    elapsed = dict.fromkeys(steps, 0.0)
    for step in steps.values():  # warm up (and compile) outside the timing
        step()
    for _ in range(args.steps):  # interleaved: load changes fall on every side alike
        for name, step in steps.items():
            elapsed[name] += _seconds(step)
    ntok = args.batch * args.seq * args.steps
    if args.no_compile:
        elapsed["ours"] = elapsed["ours_eager"]
    print(json.dumps({"ours_tok_s": round(ntok / elapsed["ours"], 1),
                      "hf_tok_s": round(ntok / elapsed["hf"], 1),
                      "ratio": round(elapsed["hf"] / elapsed["ours"], 3),
                      "ours_eager_tok_s": round(ntok / elapsed["ours_eager"], 1),
                      "eager_ratio": round(elapsed["hf"] / elapsed["ours_eager"], 3),
                      "compiled": not args.no_compile, "batch": args.batch, "seq": args.seq,
                      "steps": args.steps, "threads": args.threads,
                      "transformers": transformers.__version__}))

if __name__ == "__main__":
    main()
